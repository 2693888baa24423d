"""The reward interface: one asynchronous request per sampled response.

A ``RewardFunction`` scores responses of one ``RewardKind``: ``submit`` takes a ``RewardRequest``
and returns at once a ``concurrent.futures.Future`` that resolves to a ``RewardResult``. The
scoring runs wherever the function wants (worker processes for math, a sandbox for code, an LLM
judge over HTTP, Ray actors), so the reward scheduler can overlap it with generation and with
other rewards. ``RewardRouter`` sends each request to the function of its example's kind.

Invariants:
- a submitted request's future always resolves to a ``RewardResult`` (never an exception) once
  the function accepted it: problems of one sample (unparseable answer, time limit, a crashed
  worker) are that sample's ``status``; ``submit`` itself raises only for misuse (a wrong kind,
  a closed function, no function for the kind);
- ``RewardResult.correct`` implies ``status is OK``, and ``reward`` is a finite float;
- ``RewardResult.cut_at_s > 0`` implies ``status is TIMEOUT``;
- ``result.sample_id == request.sample_id``;
- ``close()`` is idempotent and leaves no worker running; requests submitted before it still
  resolve (scored, or ``ERROR`` with a detail saying the function was closed).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol, Self, runtime_checkable

from rollpacker.core.errors import ConfigError
from rollpacker.core.tasks import RewardKind, TaskExample


class RewardStatus(enum.Enum):
    OK = "ok"  # scored: reward reflects the response
    WRONG_FORMAT = "wrong_format"  # no answer could be parsed from the response
    TIMEOUT = "timeout"  # scoring ran past its time limit
    ERROR = "error"  # scoring failed (a crashed worker, a bad reference, the function closed)


@dataclass(frozen=True)
class RewardRequest:
    sample_id: str
    example: TaskExample
    response: str


@dataclass(frozen=True)
class RewardResult:
    sample_id: str
    reward: float
    correct: bool
    status: RewardStatus
    elapsed_s: float  # seconds spent scoring this sample (not waiting in a queue)
    detail: str = ""  # why: the parsed answer, or what went wrong
    # > 0: an adaptive time limit below the function's ceiling stopped the scoring, at this many
    # seconds (code: a case cut at min(max(T_min, lambda * T_anchor), T_max) < T_max); 0.0: not cut
    cut_at_s: float = 0.0

    def __post_init__(self) -> None:
        if not math.isfinite(self.reward):
            raise ValueError(f"sample {self.sample_id!r}: reward {self.reward!r} is not finite")
        if not (math.isfinite(self.cut_at_s) and self.cut_at_s >= 0):
            raise ValueError(f"sample {self.sample_id!r}: cut_at_s {self.cut_at_s!r} must be >= 0")
        if self.cut_at_s and self.status is not RewardStatus.TIMEOUT:
            raise ValueError(
                f"sample {self.sample_id!r}: cut at {self.cut_at_s} s but status {self.status.value}"
            )
        if self.correct and self.status is not RewardStatus.OK:
            raise ValueError(f"sample {self.sample_id!r}: correct but status {self.status.value}")


@runtime_checkable
class RewardFunction(Protocol):
    """Scores responses of one reward kind, asynchronously, one request per sample."""

    kind: RewardKind

    def submit(self, req: RewardRequest) -> Future[RewardResult]:
        """Start scoring ``req``; return at once. Raise only for misuse (wrong kind, closed)."""
        ...

    def close(self) -> None:
        """Stop every worker; idempotent."""
        ...


_MISSING_HINT: dict[RewardKind, str] = {
    RewardKind.MATH: (
        "math rewards need the math-verify reward: pass rollpacker.rewards.math_rule.MathReward() "
        "to the RewardRouter"
    ),
    RewardKind.CODE: (
        "code rewards need the sandbox (the code reward function that runs the tests in an "
        "isolated process): configure it and pass it to the RewardRouter"
    ),
    RewardKind.JUDGE: (
        "judge rewards need an LLM judge (a judge reward function with its model endpoint): "
        "configure it and pass it to the RewardRouter"
    ),
}


class ClosesOnExit:
    """``with obj:`` calls ``obj.close()`` on the way out (reward functions and the router)."""

    def close(self) -> None:  # pragma: no cover - every user defines its own
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class RewardRouter(ClosesOnExit):
    """Dispatches each request to the ``RewardFunction`` of its example's ``reward_kind``."""

    def __init__(self, functions: Iterable[RewardFunction]) -> None:
        self._functions: dict[RewardKind, RewardFunction] = {}
        for fn in functions:
            kind = getattr(fn, "kind", None)
            if not isinstance(kind, RewardKind):
                raise ConfigError(
                    f"{type(fn).__name__} has no valid 'kind' (got {kind!r}); a reward function must "
                    "declare the RewardKind it scores"
                )
            if kind in self._functions:
                raise ConfigError(
                    f"two reward functions for kind {kind.value!r} ({type(self._functions[kind]).__name__} "
                    f"and {type(fn).__name__}); pass one per kind"
                )
            self._functions[kind] = fn
        self._closed = False

    @property
    def kinds(self) -> frozenset[RewardKind]:
        return frozenset(self._functions)

    def function_for(self, kind: RewardKind) -> RewardFunction:
        fn = self._functions.get(kind)
        if fn is None:
            have = ", ".join(sorted(k.value for k in self._functions)) or "none"
            raise ConfigError(
                f"no reward function for kind {kind.value!r} (have: {have}); {_MISSING_HINT[kind]}"
            )
        return fn

    def check_covers(self, examples: Iterable[TaskExample]) -> None:
        """Fail before training starts if some example's kind has no reward function."""
        for kind in sorted({ex.reward_kind for ex in examples}, key=lambda k: k.value):
            self.function_for(kind)

    def submit(self, req: RewardRequest) -> Future[RewardResult]:
        if self._closed:
            raise RuntimeError("RewardRouter is closed; create a new one to score more samples")
        return self.function_for(req.example.reward_kind).submit(req)

    def close(self) -> None:
        """Close every function (all of them, even if one raises; the first error is re-raised)."""
        if self._closed:
            return
        self._closed = True
        first: BaseException | None = None
        for fn in self._functions.values():
            try:
                fn.close()
            except BaseException as e:
                first = first or e
        if first is not None:
            raise first
