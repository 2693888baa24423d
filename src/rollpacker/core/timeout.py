"""Adaptive sandbox timeouts (RollPacker section 4.3).

For each test case the reward scheduler tracks ``T_anchor``, the longest execution time among
*correct* responses seen so far, and runs a new response's case with

    T_timeout = min(max(T_min, lambda * T_anchor), T_max)

(the paper's lambda = 1.5, T_min = 2 s, T_max = 30 s). A case with no anchor yet gets ``T_max``:
nothing is known about how long a correct run takes, so nothing is cut short. A response that runs
past its timeout gets reward 0, so doomed (non-terminating) responses cost ``~lambda * T_anchor``
instead of ``T_max``.

Anchors are controller state: ``to_json`` / ``from_json`` round-trip them exactly, and a step
that dies before commit leaves the committed anchors untouched (the caller snapshots them).

Invariants:
- ``T_min <= timeout_s(case) <= T_max`` for every case, anchored or not;
- an anchor only ever grows, and only from a correct run (``observe(..., passed=False)`` and
  timed-out runs never move it), so a response as fast as any earlier correct one is never cut;
- ``from_json(to_json(a))`` equals ``a`` (same anchors, same parameters);
- a case key is any non-empty string (``"<example id>/<case index>"`` by convention).
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from rollpacker.core.errors import ConfigError


@dataclass(frozen=True)
class TimeoutConfig:
    """The adaptive timeout's parameters (``reward.sandbox`` in the experiment YAML)."""

    adaptive: bool = True  # false: every case gets t_max_s (the fixed-timeout baseline)
    lam: float = 1.5  # lambda: slack over the slowest correct run (CPU contention)
    t_min_s: float = 2.0
    t_max_s: float = 30.0

    def __post_init__(self) -> None:
        for name, v in (("lam", self.lam), ("t_min_s", self.t_min_s), ("t_max_s", self.t_max_s)):
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ConfigError(f"reward.sandbox.{name} = {v!r}: must be a finite number > 0")
        if self.lam < 1.0:
            raise ConfigError(
                f"reward.sandbox.lam = {self.lam!r}: must be >= 1 (below 1 the timeout would cut "
                "responses as fast as the slowest correct one; the paper uses 1.5)"
            )
        if self.t_min_s > self.t_max_s:
            raise ConfigError(
                f"reward.sandbox.t_min_s = {self.t_min_s!r} > t_max_s = {self.t_max_s!r}: "
                "the floor must not exceed the ceiling"
            )


class AdaptiveTimeout:
    """Per-test-case anchors and the timeout they give. Thread-safe (reward workers share it)."""

    def __init__(
        self, config: TimeoutConfig | None = None, anchors: Mapping[str, float] | None = None
    ) -> None:
        self.config = config if config is not None else TimeoutConfig()
        self._lock = threading.Lock()
        self._anchors: dict[str, float] = {}
        for key, v in (anchors or {}).items():
            self._check_key(key)
            if not (math.isfinite(v) and v >= 0):
                raise ConfigError(f"timeout anchor {key!r} = {v!r}: must be a finite number of seconds >= 0")
            self._anchors[key] = float(v)

    @staticmethod
    def _check_key(key: str) -> None:
        if not isinstance(key, str) or not key:
            raise ConfigError(f"test-case key {key!r}: must be a non-empty string")

    def timeout_s(self, case: str) -> float:
        """The time limit for the next run of ``case``."""
        c = self.config
        if not c.adaptive:
            return c.t_max_s
        with self._lock:
            anchor = self._anchors.get(case)
        if anchor is None:
            return c.t_max_s
        return min(max(c.t_min_s, c.lam * anchor), c.t_max_s)

    def anchor_s(self, case: str) -> float | None:
        with self._lock:
            return self._anchors.get(case)

    def observe(self, case: str, exec_s: float, passed: bool) -> None:
        """Record one run of ``case``: a passed run of ``exec_s`` seconds may raise its anchor."""
        self._check_key(case)
        if not passed:
            return
        if not (math.isfinite(exec_s) and exec_s >= 0):
            raise ConfigError(f"exec_s = {exec_s!r} for {case!r}: must be a finite number of seconds >= 0")
        with self._lock:
            if exec_s > self._anchors.get(case, -1.0):
                self._anchors[case] = float(exec_s)

    def reset(self, anchors: Mapping[str, float]) -> None:
        """Replace every anchor (a re-run step starts from the committed anchors, not from what
        the failed attempt observed)."""
        fresh = AdaptiveTimeout(self.config, anchors)
        with self._lock:
            self._anchors = fresh.anchors()

    def anchors(self) -> dict[str, float]:
        with self._lock:
            return dict(self._anchors)

    def __len__(self) -> int:
        with self._lock:
            return len(self._anchors)

    def to_json(self) -> str:
        c = self.config
        return json.dumps(
            {
                "config": {"adaptive": c.adaptive, "lam": c.lam, "t_min_s": c.t_min_s, "t_max_s": c.t_max_s},
                "anchors": dict(sorted(self.anchors().items())),
            }
        )

    @classmethod
    def from_json(cls, text: str) -> AdaptiveTimeout:
        try:
            data = json.loads(text)
            cfg = TimeoutConfig(**data["config"])
            anchors = data["anchors"]
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(
                f"timeout anchors: not a saved AdaptiveTimeout ({type(e).__name__}: {e}); "
                "the state document is corrupt: restore it from the previous step"
            ) from e
        if not isinstance(anchors, dict):
            raise ConfigError("timeout anchors: 'anchors' must be an object of case -> seconds")
        return cls(cfg, {str(k): float(v) for k, v in anchors.items()})

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, AdaptiveTimeout):
            return NotImplemented
        return self.config == other.config and self.anchors() == other.anchors()

    __hash__ = None  # type: ignore[assignment]
