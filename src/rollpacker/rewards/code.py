"""The code reward: a response's program run against its example's test cases in the sandbox.

``CodeReward`` scores ``code`` examples asynchronously: ``submit`` queues the sample and returns a
future; ``workers`` threads each drive one sandbox run at a time (the work happens in the jailed
process, so threads are enough). Each test case runs with the adaptive timeout of its key
(``AdaptiveTimeout``, RollPacker section 4.3): ``min(max(T_min, lambda * T_anchor), T_max)``, where
``T_anchor`` is the slowest run of that case among *correct* responses so far. A response that
passes every case is correct (reward 1.0) and may raise its cases' anchors; one that fails a case
gets 0.0 (status ``OK``: it was judged); one that runs past a case's timeout gets 0.0 with status
``TIMEOUT``; a sandbox failure is ``ERROR`` with the sandbox's detail. A timeout that stopped a
case at an adaptive limit below ``T_max`` is a *cut*: the result's ``cut_at_s`` is that limit.

With ``references=True`` each example's reference solution (``rewards.reference``) is timed once,
queued ahead of the example's first response, and its per-case times are the cases' first anchors,
so a doomed response is cut at ``max(T_min, lambda * T_reference)`` even before any correct sibling
exists (see ``rewards/reference.py`` for when and why so).

The program: the first fenced code block of the response (```` ```python ... ``` ````) when there
is one, else the whole response; with ``metadata["completion"]`` (HumanEval) the prompt comes first,
as HumanEval runs ``prompt + completion``.

Invariants (those of ``rewards.base`` plus):
- only a response that passed every case moves anchors (``AdaptiveTimeout.observe``), and so
  does a reference solution that passed every case (a correct run too);
- ``cut_at_s > 0`` only on a ``TIMEOUT`` whose case was stopped at a limit below ``T_max``;
- each case's timeout is live: read when the run starts and again while the case runs, so a doomed
  response started before any correct one finished is cut as soon as one does (limits only
  tighten; a response is never judged under a limit looser than the one it started with);
- ``close()`` resolves queued samples as ``ERROR``, waits for running ones, and is idempotent.
"""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from rollpacker.core.errors import ConfigError
from rollpacker.core.tasks import RewardKind, TaskExample
from rollpacker.core.timeout import AdaptiveTimeout
from rollpacker.rewards.base import ClosesOnExit, RewardFunction, RewardRequest, RewardResult, RewardStatus
from rollpacker.rewards.reference import ReferenceStats, ReferenceTimer

if TYPE_CHECKING:
    from rollpacker.rewards.sandbox import Sandbox, SandboxResult

_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_program(example: TaskExample, response: str) -> str:
    """The program to run for ``response`` (see the module docstring)."""
    m = _FENCE.search(response)
    body = m.group(1) if m else response
    if example.metadata.get("completion"):
        return example.prompt + body
    return body


class CodeReward(RewardFunction, ClosesOnExit):
    """Sandboxed test execution with adaptive per-case timeouts, ``workers`` runs at a time."""

    def __init__(
        self,
        sandbox: Sandbox | None = None,
        timeouts: AdaptiveTimeout | None = None,
        workers: int = 2,
        references: bool = False,
    ) -> None:
        if workers < 1:
            raise ConfigError(f"reward.sandbox.workers = {workers}: must be >= 1")
        if sandbox is None:
            from rollpacker.rewards.sandbox import Sandbox

            sandbox = Sandbox()
        self.kind = RewardKind.CODE
        self.sandbox = sandbox
        self.timeouts = timeouts if timeouts is not None else AdaptiveTimeout()
        self.workers = workers
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="code-reward")
        self._lock = threading.Lock()
        self._closed = False
        self.timeouts_hit = 0  # runs cut by a timeout (a counter for metrics)
        # examples' reference solutions timed as first anchors (None: off)
        self.references = ReferenceTimer(sandbox, self.timeouts) if references else None

    def submit(self, req: RewardRequest) -> Future[RewardResult]:
        if req.example.reward_kind is not RewardKind.CODE:
            raise ConfigError(
                f"sample {req.sample_id!r}: example {req.example.example_id!r} has reward kind "
                f"{req.example.reward_kind.value!r}, not 'code'; route it with RewardRouter"
            )
        out: Future[RewardResult] = Future()
        out.set_running_or_notify_cancel()
        with self._lock:
            if self._closed:
                raise RuntimeError("CodeReward is closed; create a new one to score more samples")
            self._queue_reference(req.example)
            inner = self._pool.submit(self._score, req)

        def done(f: Future[RewardResult]) -> None:
            if f.cancelled():
                out.set_result(_error(req, 0.0, "CodeReward was closed before this sample was scored"))
            elif f.exception() is not None:
                exc = f.exception()
                out.set_result(_error(req, 0.0, f"scoring raised {type(exc).__name__}: {exc}"))
            else:
                out.set_result(f.result())

        inner.add_done_callback(done)
        return out

    def _queue_reference(self, ex: TaskExample) -> None:
        """Queue the timing of ``ex``'s reference solution, if it needs one (ahead of the response)."""
        if self.references is None:
            return
        refs = self.references
        text = refs.claim(ex)
        if text is None:
            return
        try:
            fut = self._pool.submit(refs.run, ex, extract_program(ex, text))
        except BaseException:
            refs.release(ex)
            raise
        fut.add_done_callback(lambda f: refs.release(ex) if f.cancelled() else None)

    def reference_stats(self) -> ReferenceStats:
        """What the reference timing did so far (all zero when it is off)."""
        return self.references.stats() if self.references is not None else ReferenceStats()

    def score(self, req: RewardRequest) -> RewardResult:
        """Score one sample now, in this thread (its reference, if any, first)."""
        if self.references is not None:
            text = self.references.claim(req.example)
            if text is not None:
                self.references.run(req.example, extract_program(req.example, text))
        return self._score(req)

    def _score(self, req: RewardRequest) -> RewardResult:
        ex = req.example
        keys = ex.case_keys()
        limits = [self.timeouts.timeout_s(k) for k in keys]
        last = list(limits)  # each case's limit when the sandbox last read it

        def live(i: int) -> float:
            last[i] = self.timeouts.timeout_s(keys[i])
            return last[i]

        t0 = time.perf_counter()
        # live limits: an anchor that a faster correct response sets while this one runs cuts it then
        res: SandboxResult = self.sandbox.run(extract_program(ex, req.response), ex.tests, live)
        elapsed = time.perf_counter() - t0
        status = res.status.value
        if status == "passed":
            for key, case in zip(keys, res.tests, strict=False):
                self.timeouts.observe(key, case.exec_s, passed=True)
            return RewardResult(req.sample_id, 1.0, True, RewardStatus.OK, elapsed, _detail(res, limits))
        if status == "failed":
            return RewardResult(req.sample_id, 0.0, False, RewardStatus.OK, elapsed, _detail(res, limits))
        if status == "timeout":
            with self._lock:
                self.timeouts_hit += 1
            i = res.failed_index  # None: the program itself ran past code_s, before the cases
            cut = min(limits[i], last[i]) if i is not None and i < len(limits) else 0.0
            return RewardResult(
                req.sample_id,
                0.0,
                False,
                RewardStatus.TIMEOUT,
                elapsed,
                _detail(res, limits),
                cut_at_s=cut if cut < self.timeouts.config.t_max_s else 0.0,
            )
        return _error(req, elapsed, f"sandbox error: {res.detail}")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)


def _detail(res: SandboxResult, limits: list[float]) -> str:
    """``<status> [<case>:<status>(<seconds>/<limit at start>s), ...] <sandbox detail>``."""
    cases = ", ".join(
        f"{c.index}:{c.status.value}({c.exec_s:.2f}/{limits[c.index]:.1f}s)"
        for c in res.tests
        if c.index < len(limits)
    )
    return f"{res.status.value} [{cases}]" + (f" {res.detail}" if res.detail else "")


def _error(req: RewardRequest, elapsed: float, detail: str) -> RewardResult:
    return RewardResult(req.sample_id, 0.0, False, RewardStatus.ERROR, elapsed, detail)
