"""The reward services: rule and sandbox rewards (role ``reward``) and the LLM judge (``judge``).

Each scores a response the moment the rollout service reports it (``score``), while rollout goes
on; when a group is final and all its rewards are in, it computes the group's advantages and hands
the samples to the trainer service, which accumulates their gradient during rollout. The reward
and judge stages only ``drain`` what is left after rollout and report the step's reward metrics.

Invariants:
- only the current attempt's responses are scored into a step; a late call of an older attempt
  is dropped (a re-run after a crash never mixes two attempts);
- a response is scored once: ``group`` and ``group_rewards`` (dynamic sampling) reuse the score
  ``score`` started, and a late ``score`` of a response already scored or grouped is ignored;
- every group handed to the trainer carries all its rewards;
- the sandbox's timeout anchors restart from the committed state at every attempt (``begin``);
  anchors from reference solutions (``reward.sandbox.reference_anchors``, ``rewards/reference.py``)
  are anchors like any other: reported by ``drain``, committed, restored by the next ``begin``;
- measuring the synchronous stage never changes the anchors the drain reports.

Metrics (role ``reward``; ``judge/...`` for the judge): ``mean``, ``tail_s`` (reward time left
after rollout ended), latencies, ``timeouts`` (responses stopped by a time limit), ``cut`` (those
stopped by an adaptive limit below ``T_max``: a correct but slow response among them is misjudged;
only a re-run could tell, ``rollpacker.lab.bench.reward_tail`` does that), ``wasted``, ``samples``;
with reference anchors ``reference_runs`` / ``reference_failed`` / ``reference_s`` (references
timed into anchors / that failed their own tests or ran past ``T_max`` / sandbox seconds they took).

With ``reward.measure_sync_stage`` the drain also scores the step's trained responses again, all
at once, from the anchors the step began with: the synchronous reward stage the step would have
had (``reward/sync_stage_s``), to set beside ``reward/tail_s``.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass, field

from rollpacker.core.advantages import train_samples
from rollpacker.core.errors import RewardError, TrainerError
from rollpacker.core.tasks import RewardKind, TaskExample
from rollpacker.core.timeout import AdaptiveTimeout
from rollpacker.core.types import Group, Role
from rollpacker.rewards.base import RewardRequest, RewardResult, RewardRouter
from rollpacker.rewards.code import CodeReward
from rollpacker.rewards.factory import build_rewards
from rollpacker.rewards.reference import ReferenceStats, ReferenceTimer
from rollpacker.services.api import (
    Anchors,
    DrainReport,
    GroupRewards,
    RewardAPI,
    RewardBegin,
    ScoreItem,
)
from rollpacker.services.base import Service
from rollpacker.tasks.registry import load_task

ROLE_KINDS = {"reward": (RewardKind.MATH, RewardKind.CODE), "judge": (RewardKind.JUDGE,)}


@dataclass
class _Attempt:
    attempt: str
    early: dict[str, Future[RewardResult]] = field(default_factory=dict)  # scored, not yet grouped
    grouped: set[str] = field(default_factory=set)  # request ids a group took
    pending: int = 0  # groups waiting for rewards
    groups_done: list[str] = field(default_factory=list)  # prompt ids handed to the trainer
    results: list[RewardResult] = field(default_factory=list)
    kinds: list[RewardKind] = field(default_factory=list)
    requests: list[RewardRequest] = field(default_factory=list)  # every response scored into the step
    last_done_wall: float = 0.0
    error: BaseException | None = None
    anchors: Anchors = ()  # the committed anchors the attempt began with
    references: ReferenceStats = field(default_factory=ReferenceStats)  # the timer's, at begin


class RewardService(Service, RewardAPI):
    def __init__(self, config_text: str, arm: str, role: Role = Role.REWARD) -> None:
        super().__init__(config_text, arm, role)
        if role not in ROLE_KINDS:
            raise RewardError(f"reward service role {role!r}: use 'reward' or 'judge'")
        self.kinds = ROLE_KINDS[role]
        self.timeouts = AdaptiveTimeout(self.cfg.reward.sandbox.timeouts())
        self._router: RewardRouter | None = None
        self._examples: dict[str, TaskExample] = {}
        self._lock = threading.Condition()
        self._cur = _Attempt("")

    def _ready(self) -> None:
        """Build the reward functions of this role's kinds the task uses (once per process)."""
        if self._router is not None:
            return
        t = self.cfg.task
        examples = load_task(self.dataset(), seed=t.seed, num_examples=t.num_examples, shape=t.shape.items())
        mine = [ex for ex in examples if ex.reward_kind in self.kinds]
        self._examples = {ex.example_id: ex for ex in mine}
        self._router = build_rewards(self.cfg, mine, self.timeouts, quiet=True) if mine else None

    def begin(self, attempt: str, anchors: Anchors) -> RewardBegin:
        """Start an attempt: forget the previous one, restore the committed timeout anchors."""
        t0 = time.perf_counter()
        self.peers.refresh()  # a trainer rebuilt since the last attempt is the one to hand groups to
        self._ready()
        self.timeouts.reset(dict(anchors))
        with self._lock:
            timer = self._reference_timer()
            refs = timer.stats() if timer is not None else ReferenceStats()
            self._cur = _Attempt(attempt, anchors=tuple(anchors), references=refs)
        return RewardBegin(time.perf_counter() - t0, tuple(k.value for k in self.kinds))

    def _submit(self, sample_id: str, prompt_id: str, text: str) -> Future[RewardResult]:
        ex = self._examples.get(prompt_id)
        if ex is None or self._router is None:
            raise RewardError(f"{self.role} service: prompt {prompt_id!r} is not of kinds {self.kinds}")
        req = RewardRequest(sample_id=sample_id, example=ex, response=text)
        if self.cfg.reward.measure_sync_stage and not sample_id.endswith("#val"):
            with self._lock:
                self._cur.requests.append(req)
        return self._router.submit(req)

    def score(self, attempt: str, request_id: str, prompt_id: str, text: str) -> None:
        with self._lock:
            cur = self._cur
            if cur.attempt != attempt or request_id in cur.grouped or request_id in cur.early:
                return
        fut = self._submit(request_id, prompt_id, text)
        with self._lock:
            if self._cur is cur and request_id not in cur.grouped:
                cur.early.setdefault(request_id, fut)  # a group_rewards that raced it keeps its own

    def group_rewards(self, attempt: str, group: Group, texts: tuple[str, ...]) -> GroupRewards:
        """A complete group's rewards, waited for (at most ``services.call_timeout_s``): dynamic
        sampling keeps or drops the group on them. Each response's score is the one ``score``
        started (or started here) and stays in the attempt, so the ``group`` that follows for a
        kept group reuses it; a dropped group's scores are never grouped (``reward/wasted``)."""
        with self._lock:
            cur = self._cur
            if cur.attempt != attempt:
                raise RewardError(
                    f"{self.role} service: rewards of group {group.prompt.prompt_id!r} of attempt "
                    f"{attempt}, but the service is on attempt {cur.attempt or '(none: rebuilt since)'}; "
                    "re-run the step from its plan"
                )
            todo = [
                (c, t) for c, t in zip(group.responses, texts, strict=True) if c.request_id not in cur.early
            ]
        new = {c.request_id: self._submit(c.request_id, c.prompt_id, t) for c, t in todo}
        with self._lock:
            for rid, f in new.items():
                cur.early.setdefault(rid, f)
            futs = [cur.early[c.request_id] for c in group.responses]
        timeout_s = self.cfg.services.call_timeout_s
        _, waiting = wait(futs, timeout=timeout_s)
        if waiting:
            raise RewardError(
                f"{self.role} service: {len(waiting)} rewards of group {group.prompt.prompt_id!r} not "
                f"in after services.call_timeout_s = {timeout_s} s"
            )
        try:
            rewards = tuple(f.result().reward for f in futs)
        except Exception as e:
            raise RewardError(
                f"{self.role} service: scoring group {group.prompt.prompt_id!r} failed: {e}"
            ) from e
        return GroupRewards(group.prompt.prompt_id, rewards)

    def group(self, attempt: str, group: Group, texts: tuple[str, ...]) -> None:
        """A final group (``texts``: its responses decoded); rewarded groups go to the trainer."""
        with self._lock:
            cur = self._cur
            if cur.attempt != attempt:
                return
            cur.pending += 1
            early = []
            for c in group.responses:
                cur.grouped.add(c.request_id)
                early.append(cur.early.pop(c.request_id, None))
        futs = [
            f if f is not None else self._submit(c.request_id, c.prompt_id, t)
            for f, c, t in zip(early, group.responses, texts, strict=True)
        ]
        ex_kind = self._examples[group.prompt.prompt_id].reward_kind
        box: list[RewardResult | None] = [None] * len(futs)
        left = [len(futs)]

        def done(i: int, f: Future[RewardResult]) -> None:
            try:
                res = f.result()
            except BaseException as e:
                with self._lock:
                    cur.error = e
                    cur.pending -= 1
                    self._lock.notify_all()
                return
            with self._lock:
                box[i] = res
                left[0] -= 1
                if left[0]:
                    return
            got = [r for r in box if r is not None]
            samples = train_samples(group, [r.reward for r in got], shaping=self.cfg.shaping())
            with self._lock:
                if self._cur is not cur:
                    return
                self.peers.trainer().submit(attempt, group.prompt.prompt_id, tuple(samples))
                cur.results.extend(got)
                cur.kinds.extend([ex_kind] * len(got))
                cur.groups_done.append(group.prompt.prompt_id)
                cur.pending -= 1
                cur.last_done_wall = time.time()
                self._lock.notify_all()

        for i, fut in enumerate(futs):
            fut.add_done_callback(functools.partial(done, i))

    def _wait(self, done: Callable[[], bool], attempt: str, timeout_s: float) -> bool:
        """Wait (holding ``self._lock``) until ``done``, in slices of a second: a rewarded group
        handed to the trainer that failed (the trainer raised or died) fails the wait at once."""
        deadline = time.monotonic() + timeout_s
        while not self._lock.wait_for(done, timeout=min(1.0, max(deadline - time.monotonic(), 0.0))):
            failed = self.peers.cast_failure(attempt)
            if failed is not None:
                raise RewardError(f"{self.role} service: drain of attempt {attempt} cannot finish: {failed}")
            if time.monotonic() >= deadline:
                return False
        return True

    def drain(self, attempt: str, expected: tuple[str, ...], rollout_end_wall: float) -> DrainReport:
        """Wait for every expected group's rewards; the step's reward metrics and timeout anchors."""
        t0 = time.perf_counter()
        timeout_s = self.cfg.services.call_timeout_s
        want = set(expected)
        with self._lock:
            cur = self._cur
            if cur.attempt != attempt:
                if not cur.attempt:
                    raise RewardError(
                        f"{self.role} service: drain of attempt {attempt}, but this service was rebuilt "
                        "since the attempt began (the one that scored it died); re-run the step from its plan"
                    )
                raise RewardError(
                    f"{self.role} service: drain of attempt {attempt}, but the service is on attempt "
                    f"{cur.attempt}; re-run the step from its plan"
                )
            ok = self._wait(lambda: cur.error is not None or want <= set(cur.groups_done), attempt, timeout_s)
            if cur.error is not None:
                raise RewardError(f"{self.role} service: scoring failed: {cur.error}") from cur.error
            if not ok:
                missing = sorted(want - set(cur.groups_done))
                raise TrainerError(
                    f"{self.role} service: {len(missing)} groups unrewarded after {timeout_s} s"
                )
            results, kinds, wasted = list(cur.results), list(cur.kinds), len(cur.early)
            trained = [r for r in cur.requests if r.sample_id in cur.grouped]
        tail_s = max(0.0, cur.last_done_wall - rollout_end_wall) if results else 0.0
        metrics = self._metrics(results, kinds, wasted, tail_s)
        if results:
            metrics.update(self._reference_metrics(cur.references))
        if trained:
            metrics["reward/sync_stage_s"] = self._sync_stage(trained, cur.anchors)
        return DrainReport(
            role=self.role,
            drain_s=time.perf_counter() - t0,
            groups=len(want),
            samples=len(results),
            reward_sum=sum(r.reward for r in results),
            metrics=metrics,
            tail_s=tail_s,
            timeout_anchors=tuple(sorted(self.timeouts.anchors().items()))
            if self.role is Role.REWARD
            else (),
        )

    def _metrics(
        self, results: list[RewardResult], kinds: list[RewardKind], wasted: int, tail_s: float
    ) -> dict[str, float]:
        if not results:
            return {}
        pre = "judge" if self.role is Role.JUDGE else "reward"
        rewards = [r.reward for r in results]
        lat = [r.elapsed_s for r in results]
        m = {
            f"{pre}/mean": sum(rewards) / len(rewards),
            f"{pre}/tail_s": max(0.0, tail_s),
            f"{pre}/latency_s_mean": sum(lat) / len(lat),
            f"{pre}/latency_s_max": max(lat),
            f"{pre}/timeouts": float(sum(r.status.value == "timeout" for r in results)),
            f"{pre}/cut": float(sum(r.cut_at_s > 0 for r in results)),
            f"{pre}/wasted": float(wasted),
            f"{pre}/samples": float(len(results)),
        }
        by: dict[str, list[float]] = {}
        for r, k in zip(results, kinds, strict=True):
            by.setdefault(k.value, []).append(r.reward)
        for name, v in sorted(by.items()):
            m[f"reward/{name}_mean"] = sum(v) / len(v)
        return m

    def _sync_stage(self, requests: list[RewardRequest], anchors: Anchors) -> float:
        """Seconds to score ``requests`` again, all at once after rollout, from the anchors the step
        began with (a synchronous stage); the anchors the step reached are restored after."""
        router = self._router
        if router is None:
            return 0.0
        reached = self.timeouts.anchors()
        self.timeouts.reset(dict(anchors))
        try:
            t0 = time.perf_counter()
            futs = [router.submit(dataclasses.replace(r, sample_id=f"{r.sample_id}#sync")) for r in requests]
            for f in futs:
                f.result()
            return time.perf_counter() - t0
        finally:
            timer = self._reference_timer()
            if timer is not None:  # a reference the stage queued must not land in the step's anchors
                timer.wait_idle(self.timeouts.config.t_max_s * 2 + 5)
            self.timeouts.reset(reached)

    def _reference_metrics(self, at_begin: ReferenceStats) -> dict[str, float]:
        """What the reference timing did since ``begin`` (nothing when it is off)."""
        timer = self._reference_timer()
        if timer is None:
            return {}
        refs = timer.stats().minus(at_begin)
        return {
            "reward/reference_runs": float(refs.runs),
            "reward/reference_failed": float(refs.failed),
            "reward/reference_s": refs.seconds,
        }

    def _reference_timer(self) -> ReferenceTimer | None:
        """The code reward's reference timer (None: no code reward, or reference anchors off)."""
        router = self._router
        if router is None or RewardKind.CODE not in router.kinds:
            return None
        fn = router.function_for(RewardKind.CODE)
        return fn.references if isinstance(fn, CodeReward) else None

    def results(self, attempt: str) -> tuple[RewardResult, ...]:
        """The rewards of ``attempt``'s grouped responses so far (in-process callers: benchmarks,
        tests; not part of ``RewardAPI``)."""
        with self._lock:
            return tuple(self._cur.results) if self._cur.attempt == attempt else ()

    def score_now(self, items: tuple[ScoreItem, ...]) -> tuple[bool, ...]:
        """Score items at once and wait (validation)."""
        self._ready()
        futs = [self._submit(f"{it.sample_id}#val", it.prompt_id, it.text) for it in items]
        return tuple(f.result().correct for f in futs)

    def close(self) -> None:
        if self._router is not None:
            self._router.close()
            self._router = None
