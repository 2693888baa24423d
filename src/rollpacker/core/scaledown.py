"""The stream trainer's scale-down decision (RollPacker §4.4, Algorithm 1), as pure policy.

During a long round the rollout's GPU utilisation falls as responses finish. The stream trainer
watches the fraction of completed requests and, at milestones between 20 % and 50 % (checked
every time another 5 % of |R| has completed), tries to repurpose part of the rollout GPUs for
gradient computation. This module only *decides*: which rollout replicas to free, which running
requests move where, and whether the projected KV-cache demand still fits afterwards. Moving real
devices and re-submitting requests (recomputation-based migration) is the runtime's job.

Algorithm 1 maps onto this module as follows:

- lines 9-12 (Δ_R += |R_fin|): ``ScaleDownMonitor.observe`` takes the cumulative completed count
  and adds what is new to Δ_R;
- line 14 (``0.2 <= |R_comp|/|R| <= 0.5 and Δ_R/|R| >= 0.05``): ``ScaleDownConfig.milestone_low``,
  ``milestone_high`` and ``milestone_step``; Δ_R is reset (line 15) on every attempt, whatever
  its outcome, and is *not* reset outside the window (so the first attempt happens as soon as
  ``milestone_low`` is reached);
- line 16 (PickScaleDownGPUs): ``pick_scale_down`` frees whole data-parallel replicas (a replica is
  one TP group and is never split), ``fraction`` of them (half by default), the least loaded
  first; it aborts when fewer than 2 replicas exist or nothing would be freed;
- line 17 (MeetScaleCriteria): ``meets_criteria`` projects the peak KV demand with the historical
  response-length distribution and checks it against the remaining replicas' capacity, both in
  aggregate and per replica (a greedy bin-pack of the migrated requests);
- line 21 (scaled_down): set once a decision is returned; nothing more happens until ``reset``.

Projected KV demand. A running request with ``p`` prompt tokens and ``g`` generated tokens is
projected to hold ``p + ceil(E[L | L > g])`` tokens at its peak, where the conditional expectation
comes from ``LengthHistory.expected_final_length``. The peak of a set of requests is taken as the
*sum* of their projections: an upper bound, as if every still-running request reached its final
length while all the others were still resident (in reality short ones finish and free their
blocks first). Per-token byte footprints are folded into ``Replica.kv_capacity_tokens`` (the
engine's KV capacity in tokens); ``kv_safety`` scales it down to leave headroom. The placement
check is greedy (worst-fit decreasing), so it is sufficient but not necessary: a refusal can be
conservative, an acceptance never overfills a replica.

Invariants:
- no attempt is made while the completed fraction is below ``milestone_low`` or above
  ``milestone_high``;
- consecutive attempts are at least ``milestone_step * |R|`` newly completed requests apart (the
  first attempt counts from the start of the step);
- a decision never splits a replica: ``freed`` and ``keep`` are disjoint, their union is every
  replica of the layout, and ``keep`` is never empty;
- a monitor scales down at most once per step (until ``reset``);
- the attempt is aborted (no decision) when the layout has fewer than 2 replicas or ``fraction``
  would free none;
- a decision is returned only if the projected peak fits the remaining capacity in aggregate and
  the greedy placement fits every kept replica's ``floor(kv_capacity_tokens * kv_safety)``;
- ``migrate`` names every running request on a freed replica exactly once, always to a kept
  replica, and never a request that already runs on a kept replica;
- decisions are deterministic: the order of the inputs does not matter, ties break by id.

Acting on a decision (``rollout.scale_down.enabled``; ``rollpacker.engines.layout.ScaleDownRuntime``
migrates the requests and parks the freed replicas, the trainer service takes their devices until
the end of the step): this module also holds the pure records of what was done, ``ScaleDownOutcome``
(the round's ``rollout/...`` metrics) and ``DeviceTimeline`` (the trainer's devices over the step,
``train/devices``), with their invariants:
- a timeline's time-weighted mean lies between its smallest and largest device count, and a
  timeline that never changed has the mean of its initial count;
- ``held_s`` counts exactly the seconds with at least one device held;
- an outcome logs ``rollout/scaled_down_at`` (and ``_s``) only when the round scaled down.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from rollpacker.core.errors import ConfigError, PolicyError
from rollpacker.core.metrics import percentile

# ---------------------------------------------------------------------------------------------
# Configuration


@dataclass(frozen=True)
class ScaleDownConfig:
    """Algorithm 1's thresholds (the paper's 20 %, 50 %, 5 %, "half of rollout GPUs").

    ``enabled`` turns the runtime on (``rollout.scale_down.enabled``: the rollout service acts on
    the decisions); the replay benchmark only observes them and ignores it.
    """

    enabled: bool = False  # act on the decisions at runtime (migrate, hand devices to training)
    milestone_low: float = 0.20  # first completed fraction at which scaling is considered
    milestone_high: float = 0.50  # last completed fraction at which scaling is considered
    milestone_step: float = 0.05  # newly completed fraction (Δ_R/|R|) between two attempts
    fraction: float = 0.5  # fraction of rollout DP replicas to repurpose for training
    kv_safety: float = 1.0  # usable fraction of each replica's KV capacity

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"rollout.scale_down.enabled = {self.enabled!r}: must be true or false")
        for name, v in (
            ("milestone_low", self.milestone_low),
            ("milestone_high", self.milestone_high),
        ):
            if not (_is_number(v) and 0.0 <= v <= 1.0):
                raise ConfigError(f"rollout.scale_down.{name} = {v!r}: must be a number in [0, 1]")
        if self.milestone_low > self.milestone_high:
            raise ConfigError(
                f"rollout.scale_down.milestone_low = {self.milestone_low!r} is above "
                f"rollout.scale_down.milestone_high = {self.milestone_high!r}: the window would be empty"
            )
        if not (_is_number(self.milestone_step) and 0.0 < self.milestone_step <= 1.0):
            raise ConfigError(
                f"rollout.scale_down.milestone_step = {self.milestone_step!r}: must be in (0, 1]"
            )
        if not (_is_number(self.fraction) and 0.0 < self.fraction < 1.0):
            raise ConfigError(
                f"rollout.scale_down.fraction = {self.fraction!r}: must be in (0, 1) "
                "(at least one rollout replica has to stay; the paper uses 0.5)"
            )
        if not (_is_number(self.kv_safety) and 0.0 < self.kv_safety <= 1.0):
            raise ConfigError(
                f"rollout.scale_down.kv_safety = {self.kv_safety!r}: must be in (0, 1] "
                "(the usable fraction of each replica's KV capacity)"
            )


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _nonneg_int(name: str, v: object) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{name} = {v!r}: must be a non-negative integer")


# ---------------------------------------------------------------------------------------------
# Input data


@dataclass(frozen=True)
class Replica:
    """One rollout data-parallel replica: a TP group of ``devices`` on ``node`` (never split)."""

    replica_id: str
    devices: tuple[int, ...]
    node: str
    kv_capacity_tokens: int  # the engine's KV cache capacity, in tokens

    def __post_init__(self) -> None:
        if not self.replica_id:
            raise ValueError("Replica.replica_id must be a non-empty string")
        if not self.devices:
            raise ValueError(f"replica {self.replica_id!r}: devices must not be empty")
        for d in self.devices:
            _nonneg_int(f"replica {self.replica_id!r} device", d)
        if len(set(self.devices)) != len(self.devices):
            raise ValueError(f"replica {self.replica_id!r}: duplicate device in {self.devices!r}")
        if isinstance(self.kv_capacity_tokens, bool) or not isinstance(self.kv_capacity_tokens, int):
            raise ValueError(f"replica {self.replica_id!r}: kv_capacity_tokens must be an integer")
        if self.kv_capacity_tokens < 1:
            raise ValueError(
                f"replica {self.replica_id!r}: kv_capacity_tokens = {self.kv_capacity_tokens!r}, must be >= 1"
            )


@dataclass(frozen=True)
class RolloutLayout:
    """The rollout's replicas at the start of a step (unique ids; no device in two replicas)."""

    replicas: tuple[Replica, ...]

    def __post_init__(self) -> None:
        ids = [r.replica_id for r in self.replicas]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"RolloutLayout: duplicate replica id(s) {dup!r}")
        seen: dict[tuple[str, int], str] = {}
        for r in self.replicas:
            for d in r.devices:
                other = seen.setdefault((r.node, d), r.replica_id)
                if other != r.replica_id:
                    raise ValueError(
                        f"RolloutLayout: device {d} on node {r.node!r} is in replicas {other!r} "
                        f"and {r.replica_id!r}"
                    )

    @property
    def replica_ids(self) -> tuple[str, ...]:
        """Every replica id, sorted."""
        return tuple(sorted(r.replica_id for r in self.replicas))

    def replica(self, replica_id: str) -> Replica:
        for r in self.replicas:
            if r.replica_id == replica_id:
                return r
        raise KeyError(f"no replica {replica_id!r} in the layout (known: {', '.join(self.replica_ids)})")

    def devices_of(self, replica_ids: Iterable[str]) -> tuple[tuple[str, int], ...]:
        """The (node, device) pairs of the given replicas, sorted: what a decision hands to training."""
        out = [(r.node, d) for rid in replica_ids for r in (self.replica(rid),) for d in r.devices]
        return tuple(sorted(out))


@dataclass(frozen=True)
class RunningRequest:
    """A request still generating on ``replica_id`` (its KV holds prompt + generated tokens)."""

    request_id: str
    replica_id: str
    prompt_tokens: int
    generated_tokens: int

    def __post_init__(self) -> None:
        _nonneg_int(f"request {self.request_id!r} prompt_tokens", self.prompt_tokens)
        _nonneg_int(f"request {self.request_id!r} generated_tokens", self.generated_tokens)

    @property
    def resident_tokens(self) -> int:
        """Tokens in the KV cache now (what a recomputation-based migration re-prefills)."""
        return self.prompt_tokens + self.generated_tokens


@dataclass(frozen=True)
class LengthHistory:
    """Final response lengths observed in past steps, sorted, with the response-length cap.

    ``expected_final_length(g)`` is ``E[L | L > g]``: the mean of the historical lengths strictly
    greater than ``g`` (a request still running after ``g`` tokens ends at ``g + 1`` or later),
    clamped to ``max_tokens``. When no historical length exceeds ``g`` (an empty history, or a
    request that has outlived everything seen) it returns ``max_tokens``: such a request is the
    long tail the history cannot describe, and since the result feeds an upper bound on KV demand
    the cap (the only certain bound) is the safe choice. A request at or past the cap returns
    ``g`` itself (it is finishing).
    """

    lengths: tuple[int, ...]
    max_tokens: int  # the rollout's max response length: no response is longer
    _suffix: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for n in self.lengths:
            _nonneg_int("LengthHistory length", n)
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"LengthHistory.max_tokens = {self.max_tokens!r}: must be a positive integer")
        lengths = tuple(sorted(self.lengths))
        suffix = [0] * (len(lengths) + 1)
        for i in range(len(lengths) - 1, -1, -1):
            suffix[i] = suffix[i + 1] + lengths[i]
        object.__setattr__(self, "lengths", lengths)
        object.__setattr__(self, "_suffix", tuple(suffix))

    @classmethod
    def from_lengths(cls, lengths: Iterable[int], max_tokens: int) -> LengthHistory:
        return cls(tuple(lengths), max_tokens)

    def extended(self, lengths: Iterable[int]) -> LengthHistory:
        """A new history with ``lengths`` added (e.g. the step that just finished)."""
        return LengthHistory(self.lengths + tuple(lengths), self.max_tokens)

    def expected_final_length(self, generated_so_far: int) -> float:
        """``E[L | L > generated_so_far]`` from the history (see the class docstring)."""
        _nonneg_int("generated_so_far", generated_so_far)
        g = generated_so_far
        if g >= self.max_tokens:
            return float(g)
        i = bisect.bisect_right(self.lengths, g)
        n = len(self.lengths) - i
        if n == 0:
            return float(self.max_tokens)
        return min(float(self.max_tokens), self._suffix[i] / n)

    def quantile(self, q: float) -> float:
        """Linear-interpolated ``q``-quantile, ``q`` in [0, 1]; 0.0 for an empty history."""
        if not (_is_number(q) and 0.0 <= q <= 1.0):
            raise ValueError(f"quantile q must be in [0, 1], got {q!r}")
        return percentile([float(n) for n in self.lengths], q * 100.0)


def projected_tokens(request: RunningRequest, history: LengthHistory) -> int:
    """Projected peak KV tokens of one request: prompt + ceil(E[final length | still running])."""
    expected = history.expected_final_length(request.generated_tokens)
    return request.prompt_tokens + math.ceil(round(expected, 6))


def usable_capacity(replica: Replica, kv_safety: float) -> int:
    """``floor(kv_capacity_tokens * kv_safety)``, robust to float noise."""
    return math.floor(round(replica.kv_capacity_tokens * kv_safety, 6))


# ---------------------------------------------------------------------------------------------
# PickScaleDownGPUs (Algorithm 1, line 16)


def pick_scale_down(
    layout: RolloutLayout, fraction: float, running: Sequence[RunningRequest] = ()
) -> tuple[str, ...] | None:
    """Whole replicas to free: ``floor(fraction * n)`` of the ``n`` replicas, sorted by id.

    Replicas with the fewest resident tokens go first (then fewest running requests, then id):
    their requests are the cheapest to migrate by recomputation. Returns ``None`` (the attempt is
    aborted) when the layout has fewer than 2 replicas or when ``fraction`` frees none or all.
    """
    n = len(layout.replicas)
    n_free = math.floor(round(fraction * n, 9))
    if n < 2 or n_free < 1 or n_free >= n:
        return None
    tokens = {r.replica_id: 0 for r in layout.replicas}
    count = dict.fromkeys(tokens, 0)
    for req in running:
        if req.replica_id in tokens:
            tokens[req.replica_id] += req.resident_tokens
            count[req.replica_id] += 1
    order = sorted(tokens, key=lambda rid: (tokens[rid], count[rid], rid))
    return tuple(sorted(order[:n_free]))


# ---------------------------------------------------------------------------------------------
# MeetScaleCriteria (Algorithm 1, line 17)


@dataclass(frozen=True)
class CriteriaCheck:
    """The outcome of one scaling attempt; ``ok`` when ``reason`` is empty.

    ``migrate`` and ``replica_load`` (projected tokens per kept replica after migration) are
    filled only when the check passes. An attempt aborted by ``pick_scale_down`` has
    ``freed == ()`` and a reason starting with ``"pick:"``.
    """

    freed: tuple[str, ...]
    keep: tuple[str, ...]
    projected_peak_tokens: int
    capacity_tokens: int
    reason: str = ""
    migrate: tuple[tuple[str, str], ...] = ()
    replica_load: tuple[tuple[str, int], ...] = ()

    @property
    def ok(self) -> bool:
        return not self.reason


def meets_criteria(
    layout: RolloutLayout,
    freed: Sequence[str],
    running: Sequence[RunningRequest],
    history: LengthHistory,
    kv_safety: float = 1.0,
) -> CriteriaCheck:
    """Would the remaining replicas hold every running request's projected peak KV demand?

    Two checks: the sum of all running requests' projections against the kept replicas' summed
    usable capacity, and a placement: kept replicas keep their own requests, the freed replicas'
    requests are placed largest first onto the kept replica with the most headroom (ties by id).
    """
    if not (_is_number(kv_safety) and 0.0 < kv_safety <= 1.0):
        raise ValueError(f"meets_criteria: kv_safety = {kv_safety!r}, must be in (0, 1]")
    freed_t, keep = _split_layout(layout, freed)
    freed_set = set(freed_t)
    _check_running(layout, running)

    proj = {req.request_id: projected_tokens(req, history) for req in running}
    peak = sum(proj.values())
    cap = {rid: usable_capacity(layout.replica(rid), kv_safety) for rid in keep}
    capacity = sum(cap.values())

    def refuse(reason: str) -> CriteriaCheck:
        return CriteriaCheck(freed_t, keep, peak, capacity, reason)

    if peak > capacity:
        return refuse(f"projected peak {peak} tokens exceeds the remaining capacity {capacity} tokens")
    load = dict.fromkeys(keep, 0)
    for req in running:
        if req.replica_id in load:
            load[req.replica_id] += proj[req.request_id]
    for rid in keep:
        if load[rid] > cap[rid]:
            return refuse(f"replica {rid!r} alone projects {load[rid]} tokens > its capacity {cap[rid]}")
    movers = sorted(
        (r for r in running if r.replica_id in freed_set), key=lambda r: (-proj[r.request_id], r.request_id)
    )
    migrate, why = _place(movers, keep, proj, load, cap)
    if why:
        return refuse(why)
    return CriteriaCheck(
        freed_t,
        keep,
        peak,
        capacity,
        "",
        tuple(sorted(migrate)),
        tuple((rid, load[rid]) for rid in keep),
    )


def _split_layout(layout: RolloutLayout, freed: Sequence[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(freed, keep)`` replica ids, each sorted; a ``ValueError`` when ``freed`` names a replica
    outside the layout or leaves none to keep."""
    ids = set(layout.replica_ids)
    freed_set = set(freed)
    unknown = sorted(freed_set - ids)
    if unknown:
        raise ValueError(f"meets_criteria: freed replica(s) {unknown!r} are not in the layout")
    keep = tuple(sorted(ids - freed_set))
    if not keep:
        raise ValueError("meets_criteria: freeing every replica leaves nothing for rollout")
    return tuple(sorted(freed_set)), keep


def _place(
    movers: Sequence[RunningRequest],
    keep: Sequence[str],
    proj: Mapping[str, int],
    load: dict[str, int],
    cap: Mapping[str, int],
) -> tuple[list[tuple[str, str]], str]:
    """Greedy placement of ``movers`` (in order) onto the kept replica with the most headroom (ties
    by id), adding to ``load``: the ``(request_id, replica_id)`` moves, and ``""`` or why one
    request fits nowhere."""
    migrate: list[tuple[str, str]] = []
    for req in movers:
        t = proj[req.request_id]
        target = min(keep, key=lambda rid: (load[rid] - cap[rid], rid))
        if load[target] + t > cap[target]:
            return migrate, (
                f"placement: request {req.request_id!r} ({t} tokens) fits no kept replica "
                f"(largest headroom {cap[target] - load[target]} on {target!r})"
            )
        load[target] += t
        migrate.append((req.request_id, target))
    return migrate, ""


def _check_running(layout: RolloutLayout, running: Sequence[RunningRequest]) -> None:
    ids = set(layout.replica_ids)
    seen: set[str] = set()
    for req in running:
        if req.replica_id not in ids:
            raise PolicyError(
                f"running request {req.request_id!r} is on replica {req.replica_id!r}, "
                "which is not in the rollout layout"
            )
        if req.request_id in seen:
            raise PolicyError(f"running request {req.request_id!r} is listed twice")
        seen.add(req.request_id)


# ---------------------------------------------------------------------------------------------
# The monitor (Algorithm 1's control flow)


@dataclass(frozen=True)
class ScaleDecision:
    """Scale down now: hand ``freed`` replicas to training, resubmit ``migrate`` on ``keep``."""

    freed: tuple[str, ...]  # replica ids repurposed for training, sorted
    keep: tuple[str, ...]  # replica ids that keep serving rollout, sorted
    migrate: tuple[tuple[str, str], ...]  # (request_id, to_replica_id), sorted by request id
    projected_peak_tokens: int
    capacity_tokens: int
    completed_fraction: float
    replica_load: tuple[tuple[str, int], ...] = ()  # projected tokens per kept replica


@dataclass(frozen=True)
class ScaleDownState:
    """A monitor's counters as plain data (persist with ``as_dict``, restore with ``from_dict``)."""

    total_requests: int  # |R|
    completed: int = 0  # |R_comp| at the last observation
    delta: int = 0  # Δ_R: completed since the last attempt (or the step start)
    scaled_down: bool = False
    attempts: int = 0  # line-15 passes this step (aborted and refused ones included)
    last_attempt_completed: int = 0  # |R_comp| at the last attempt (0 before any)
    freed: tuple[str, ...] = ()  # the freed replicas once scaled down

    def __post_init__(self) -> None:
        if isinstance(self.total_requests, bool) or not isinstance(self.total_requests, int):
            raise ValueError(f"total_requests = {self.total_requests!r}: must be an integer")
        if self.total_requests < 1:
            raise ValueError(f"total_requests = {self.total_requests!r}: must be >= 1")
        for name in ("completed", "delta", "attempts", "last_attempt_completed"):
            _nonneg_int(name, getattr(self, name))
        if self.completed > self.total_requests or self.delta > self.completed:
            raise ValueError(
                f"inconsistent state: completed={self.completed}, delta={self.delta}, "
                f"total_requests={self.total_requests}"
            )
        if self.scaled_down != bool(self.freed):
            raise ValueError("inconsistent state: freed replicas are set exactly when scaled_down")

    def as_dict(self) -> dict[str, Any]:
        return {
            "total_requests": self.total_requests,
            "completed": self.completed,
            "delta": self.delta,
            "scaled_down": self.scaled_down,
            "attempts": self.attempts,
            "last_attempt_completed": self.last_attempt_completed,
            "freed": list(self.freed),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ScaleDownState:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"ScaleDownState: unknown key(s) {unknown!r}; known: {sorted(known)}")
        kwargs = dict(data)
        if "freed" in kwargs:
            kwargs["freed"] = tuple(kwargs["freed"])
        return cls(**kwargs)


class ScaleDownMonitor:
    """Algorithm 1's scale-down control flow for one step at a time (no I/O, no clocks).

    Call ``observe`` after every engine step with the cumulative completed count and the requests
    still running; it returns a ``ScaleDecision`` at most once per step. ``reset`` starts a new
    step (optionally with a new layout and history).
    """

    def __init__(
        self,
        config: ScaleDownConfig,
        layout: RolloutLayout,
        history: LengthHistory,
        total_requests: int,
    ) -> None:
        self._config = config
        self._layout = layout
        self._history = history
        self._state = ScaleDownState(total_requests)
        self._last_check: CriteriaCheck | None = None

    @classmethod
    def restore(
        cls,
        config: ScaleDownConfig,
        layout: RolloutLayout,
        history: LengthHistory,
        state: ScaleDownState,
    ) -> ScaleDownMonitor:
        """A monitor that continues from a persisted ``state``."""
        unknown = sorted(set(state.freed) - set(layout.replica_ids))
        if unknown:
            raise ValueError(f"restore: freed replica(s) {unknown!r} are not in the layout")
        m = cls(config, layout, history, state.total_requests)
        m._state = state
        return m

    @property
    def state(self) -> ScaleDownState:
        return self._state

    @property
    def scaled_down(self) -> bool:
        return self._state.scaled_down

    @property
    def last_check(self) -> CriteriaCheck | None:
        """The latest attempt's outcome (why it was refused or aborted), ``None`` before any."""
        return self._last_check

    def reset(
        self,
        total_requests: int,
        *,
        layout: RolloutLayout | None = None,
        history: LengthHistory | None = None,
    ) -> None:
        """Start a new step: zero the counters; replace the layout and history when given."""
        self._state = ScaleDownState(total_requests)
        if layout is not None:
            self._layout = layout
        if history is not None:
            self._history = history
        self._last_check = None

    def observe(self, completed_total: int, running: Sequence[RunningRequest]) -> ScaleDecision | None:
        """Lines 9-21 of Algorithm 1 for one engine step; a decision at most once per step."""
        s = self._state
        _nonneg_int("completed_total", completed_total)
        if completed_total < s.completed:
            raise PolicyError(
                f"completed_total went backwards ({s.completed} -> {completed_total}); "
                "call reset() to start a new step"
            )
        if completed_total > s.total_requests:
            raise PolicyError(f"completed_total {completed_total} exceeds |R| = {s.total_requests}")
        _check_running(self._layout, running)
        delta = s.delta + (completed_total - s.completed)
        s = replace(s, completed=completed_total, delta=delta)
        self._state = s
        if s.scaled_down or not self._in_window(completed_total, delta):
            return None
        # Line 15: reset Δ_R on every attempt, whatever its outcome.
        self._state = s = replace(s, delta=0, attempts=s.attempts + 1, last_attempt_completed=completed_total)
        freed = pick_scale_down(self._layout, self._config.fraction, running)
        if freed is None:
            self._last_check = CriteriaCheck(
                (),
                self._layout.replica_ids,
                sum(projected_tokens(r, self._history) for r in running),
                0,
                f"pick: cannot free {self._config.fraction:g} of {len(self._layout.replicas)} "
                "replica(s) without leaving rollout empty",
            )
            return None
        check = meets_criteria(self._layout, freed, running, self._history, self._config.kv_safety)
        self._last_check = check
        if not check.ok:
            return None
        self._state = replace(s, scaled_down=True, freed=check.freed)
        return ScaleDecision(
            freed=check.freed,
            keep=check.keep,
            migrate=check.migrate,
            projected_peak_tokens=check.projected_peak_tokens,
            capacity_tokens=check.capacity_tokens,
            completed_fraction=completed_total / s.total_requests,
            replica_load=check.replica_load,
        )

    def _in_window(self, completed: int, delta: int) -> bool:
        c, total = self._config, self._state.total_requests
        return (
            completed >= round(c.milestone_low * total, 9)
            and completed <= round(c.milestone_high * total, 9)
            and delta >= round(c.milestone_step * total, 9)
        )


# ---------------------------------------------------------------------------------------------
# What the runtime did: the round's outcome and the trainer's devices over the step


@dataclass(frozen=True)
class ScaleDownOutcome:
    """One round's scale-down at runtime: the monitor's attempts and, if it acted, what moved.

    ``completed_fraction`` is ``|R_comp|/|R|`` at the decision and ``at_s`` the seconds from the
    round's first engine step to it; ``migrate_s`` is the abort + resubmit time and
    ``recompute_s`` the time until every migrated request produced its next token on a kept
    replica (the recomputation-based migration's cost, 0 when it had not happened yet)."""

    attempts: int = 0
    refused: int = 0  # attempts MeetScaleCriteria refused (projected KV does not fit)
    aborted_pick: int = 0  # attempts PickScaleDownGPUs aborted (fewer than 2 replicas)
    scaled_down: bool = False
    completed_fraction: float = 0.0
    at_s: float = 0.0
    freed_replicas: int = 0
    freed_devices: tuple[str, ...] = ()
    migrated_requests: int = 0
    migrated_tokens: int = 0  # context tokens re-prefilled on the kept replicas
    migrate_s: float = 0.0
    recompute_s: float = 0.0

    def logged(self) -> dict[str, float]:
        """The round's ``rollout/...`` metrics (the decision's point only when it scaled down)."""
        out = {
            "rollout/scaled_down": float(self.scaled_down),
            "rollout/scale_down_attempts": float(self.attempts),
            "rollout/scale_down_refused": float(self.refused),
            "rollout/replicas_freed": float(self.freed_replicas),
            "rollout/devices_freed": float(len(self.freed_devices)),
        }
        if self.scaled_down:
            out.update(
                {
                    "rollout/scaled_down_at": self.completed_fraction,
                    "rollout/scaled_down_at_s": self.at_s,
                    "rollout/scale_down_migrated": float(self.migrated_requests),
                    "rollout/scale_down_migrated_tokens": float(self.migrated_tokens),
                    "rollout/scale_down_migrate_s": self.migrate_s + self.recompute_s,
                }
            )
        return out


@dataclass(frozen=True)
class DeviceTimeline:
    """Devices held over time: ``changes`` are ``(seconds since the start, count)`` change points,
    in time order; the count before the first change is ``initial``.

    The trainer service keeps one per step (from ``begin`` until its devices are given back):
    ``mean`` is the step's ``train/devices``, ``series`` the step function for a plot."""

    initial: int = 0
    changes: tuple[tuple[float, int], ...] = ()

    def __post_init__(self) -> None:
        _nonneg_int("DeviceTimeline.initial", self.initial)
        last = 0.0
        for t, n in self.changes:
            _nonneg_int("DeviceTimeline count", n)
            if not (_is_number(t) and t >= last):
                raise ValueError(f"DeviceTimeline: change at {t!r} s is before {last} s (time order)")
            last = t

    def at(self, t_s: float, count: int) -> DeviceTimeline:
        """This timeline with the count set to ``count`` from ``t_s`` on (clamped to the last change)."""
        last = self.changes[-1][0] if self.changes else 0.0
        return replace(self, changes=(*self.changes, (max(float(t_s), last), count)))

    def count(self, t_s: float) -> int:
        """Devices held at ``t_s``."""
        n = self.initial
        for t, c in self.changes:
            if t > t_s:
                break
            n = c
        return n

    def _segments(self, end_s: float) -> list[tuple[float, float, int]]:
        """``(start, end, count)`` pieces covering ``[0, end_s]``."""
        out: list[tuple[float, float, int]] = []
        t0, n = 0.0, self.initial
        for t, c in self.changes:
            if t >= end_s:
                break
            out.append((t0, t, n))
            t0, n = t, c
        out.append((t0, max(t0, end_s), n))
        return out

    def mean(self, end_s: float) -> float:
        """The time-weighted mean count over ``[0, end_s]`` (the count at 0 for an empty window)."""
        if end_s <= 0:
            return float(self.initial)
        segs = self._segments(end_s)
        if len({n for _, _, n in segs}) == 1:
            return float(segs[0][2])  # exact, without float noise
        return sum((b - a) * n for a, b, n in segs) / end_s

    def held_s(self, end_s: float) -> float:
        """Seconds within ``[0, end_s]`` with at least one device held."""
        return sum(b - a for a, b, n in self._segments(end_s) if n > 0)

    def peak(self) -> int:
        return max([self.initial, *(n for _, n in self.changes)])

    def series(self, end_s: float) -> tuple[tuple[float, int], ...]:
        """The step function as ``(t, count)`` points, from 0 to ``end_s``."""
        pts = [(0.0, self.initial)]
        pts.extend((t, n) for t, n in self.changes if t < end_s)
        pts.append((max(end_s, pts[-1][0]), self.count(end_s)))
        return tuple(pts)
