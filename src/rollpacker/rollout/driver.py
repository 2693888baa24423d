"""The runtime side of a round: submit, step the engine, feed completions back, apply aborts.

The driver knows nothing about any policy's rules; it only does what ``Round`` asks and records
what the engine did (per-step stats for the bubble ratio, token counts, preemptions).

Invariants:
- every request the round submits is reported back to it exactly once, finished or aborted
  (aborted ones carry the tokens and logprobs generated before the abort);
- when ``run_round`` returns, no request of the round is left on the engine;
- the engine's token count equals useful + wasted tokens of the round's result.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rollpacker.core.errors import EngineError, PolicyError
from rollpacker.core.metrics import RolloutMetrics, rollout_metrics
from rollpacker.core.policies.base import Round
from rollpacker.core.types import (
    Actions,
    Completion,
    EngineStepStats,
    FinishReason,
    GenerationRequest,
    Group,
    Prompt,
    RoundResult,
    SamplingSpec,
)
from rollpacker.engines.base import RolloutEngine

log = logging.getLogger(__name__)


@dataclass
class _Live:
    req: GenerationRequest
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class RoundRun:
    result: RoundResult
    metrics: RolloutMetrics
    steps: tuple[EngineStepStats, ...]
    engine_tokens: int  # tokens the engine reported, counted independently of the result


@dataclass
class _RoundDriver:
    """The mutable state of one ``run_round`` call and the steps that act on it."""

    engine: RolloutEngine
    rnd: Round
    policy_version: int
    on_group: Callable[[Group], None] | None
    on_response: Callable[[Completion], None] | None
    group_rewards: Callable[[Group], Sequence[float]] | None = None
    live: dict[str, _Live] = field(default_factory=dict)
    steps: list[EngineStepStats] = field(default_factory=list)
    engine_tokens: int = 0
    completed: int = 0

    def apply(self, actions: Actions) -> None:
        """Submit and abort what ``actions`` asks; feed each abort back to the round at once."""
        pending = [actions]
        while pending:
            act = pending.pop()
            for req in act.submit:
                if req.request_id in self.live:
                    raise EngineError(f"request {req.request_id!r} submitted twice in one round")
                self.engine.add_request(req)
                self.live[req.request_id] = _Live(req)
            to_abort = [rid for rid in act.abort if rid in self.live]
            if to_abort:
                self.engine.abort(to_abort)
                for rid in to_abort:
                    st = self.live.pop(rid)
                    done = _completion(st, FinishReason.ABORT, self.policy_version, self.engine.now())
                    pending.append(self.rnd.observe(done))

    def hand_out(self) -> None:
        """Score the groups a reward-deciding round asks about, then pass the groups the round has
        made final to ``on_group``."""
        if self.rnd.needs_rewards:
            if self.group_rewards is None:
                raise PolicyError(
                    f"step {self.rnd.plan.step}: this round decides on rewards "
                    "(rollout.dynamic_sampling.enabled), and run_round was given no group_rewards "
                    "to score its groups: pass group_rewards (the rollout service does)"
                )
            for g in self.rnd.take_unjudged():
                if self.rnd.done:
                    continue  # the update is full: the group is deferred, its rewards not needed
                self.apply(self.rnd.observe_rewards(g.prompt.prompt_id, tuple(self.group_rewards(g))))
        if self.on_group is not None:
            for g in self.rnd.take_completed():
                self.on_group(g)

    def check_can_step(self, max_engine_steps: int) -> None:
        """Raise if the round cannot make progress: the engine is dry or the step limit is hit."""
        if not self.engine.has_unfinished():
            raise EngineError(
                f"step {self.rnd.plan.step}: the engine ran dry with the round unfinished "
                f"({len(self.live)} requests unaccounted for)"
            )
        if len(self.steps) >= max_engine_steps:
            raise EngineError(f"step {self.rnd.plan.step}: gave up after {max_engine_steps} engine steps")

    def step(self) -> EngineStepStats:
        """Run one engine step and feed its updates (and finished responses) back to the round."""
        updates, stats = self.engine.step()
        self.steps.append(stats)
        for u in updates:
            st = self.live.get(u.request_id)
            if st is None:
                continue  # aborted earlier in this loop: the engine may still have reported it
            st.tokens.extend(u.new_token_ids)
            st.logprobs.extend(u.new_logprobs)
            self.engine_tokens += len(u.new_token_ids)
            if u.finished:
                del self.live[u.request_id]
                self.completed += 1
                reason = u.finish_reason or FinishReason.STOP
                done = _completion(st, reason, self.policy_version, self.engine.now())
                if self.on_response is not None:
                    self.on_response(done)
                self.apply(self.rnd.observe(done))
                self.hand_out()
        return stats

    def abort_live(self) -> None:
        """Abort every request of this round still running (the round failed); an engine that
        cannot take the abort (it died) is left as it is."""
        if not self.live:
            return
        ids = sorted(self.live)
        self.live.clear()
        try:
            self.engine.abort(ids)
        except Exception as e:  # the round's own error is the one to raise
            log.warning("could not abort the %d requests of a failed round: %s", len(ids), e)

    def abort_leftovers(self) -> None:
        """A round that is done but left requests running has a policy bug; don't leak them."""
        if self.live:
            leftover = sorted(self.live)
            self.engine.abort(leftover)
            raise EngineError(
                f"step {self.rnd.plan.step}: round finished with {len(leftover)} requests still "
                f"running (first: {leftover[0]!r}); the policy must abort what it does not wait for"
            )


def run_round(
    engine: RolloutEngine,
    rnd: Round,
    policy_version: int = 0,
    on_step: Callable[[EngineStepStats, int], None] | None = None,
    max_engine_steps: int = 10_000_000,
    on_group: Callable[[Group], None] | None = None,
    on_response: Callable[[Completion], None] | None = None,
    group_rewards: Callable[[Group], Sequence[float]] | None = None,
) -> RoundRun:
    """Drive ``rnd`` on ``engine`` to completion and return its result and metrics.

    ``on_step(stats, completed_so_far)`` is called after each engine step (progress bars);
    ``on_response(completion)`` as soon as a response finishes (not aborted), before its group is
    final (rewards start on it at once); ``on_group(group)`` as soon as a group is final (the
    stream trainer starts on it while the rest of the round runs); ``group_rewards(group)`` scores
    a complete group for a round that decides on rewards (DAPO's dynamic sampling) before it is final.
    """
    preempt0 = engine.num_preemptions()
    t0 = engine.now()
    drv = _RoundDriver(engine, rnd, policy_version, on_group, on_response, group_rewards)
    try:
        drv.apply(rnd.start())
        drv.hand_out()  # groups complete from a policy's cache are final before any engine step
        while not rnd.done:
            drv.check_can_step(max_engine_steps)
            stats = drv.step()
            if on_step is not None:
                on_step(stats, drv.completed)
    except BaseException:
        drv.abort_live()  # a failed round leaves nothing running: a re-run starts on a clean engine
        raise
    drv.abort_leftovers()
    elapsed = engine.now() - t0
    result = rnd.result()
    metrics = rollout_metrics(
        result,
        drv.steps,
        time_s=elapsed,
        concurrency=engine.concurrency,
        preemptions=engine.num_preemptions() - preempt0,
        train_version=policy_version,
    )
    return RoundRun(result=result, metrics=metrics, steps=tuple(drv.steps), engine_tokens=drv.engine_tokens)


def sample_requests(
    prompts: Sequence[Prompt], samples: int, sampling: SamplingSpec, id_prefix: str
) -> list[GenerationRequest]:
    """``samples`` requests per prompt (validation, evaluation), ids ``<id_prefix>/<prompt>/k<j>``."""
    return [
        GenerationRequest(
            request_id=f"{id_prefix}/{p.prompt_id}/k{j}", prompt=p, sample_index=j, sampling=sampling
        )
        for p in prompts
        for j in range(samples)
    ]


def generate(
    engine: RolloutEngine,
    requests: Sequence[GenerationRequest],
    on_done: Callable[[Completion], None] | None = None,
) -> list[Completion]:
    """Run ``requests`` to completion (no policy: validation, evaluation); results in input order."""
    live: dict[str, _Live] = {}
    done: dict[str, Completion] = {}
    for req in requests:
        if req.request_id in live:
            raise EngineError(f"request {req.request_id!r} given twice")
        engine.add_request(req)
        live[req.request_id] = _Live(req)
    while live:
        if not engine.has_unfinished():
            raise EngineError(f"the engine ran dry with {len(live)} requests unaccounted for")
        updates, _ = engine.step()
        for u in updates:
            st = live.get(u.request_id)
            if st is None:
                continue
            st.tokens.extend(u.new_token_ids)
            st.logprobs.extend(u.new_logprobs)
            if u.finished:
                del live[u.request_id]
                c = _completion(st, u.finish_reason or FinishReason.STOP, 0, engine.now())
                done[u.request_id] = c
                if on_done is not None:
                    on_done(c)
    return [done[r.request_id] for r in requests]


def _completion(st: _Live, reason: FinishReason, version: int, now: float) -> Completion:
    req = st.req
    return Completion(
        request_id=req.request_id,
        prompt_id=req.prompt.prompt_id,
        sample_index=req.sample_index,
        token_ids=req.prefix_token_ids + tuple(st.tokens),
        logprobs=req.prefix_logprobs + tuple(st.logprobs),
        finish_reason=reason,
        policy_version=version,
        resumed_tokens=len(req.prefix_token_ids),
        finished_at_s=now,
        prefix_versions=req.prefix_token_versions,
    )
