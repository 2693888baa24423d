"""Reference anchors: a task's reference solutions, timed in the sandbox, as first timeout anchors.

Before any correct response to an example exists its test cases have no adaptive-timeout anchor,
so a doomed (never-terminating) response runs to ``T_max``: the reward tail. Where an example
carries a reference solution, ``ReferenceTimer`` runs it once through the sandbox and, when it
passes every case, records its per-case times as anchors with ``AdaptiveTimeout.observe`` -- the
reference is a correct run, so RollPacker's rule (section 4.3) applies unchanged: ``T_anchor`` is
the slowest correct run so far, the reference's included, and the limit is
``min(max(T_min, lambda * T_anchor), T_max)``.

When: lazily, the first time an example is submitted for scoring (``CodeReward.submit``), not
all at service start. The reference run goes into the code reward's FIFO worker pool *ahead of*
that response, so it starts no later than the response does; and since every case's limit is
live (``Sandbox.run`` re-reads it while the case runs), the response is bounded by the reference's
anchor from the moment the reference passes -- tens of milliseconds after it started (one jail),
far before a doomed response reaches ``T_min``. Timing every reference at ``begin`` instead would
put one sandbox run per example of the task (2000 for configs/code.yaml: ~40 ms each, ~40 s of
both workers) in front of the first step, most of them for prompts the step never uses, or race
the rollout for the same workers from a background thread; waiting for the reference
before starting the response would idle a worker (and wait ``T_max`` for a reference that hangs).

Where references come from (``reference_response``): the example's ``metadata["solution"]``
(synthetic code task; any JSONL code line may carry one), else HumanEval's
``metadata["canonical_solution"]``. Either is *a response*: it goes through the same
``extract_program`` as the model's (so HumanEval's body follows the prompt).

Invariants:
- a reference moves anchors only when it passes every case, each by ``observe(..., passed=True)``
  (an anchor only grows; the merge with correct responses is the same max);
- a reference that fails a case, runs past ``T_max`` (it runs under ``T_max`` on every case, never
  under a tighter adaptive limit) or has a solution that is not a string gives no anchor, logs a
  warning naming the example (and the case), is counted in ``failed`` and is never run again in
  this process; its cases without an anchor keep ``T_max`` until a correct response anchors them;
- a sandbox failure (``error``) is logged and not remembered: the reference runs again the next
  time its example is submitted;
- an example is timed at most once at a time, and not at all while every case has an anchor (the
  anchors committed in the controller state carry reference anchors across steps and restarts).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rollpacker.core.tasks import TaskExample
from rollpacker.core.timeout import AdaptiveTimeout

if TYPE_CHECKING:
    from rollpacker.rewards.sandbox import Sandbox, SandboxResult

log = logging.getLogger(__name__)

SOLUTION_KEYS: tuple[str, ...] = ("solution", "canonical_solution")  # metadata keys, in this order


class BadReference(ValueError):
    """An example's reference solution field is present but not usable (not a non-empty string)."""


def reference_response(example: TaskExample) -> str | None:
    """The example's reference solution as a response text, or None when it has none.

    Raises ``BadReference`` naming the example and key when the field is there but not a
    non-empty string."""
    for key in SOLUTION_KEYS:
        if key not in example.metadata:
            continue
        v = example.metadata[key]
        if not isinstance(v, str) or not v.strip():
            raise BadReference(
                f"example {example.example_id!r}: metadata[{key!r}] must be the reference solution "
                f"(non-empty Python source), got {type(v).__name__} {str(v)[:40]!r}"
            )
        return v
    return None


@dataclass(frozen=True)
class ReferenceStats:
    """What a ``ReferenceTimer`` did since it was made (cumulative)."""

    runs: int = 0  # references that passed and set anchors
    failed: int = 0  # references that failed, timed out at T_max, or were not usable
    errors: int = 0  # sandbox failures (retried later)
    seconds: float = 0.0  # sandbox wall seconds spent on references

    def minus(self, before: ReferenceStats) -> ReferenceStats:
        return ReferenceStats(
            self.runs - before.runs,
            self.failed - before.failed,
            self.errors - before.errors,
            self.seconds - before.seconds,
        )


class ReferenceTimer:
    """Times examples' reference solutions once each; the code reward's workers run them.

    ``claim(example)`` says whether (and what) to run; the caller then runs ``run(example,
    program)`` on a worker. Thread-safe."""

    def __init__(self, sandbox: Sandbox, timeouts: AdaptiveTimeout) -> None:
        self.sandbox = sandbox
        self.timeouts = timeouts
        self._lock = threading.Condition()
        self._pending: set[str] = set()
        self._none: set[str] = set()  # examples without a reference solution
        self._failed: dict[str, str] = {}  # example id -> why its reference gives no anchor
        self._stats = ReferenceStats()

    def claim(self, example: TaskExample) -> str | None:
        """The reference response to time for ``example`` now, or None (none, not needed, taken)."""
        if not self.timeouts.config.adaptive:
            return None
        if all(self.timeouts.anchor_s(k) is not None for k in example.case_keys()):
            return None
        eid = example.example_id
        with self._lock:
            if eid in self._pending or eid in self._failed or eid in self._none:
                return None
            try:
                text = reference_response(example)
            except BadReference as e:
                self._fail(example, str(e))
                return None
            if text is None:
                self._none.add(eid)
                return None
            self._pending.add(eid)
            return text

    def run(self, example: TaskExample, program: str) -> None:
        """Run the claimed reference under ``T_max`` per case; its times become anchors if it passes."""
        try:
            t0 = time.perf_counter()
            res = self.sandbox.run(program, example.tests, self.timeouts.config.t_max_s)
            self._record(example, res, time.perf_counter() - t0)
        except Exception as e:  # a worker's exception would vanish in its future: say it here
            with self._lock:
                self._fail(example, f"timing it raised {type(e).__name__}: {e}")
        finally:
            self.release(example)

    def release(self, example: TaskExample) -> None:
        """Give up a claim without running it (its run was cancelled); it may be claimed again."""
        with self._lock:
            self._pending.discard(example.example_id)
            self._lock.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no claimed reference is still to run or running; False on ``timeout_s``."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._pending, timeout=timeout_s)

    def _record(self, example: TaskExample, res: SandboxResult, seconds: float) -> None:
        keys = example.case_keys()
        if res.passed:
            for key, case in zip(keys, res.tests, strict=True):
                self.timeouts.observe(key, case.exec_s, passed=True)
            self._add(runs=1, seconds=seconds)
            return
        if res.status.value == "error":
            log.warning(
                "reference solution of example %r: the sandbox failed (%s); no anchor from it now, "
                "it runs again the next time the example is scored",
                example.example_id,
                res.detail,
            )
            self._add(errors=1, seconds=seconds)
            return
        i = res.failed_index
        where = f"test case {i} ({keys[i]})" if i is not None else "the program itself (before the tests)"
        self._add(seconds=seconds)
        with self._lock:
            self._fail(example, f"{where} {res.status.value} under t_max_s: {res.detail}")

    def _add(self, runs: int = 0, errors: int = 0, seconds: float = 0.0) -> None:
        with self._lock:
            s = self._stats
            self._stats = ReferenceStats(s.runs + runs, s.failed, s.errors + errors, s.seconds + seconds)

    def _fail(self, example: TaskExample, why: str) -> None:
        """Remember that ``example``'s reference gives no anchor, count it, and say so (lock held)."""
        self._failed[example.example_id] = why
        s = self._stats
        self._stats = ReferenceStats(s.runs, s.failed + 1, s.errors, s.seconds)
        log.warning(
            "reference solution of example %r gives no timeout anchor: %s; its test cases without "
            "an anchor keep t_max_s = %g s until a correct response anchors them (fix the task's "
            "solution)",
            example.example_id,
            why,
            self.timeouts.config.t_max_s,
        )

    def failures(self) -> dict[str, str]:
        """Example id -> why its reference gives no anchor (failed, timed out, unusable)."""
        with self._lock:
            return dict(self._failed)

    def stats(self) -> ReferenceStats:
        with self._lock:
            return self._stats
