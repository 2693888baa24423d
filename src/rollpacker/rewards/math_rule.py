"""Rule-based math reward: the response's final answer checked against the reference by math-verify.

Scoring one sample (``score_math``): the model's answer is the text after the last ``Answer:`` in
the response (the whole response when there is none); math-verify parses it and the reference
(the reference raw first, then as LaTeX ``$...$`` if that gives nothing) and ``verify``\\ s them.
Reward 1.0 when they match, else 0.0. Equality is math-verify's: numeric and symbolic, so
``07``, ``7.0``, ``\\boxed{7}`` and ``x = 7`` all match ``7``, and ``1,000`` matches ``1000``.
math-verify takes the *last* number of plain text, so ``Answer: 7, not 8`` reads as 8.

Why worker processes: math-verify bounds its own time with ``signal.alarm``, which works only in
a process's main thread, and sympy can take unbounded time on inputs like ``9**9**9**9``. So
``MathReward`` scores in a ``ProcessPoolExecutor`` of *spawned* (never forked: the parent runs vLLM
and other threads) workers, calls math-verify with its own timeouts off, and bounds each sample
itself: a ``SIGALRM`` interval timer (``ITIMER_REAL``) raises ``ScoringTimeout`` (a
``BaseException``, which math-verify's ``except Exception`` cannot swallow; it re-fires every
0.1 s in case sympy swallows it anyway) after ``timeout_s`` of wall time, and a CPU-time
``ITIMER_PROF`` left at its default action kills the worker outright if it is still running after
``hard_cpu_s`` of CPU (C code that never returns to the interpreter).

Invariants:
- ``score_math`` is a pure function of (response, reference) up to its time limit; it returns
  ``OK`` (reward 1.0 iff verified, ``correct`` == reward 1.0), ``WRONG_FORMAT`` when no answer
  parses, ``TIMEOUT`` past ``timeout_s``, ``ERROR`` when the reference itself does not parse;
- every submitted request's future resolves to a ``RewardResult`` with its ``sample_id``;
- at most ``workers`` samples are in the pool at once, so a worker that dies (``BrokenProcessPool``:
  killed by the hard limit, out of memory, a crash) fails only the samples in flight: a sample that
  was alone in the pool gets ``ERROR``; the others are retried once, one at a time, so the culprit
  is found and innocents are scored; the pool is recreated for later samples;
- startup is cheap: no process starts before the first ``submit``, and ``MathReward`` imports
  math-verify only in its workers (each imports it and warms it up once, outside any time limit);
- ``close()`` resolves queued samples as ``ERROR``, lets the ones in flight finish (at most
  ``timeout_s`` each), joins every worker (none is left running) and is idempotent.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import multiprocessing
import re
import signal
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from types import FrameType
from typing import Any

from rollpacker.core.errors import ConfigError
from rollpacker.core.tasks import RewardKind
from rollpacker.rewards.base import ClosesOnExit, RewardFunction, RewardRequest, RewardResult, RewardStatus

ANSWER_MARK = "Answer:"
RETRY_INTERVAL_S = 0.1  # the soft timer re-fires this often after the first expiry
_DETAIL_CHARS = 80
_WORDS = re.compile(r"[A-Za-z\s]+")

log = logging.getLogger(__name__)


class ScoringTimeout(BaseException):
    """Raised by the SIGALRM handler when a sample's scoring runs past its time limit.

    A ``BaseException`` so that math-verify's and sympy's ``except Exception`` do not swallow it.
    """


def extract_answer(response: str) -> str:
    """The text after the last ``Answer:`` of the response, or the whole response without one."""
    _, mark, tail = response.rpartition(ANSWER_MARK)
    return tail if mark else response


def _snippet(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _DETAIL_CHARS else text[: _DETAIL_CHARS - 3] + "..."


def _quiet_math_verify() -> None:
    """math-verify warns once per process that its timeouts are off: they are, on purpose."""
    import math_verify.grader
    import math_verify.parser

    for mod in (math_verify.parser, math_verify.grader):
        if hasattr(mod, "TIMEOUT_WARNING_SHOWN"):
            mod.TIMEOUT_WARNING_SHOWN = True


def _parse(text: str) -> list[Any]:
    from math_verify import parse

    return list(parse(text, parsing_timeout=None))  # None: no signal.alarm (we time it ourselves)


def _parse_reference(reference: str) -> list[Any]:
    gold = _parse(reference)
    if not gold and "$" not in reference and not _WORDS.fullmatch(reference):
        # bare LaTeX like \frac{1}{2}, x^2+1 or (1, 2); plain words would read as a product of symbols
        gold = _parse(f"${reference}$")
    return gold


def _matched_text(parsed: list[Any]) -> str:
    # math-verify returns [sympy object, matched string]; str() of the sympy object can itself be
    # very slow on huge expressions, so report the matched string.
    return next((p for p in parsed if isinstance(p, str)), "?")


def _score_untimed(response: str, reference: str) -> tuple[RewardStatus, bool, str]:
    from math_verify import verify

    gold = _parse_reference(reference)
    if not gold:
        return (
            RewardStatus.ERROR,
            False,
            f"reference {_snippet(reference)!r} does not parse as math; fix the dataset's answer",
        )
    answer = extract_answer(response)
    pred = _parse(answer)
    if not pred:
        return RewardStatus.WRONG_FORMAT, False, f"no answer parsed from {_snippet(answer)!r}"
    ok = bool(verify(gold, pred, timeout_seconds=None))
    return RewardStatus.OK, ok, f"answer {_snippet(_matched_text(pred))!r}"


class _SoftTimer:
    """``ITIMER_REAL`` + a SIGALRM handler that raises ``ScoringTimeout`` while armed."""

    def __init__(self) -> None:
        self.armed = False
        self.fired = False
        self._old_handler: Any = None

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.armed:
            self.fired = True
            raise ScoringTimeout

    def arm(self, timeout_s: float) -> None:
        self._old_handler = signal.signal(signal.SIGALRM, self._handler)
        self.armed = True
        signal.setitimer(signal.ITIMER_REAL, timeout_s, RETRY_INTERVAL_S)

    def disarm(self) -> None:
        self.armed = False  # first: a handler that runs after this line does nothing
        signal.setitimer(signal.ITIMER_REAL, 0.0)
        if self._old_handler is not None:
            signal.signal(signal.SIGALRM, self._old_handler)
            self._old_handler = None


def score_math(
    response: str, reference: str, timeout_s: float | None = 5.0, sample_id: str = ""
) -> RewardResult:
    """Score one response synchronously (see the module docstring for the rules).

    With ``timeout_s`` set, the limit is enforced with SIGALRM, so this must run in the main thread
    of its process (``MathReward``'s workers do); it takes over SIGALRM and ``ITIMER_REAL`` for its
    duration and restores the handler after. ``timeout_s=None`` runs unbounded, in any thread.
    """
    t0 = time.perf_counter()
    if timeout_s is not None and timeout_s <= 0:
        raise ConfigError(f"timeout_s = {timeout_s!r}: must be > 0 (or None for no limit)")
    if timeout_s is not None and threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "score_math bounds its time with SIGALRM, which works only in the main thread: call it "
            "from the main thread, pass timeout_s=None, or use MathReward (it scores in worker processes)"
        )
    _quiet_math_verify()  # imports math-verify: never under the timer (a half-done import is broken)
    timer = _SoftTimer()
    status, correct, detail = RewardStatus.ERROR, False, ""
    try:
        try:
            if timeout_s is not None:
                timer.arm(timeout_s)
            status, correct, detail = _score_untimed(response, reference)
        finally:
            timer.disarm()
    except ScoringTimeout:
        timer.disarm()
    except Exception as e:  # math-verify swallows its own errors; this is a last resort
        status, correct, detail = RewardStatus.ERROR, False, f"scoring raised {type(e).__name__}: {e}"
    if timer.fired:
        _clear_sympy_cache()  # a half-done computation may have cached huge intermediates
        status, correct = RewardStatus.TIMEOUT, False
        detail = f"scoring took more than {timeout_s:g} s; answer {_snippet(extract_answer(response))!r}"
    return RewardResult(
        sample_id=sample_id,
        reward=1.0 if correct else 0.0,
        correct=correct,
        status=status,
        elapsed_s=time.perf_counter() - t0,
        detail=detail,
    )


def _clear_sympy_cache() -> None:
    try:
        from sympy.core.cache import clear_cache

        clear_cache()
    except Exception:  # pragma: no cover - only a memory optimisation
        pass


# --- worker process side --------------------------------------------------------------------------


def _worker_init() -> None:
    """Runs once in each spawned worker: import math-verify, own SIGPROF, ignore Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    signal.signal(signal.SIGPROF, signal.SIG_DFL)  # default action: terminate (the hard limit)
    _quiet_math_verify()
    _score_untimed("Answer: 1", "1")  # warm up math-verify's regexes and sympy


def worker_score(response: str, reference: str, timeout_s: float, hard_cpu_s: float) -> RewardResult:
    """The worker's entry point: ``score_math`` under a hard CPU-time limit that kills the process.

    Only for processes that may die (a pool worker): SIGPROF's default action terminates.
    """
    signal.setitimer(signal.ITIMER_PROF, hard_cpu_s)
    try:
        return score_math(response, reference, timeout_s)
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0.0)


# --- parent side ------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Job:
    req: RewardRequest
    future: Future[RewardResult]
    suspect: bool = False  # in flight when a worker died, with others: rerun alone
    alone: bool = False  # the only sample in the pool while it ran
    t_launch: float = 0.0


class MathReward(RewardFunction, ClosesOnExit):
    """Math-verify reward scored in ``workers`` spawned processes, ``timeout_s`` per sample.

    ``timeout_s`` is the wall-time limit of one sample's scoring (status ``TIMEOUT``); ``hard_cpu_s``
    the CPU-time limit after which its worker is killed (status ``ERROR``), for code that the soft
    limit cannot interrupt; it defaults to ``max(2 * timeout_s, timeout_s + 5)``.
    """

    def __init__(self, workers: int = 1, timeout_s: float = 5.0, hard_cpu_s: float | None = None) -> None:
        if workers < 1:
            raise ConfigError(f"workers = {workers}: must be >= 1")
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s = {timeout_s!r}: must be > 0")
        self.kind = RewardKind.MATH
        self.workers = workers
        self.timeout_s = float(timeout_s)
        self.hard_cpu_s = float(hard_cpu_s) if hard_cpu_s is not None else max(2 * timeout_s, timeout_s + 5)
        if not self.hard_cpu_s > 0:
            raise ConfigError(f"hard_cpu_s = {hard_cpu_s!r}: must be > 0 (or None for the default)")
        self.worker_deaths = 0  # pool breaks seen (a counter for metrics)
        self._lock = threading.Lock()
        self._queue: collections.deque[_Job] = collections.deque()
        self._inflight = 0
        self._isolating = False  # a suspect runs alone: launch nothing else
        self._pool: ProcessPoolExecutor | None = None
        self._generation = 0
        self._retired: list[threading.Thread] = []  # joining pools broken by a dead worker
        self._closed = False

    # -- public ----------------------------------------------------------------------------------

    def submit(self, req: RewardRequest) -> Future[RewardResult]:
        if req.example.reward_kind is not RewardKind.MATH:
            raise ConfigError(
                f"sample {req.sample_id!r}: example {req.example.example_id!r} has reward kind "
                f"{req.example.reward_kind.value!r}, not 'math'; route it with RewardRouter"
            )
        fut: Future[RewardResult] = Future()
        fut.set_running_or_notify_cancel()  # not cancellable: it always resolves to a RewardResult
        with self._lock:
            if self._closed:
                raise RuntimeError("MathReward is closed; create a new one to score more samples")
            self._queue.append(_Job(req, fut))
        self._pump()
        return fut

    def close(self) -> None:
        """Resolve queued samples as ``ERROR``, finish those in flight, join every worker."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._queue)
            self._queue.clear()
            pool, self._pool = self._pool, None
            retired = list(self._retired)
        for job in pending:
            self._resolve(job, self._error(job, "MathReward was closed before this sample was scored"))
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        for t in retired:
            t.join()

    # -- dispatch --------------------------------------------------------------------------------

    def _new_pool(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(
            max_workers=self.workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_worker_init,
        )

    def _retire_pool(self, generation: int) -> None:
        """Drop the pool of ``generation`` (broken) if it is still the current one."""
        with self._lock:
            if generation != self._generation or self._pool is None:
                return
            old, self._pool = self._pool, None
            self._generation += 1
            self.worker_deaths += 1
            t = threading.Thread(target=old.shutdown, kwargs={"wait": True}, daemon=True)
            self._retired = [r for r in self._retired if r.is_alive()] + [t]
        log.warning("a math reward worker died; starting a new pool")
        t.start()

    def _pump(self) -> None:
        """Launch queued jobs while a worker slot is free (suspects only into an empty pool)."""
        while True:
            with self._lock:
                if self._closed or not self._queue or self._isolating or self._inflight >= self.workers:
                    return
                job = self._queue[0]
                if job.suspect and self._inflight > 0:
                    return
                self._queue.popleft()
                self._inflight += 1
                self._isolating = job.suspect
                job.alone = job.suspect or self.workers == 1
                if self._pool is None:
                    self._pool = self._new_pool()
                pool, generation = self._pool, self._generation
            job.t_launch = time.perf_counter()
            try:
                pool_future = pool.submit(
                    worker_score, job.req.response, job.req.example.reference, self.timeout_s, self.hard_cpu_s
                )
            except BrokenProcessPool:  # broke since we took it: put the job back, use a new pool
                with self._lock:
                    self._inflight -= 1
                    self._isolating = False
                    self._queue.appendleft(job)
                self._retire_pool(generation)
                continue
            except Exception as e:  # shut down by a racing close(), or the worker could not start
                self._finish(job, self._error(job, f"could not start scoring: {type(e).__name__}: {e}"))
                continue
            pool_future.add_done_callback(functools.partial(self._on_done, job, generation))

    def _on_done(self, job: _Job, generation: int, pool_future: Future[RewardResult]) -> None:
        if pool_future.cancelled():
            self._finish(job, self._error(job, "MathReward was closed before this sample was scored"))
            return
        exc = pool_future.exception()
        if exc is None:
            result = dataclasses.replace(pool_future.result(), sample_id=job.req.sample_id)
            self._finish(job, result)
            return
        if isinstance(exc, BrokenProcessPool):
            self._retire_pool(generation)
            if not job.alone:
                with self._lock:
                    retry = not self._closed
                    if retry:
                        self._inflight -= 1
                        job.suspect = True
                        self._queue.appendleft(job)
                if retry:
                    self._pump()
                    return
            self._finish(
                job,
                self._error(
                    job,
                    "the worker process died while scoring this sample (killed past the hard CPU limit "
                    f"of {self.hard_cpu_s:g} s, out of memory, or crashed)",
                ),
            )
            return
        self._finish(job, self._error(job, f"scoring raised {type(exc).__name__}: {exc}"))

    def _finish(self, job: _Job, result: RewardResult) -> None:
        with self._lock:
            self._inflight -= 1
            if job.suspect:
                self._isolating = False
        self._resolve(job, result)
        self._pump()

    @staticmethod
    def _resolve(job: _Job, result: RewardResult) -> None:
        job.future.set_result(result)

    @staticmethod
    def _error(job: _Job, detail: str) -> RewardResult:
        elapsed = time.perf_counter() - job.t_launch if job.t_launch else 0.0
        return RewardResult(job.req.sample_id, 0.0, False, RewardStatus.ERROR, elapsed, detail)
