"""The engine profile table and the latency predictor (PAT section 4.2), pure.

A **layout** is ``(tp, dp)``: ``dp`` engine replicas of tensor-parallel size ``tp`` on one node's
``tp * dp`` devices. The profiler (``rollpacker.engines.profiler``) measures each candidate layout
with all its replicas loaded alike, so what one replica costs *while its siblings run* (shared
memory bandwidth on a CPU, a shared host driver) is in the table.

Per layout the table holds, for a sparse grid of per-replica batch sizes ``B`` and context lengths
``L`` (kept only where ``B * L`` fits the KV budget):

- ``prefill_s``: building the KV cache of ``B`` random prefixes of ``L`` tokens (PAT's injection);
- ``decode_s``: the mean latency of one decode step over a short window after it, at the window's
  mean aggregate context ``tokens`` (``T = sum of the B contexts``);

plus KV bytes per token, the engine's KV capacity in tokens, and the measured one-way bandwidth a
KV migration would move data at.

The predictor answers:

- ``decode_step_s(layout, B, T)``: piecewise-linear in ``T`` along each profiled batch size,
  interpolated linearly between the two nearest profiled batch sizes (extrapolated from the
  nearest two outside the grid, never below the smallest measured latency);
- ``recompute_s(layout, lengths)``: re-prefilling unfinished requests spread over the replicas,
  each replica's set as a fixed-length batch of its RMS context length (PAT eq. 3-4);
- ``migrate_s(src_tp, lengths)``: moving their KV instead (PAT eq. 1-2);
- ``remaining_s(layout, replicas, max_len)``: decoding every unfinished request to the max
  response length (PAT's conservative bound), the batch shrinking as requests hit it;

and ``choose_layout`` is PAT's Algorithm 1: the candidate with the least remaining time plus
switch cost, taken only when that beats staying.

Invariants (tests/core/test_latency.py):
- on a profiled point the predictor returns the measured value;
- predictions are monotone in T along a batch size whose profile is monotone;
- ``choose_layout`` never switches when no candidate beats the current layout's remaining time,
  nor onto a layout whose replicas could not hold the requests' KV up to the bound;
- the table round-trips through JSON and every parse error names the field.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from rollpacker.core.errors import ConfigError

PROFILE_VERSION = 1


class ProfileError(ConfigError):
    """A profile table that cannot be used (malformed, or lacking a layout asked for)."""


@dataclass(frozen=True, order=True)
class Layout:
    tp: int
    dp: int

    def __post_init__(self) -> None:
        for name in ("tp", "dp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ProfileError(f"layout.{name} = {v!r}: must be a positive integer")

    @property
    def devices(self) -> int:
        return self.tp * self.dp

    @property
    def name(self) -> str:
        return f"tp{self.tp}dp{self.dp}"


def layouts_for(devices: int, max_tp: int | None = None) -> tuple[Layout, ...]:
    """Every layout of ``devices`` devices with a power-of-two TP size (TP within one node)."""
    if devices < 1:
        raise ProfileError(f"devices = {devices}: must be >= 1")
    out = []
    tp = 1
    while tp <= devices and (max_tp is None or tp <= max_tp):
        if devices % tp == 0:
            out.append(Layout(tp, devices // tp))
        tp *= 2
    return tuple(out)


def resident_layouts(device: str, gpu_memory_utilization: float, candidates: int) -> int:
    """How many layouts a pool keeps started at once. On CPU every candidate (each engine's KV
    cache is ``engine.kv_cache_gib`` of host memory). On CUDA every layout covers all the pool's
    GPUs, so each GPU holds one engine per started layout, each taking ``gpu_memory_utilization``
    of it: floor(1 / utilization) layouts fit (1 at the default 0.9), the others start on demand."""
    if device != "cuda":
        return candidates
    return max(1, min(candidates, math.floor(1 / gpu_memory_utilization + 1e-9)))


@dataclass(frozen=True)
class ProfilePoint:
    batch: int  # requests per replica
    context: int  # injected prefix length L
    tokens: float  # mean aggregate context per replica over the decode window (T)
    prefill_s: float
    decode_s: float  # mean latency of one decode step


@dataclass(frozen=True)
class LayoutProfile:
    layout: Layout
    points: tuple[ProfilePoint, ...]
    kv_capacity_tokens: int  # per replica
    startup_s: float = 0.0


@dataclass(frozen=True)
class ProfileTable:
    model: str
    hardware: str
    kv_bytes_per_token: int  # whole model (all layers, K and V); a TP rank holds 1/tp of it
    migration_bandwidth_bps: float  # measured one-way bytes/s per rank
    layouts: tuple[LayoutProfile, ...]
    decode_window: int = 16
    created_s: float = 0.0
    profile_seconds: float = 0.0
    version: int = PROFILE_VERSION

    def layout(self, layout: Layout) -> LayoutProfile:
        for lp in self.layouts:
            if lp.layout == layout:
                return lp
        have = ", ".join(lp.layout.name for lp in self.layouts) or "none"
        raise ProfileError(
            f"the profile has no {layout.name} (it has {have}); re-run `rollpacker lab profile` with "
            "that layout among the candidates"
        )

    @property
    def candidates(self) -> tuple[Layout, ...]:
        return tuple(lp.layout for lp in self.layouts)

    def to_json(self) -> str:
        d = asdict(self)
        return json.dumps(d, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, source: str = "profile") -> ProfileTable:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ProfileError(f"{source}: not JSON ({e}); re-run `rollpacker lab profile`") from e
        return cls.from_dict(d, source)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "profile") -> ProfileTable:
        def need(m: Mapping[str, Any], key: str, where: str) -> Any:
            if not isinstance(m, Mapping) or key not in m:
                raise ProfileError(f"{source}: {where} lacks {key!r}; re-run `rollpacker lab profile`")
            return m[key]

        version = d.get("version") if isinstance(d, Mapping) else None
        if version != PROFILE_VERSION:
            raise ProfileError(
                f"{source}: profile version {version!r}, this rollpacker reads {PROFILE_VERSION}; "
                "re-run `rollpacker lab profile`"
            )
        layouts = []
        for i, lp in enumerate(need(d, "layouts", "the table")):
            where = f"layouts[{i}]"
            lay = need(lp, "layout", where)
            points = []
            for j, p in enumerate(need(lp, "points", where)):
                pw = f"{where}.points[{j}]"
                try:
                    pt = ProfilePoint(
                        batch=int(need(p, "batch", pw)),
                        context=int(need(p, "context", pw)),
                        tokens=float(need(p, "tokens", pw)),
                        prefill_s=float(need(p, "prefill_s", pw)),
                        decode_s=float(need(p, "decode_s", pw)),
                    )
                except (TypeError, ValueError) as e:
                    raise ProfileError(f"{source}: {pw} has a non-numeric field ({e})") from e
                if pt.batch < 1 or pt.tokens <= 0 or pt.decode_s <= 0 or pt.prefill_s < 0:
                    raise ProfileError(f"{source}: {pw} = {p}: batch, tokens and decode_s must be > 0")
                points.append(pt)
            if not points:
                raise ProfileError(f"{source}: {where} has no points; re-run `rollpacker lab profile`")
            layouts.append(
                LayoutProfile(
                    layout=Layout(int(need(lay, "tp", where)), int(need(lay, "dp", where))),
                    points=tuple(points),
                    kv_capacity_tokens=int(need(lp, "kv_capacity_tokens", where)),
                    startup_s=float(lp.get("startup_s", 0.0)),
                )
            )
        if not layouts:
            raise ProfileError(f"{source}: no layouts; re-run `rollpacker lab profile`")
        bw = float(need(d, "migration_bandwidth_bps", "the table"))
        if bw <= 0:
            raise ProfileError(f"{source}: migration_bandwidth_bps = {bw}: must be > 0")
        return cls(
            model=str(need(d, "model", "the table")),
            hardware=str(need(d, "hardware", "the table")),
            kv_bytes_per_token=int(need(d, "kv_bytes_per_token", "the table")),
            migration_bandwidth_bps=bw,
            layouts=tuple(layouts),
            decode_window=int(d.get("decode_window", 16)),
            created_s=float(d.get("created_s", 0.0)),
            profile_seconds=float(d.get("profile_seconds", 0.0)),
        )


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys) (xs ascending, distinct), extrapolated from the end
    segments."""
    if len(xs) == 1:
        return ys[0]
    i = bisect.bisect_left(xs, x)
    i = min(max(i, 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class _Curve:
    xs: tuple[float, ...]
    ys: tuple[float, ...]

    def at(self, x: float) -> float:
        return _interp(self.xs, self.ys, x)


def _curves(points: Sequence[ProfilePoint], key: str) -> dict[int, _Curve]:
    by_b: dict[int, dict[float, list[float]]] = {}
    for p in points:
        x = p.tokens if key == "decode_s" else float(p.context)
        by_b.setdefault(p.batch, {}).setdefault(x, []).append(getattr(p, key))
    out = {}
    for b, m in by_b.items():
        xs = tuple(sorted(m))
        out[b] = _Curve(xs, tuple(sum(m[x]) / len(m[x]) for x in xs))
    return out


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica's unfinished requests: context length so far and tokens generated so far."""

    contexts: tuple[int, ...]
    generated: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.contexts) != len(self.generated):
            raise ProfileError("replica load: one generated count per context")


@dataclass
class Predictor:
    table: ProfileTable
    switch_overhead_s: float = 0.0  # fixed control cost of a switch (abort, resubmit, bookkeeping)
    kv_migration: bool = False  # the engine can move KV between layouts (vLLM cannot: recompute)
    _decode: dict[Layout, dict[int, _Curve]] = field(default_factory=dict, init=False, repr=False)
    _prefill: dict[Layout, dict[int, _Curve]] = field(default_factory=dict, init=False, repr=False)
    _floor: dict[Layout, float] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        for lp in self.table.layouts:
            self._decode[lp.layout] = _curves(lp.points, "decode_s")
            self._prefill[lp.layout] = _curves(lp.points, "prefill_s")
            self._floor[lp.layout] = min(p.decode_s for p in lp.points)

    @property
    def candidates(self) -> tuple[Layout, ...]:
        return self.table.candidates

    def kv_capacity(self, layout: Layout) -> int:
        """KV tokens one replica of ``layout`` holds (profiled)."""
        return self.table.layout(layout).kv_capacity_tokens

    # -- per step ------------------------------------------------------------------------------
    def decode_step_s(self, layout: Layout, batch: int, tokens: float) -> float:
        """One decode step of a replica holding ``batch`` requests with ``tokens`` context."""
        if batch <= 0:
            return 0.0
        curves = self._curves(self._decode, layout)
        v = self._across_batches(curves, batch, tokens)
        return max(v, self._floor[layout])

    def prefill_s(self, layout: Layout, batch: int, context: float) -> float:
        if batch <= 0:
            return 0.0
        return max(self._across_batches(self._curves(self._prefill, layout), batch, context), 0.0)

    @staticmethod
    def _across_batches(curves: Mapping[int, _Curve], batch: int, x: float) -> float:
        bs = sorted(curves)
        if batch in curves:
            return curves[batch].at(x)
        if len(bs) == 1:
            return curves[bs[0]].at(x)
        i = bisect.bisect_left(bs, batch)
        i = min(max(i, 1), len(bs) - 1)
        b0, b1 = bs[i - 1], bs[i]
        y0, y1 = curves[b0].at(x), curves[b1].at(x)
        return y0 + (y1 - y0) * (batch - b0) / (b1 - b0)

    def _curves(self, m: dict[Layout, dict[int, _Curve]], layout: Layout) -> dict[int, _Curve]:
        if layout not in m:
            self.table.layout(layout)  # raises with what the table has
        return m[layout]

    # -- switching costs -----------------------------------------------------------------------
    def recompute_s(self, layout: Layout, lengths: Sequence[int]) -> float:
        """Re-prefill ``lengths`` (full contexts) spread over the layout's replicas (PAT eq. 3-4)."""
        worst = 0.0
        for part in distribute(lengths, layout.dp):
            if part:
                rms = math.sqrt(sum(x * x for x in part) / len(part))
                worst = max(worst, self.prefill_s(layout, len(part), rms))
        return worst

    def migrate_s(self, src_tp: int, lengths: Sequence[int]) -> float:
        """Move the KV of ``lengths`` off a TP-``src_tp`` layout at the measured bandwidth (eq. 1-2)."""
        per_rank = sum(lengths) * self.table.kv_bytes_per_token / src_tp
        return per_rank / self.table.migration_bandwidth_bps

    def switch_s(self, src: Layout, dst: Layout, lengths: Sequence[int]) -> float:
        if src == dst:
            return 0.0
        state = self.recompute_s(dst, lengths)
        if self.kv_migration:
            state = min(state, self.migrate_s(src.tp, lengths))
        return self.switch_overhead_s + state

    # -- remaining time ------------------------------------------------------------------------
    def replica_remaining_s(self, layout: Layout, load: ReplicaLoad, max_len: int) -> float:
        """Decode every request of one replica up to ``max_len`` generated tokens; the batch
        shrinks, and its context leaves ``T``, as each request reaches the bound."""
        left = sorted(
            (max_len - g, c) for c, g in zip(load.contexts, load.generated, strict=True) if g < max_len
        )
        total = 0.0
        batch = len(left)
        tokens = float(sum(c for _, c in left))
        done = 0
        for r, c in left:
            n = r - done  # steps until this request reaches max_len
            if n > 0:
                # the step latency is linear in T between profile points: the midpoint is exact
                # on each linear piece and close across a knot
                total += n * self.decode_step_s(layout, batch, tokens + batch * (n - 1) / 2)
                tokens += batch * n
                done = r
            tokens -= c + r  # the finished request's whole context leaves the batch
            batch -= 1
        return total

    def remaining_s(self, layout: Layout, loads: Sequence[ReplicaLoad], max_len: int) -> float:
        """The layout's remaining decode time: its slowest replica (replicas run side by side)."""
        return max((self.replica_remaining_s(layout, ld, max_len) for ld in loads), default=0.0)


def distribute(lengths: Sequence[int], dp: int) -> list[list[int]]:
    """Spread requests over ``dp`` replicas, longest first to the least-loaded (the merge and
    redistribute of a switch)."""
    parts: list[list[int]] = [[] for _ in range(dp)]
    load = [0] * dp
    for x in sorted(lengths, reverse=True):
        i = min(range(dp), key=lambda k: (len(parts[k]), load[k]))
        parts[i].append(x)
        load[i] += x
    return parts


def redistribute(loads: Sequence[ReplicaLoad], dp: int) -> list[ReplicaLoad]:
    """All unfinished requests of ``loads`` merged and spread over ``dp`` replicas (by count,
    then by context tokens), keeping each request's (context, generated) pair."""
    reqs = sorted(
        (pair for ld in loads for pair in zip(ld.contexts, ld.generated, strict=True)), reverse=True
    )
    parts: list[list[tuple[int, int]]] = [[] for _ in range(dp)]
    tok = [0] * dp
    for c, g in reqs:
        i = min(range(dp), key=lambda k: (len(parts[k]), tok[k]))
        parts[i].append((c, g))
        tok[i] += c
    return [ReplicaLoad(tuple(c for c, _ in p), tuple(g for _, g in p)) for p in parts]


@dataclass(frozen=True)
class SwitchDecision:
    current: Layout
    target: Layout  # == current when staying
    current_s: float  # predicted remaining time if we stay
    best_s: float  # the target's remaining time plus its switch cost
    switch_s: float  # the target's switch cost
    per_layout_s: tuple[tuple[str, float], ...]  # every candidate's remaining + switch

    @property
    def switch(self) -> bool:
        return self.target != self.current


def choose_layout(
    predictor: Predictor,
    current: Layout,
    loads: Sequence[ReplicaLoad],
    max_len: int,
    candidates: Sequence[Layout] | None = None,
    min_gain_s: float = 0.0,
) -> SwitchDecision:
    """PAT Algorithm 1: the candidate with the least remaining + switch time, if it beats staying
    by more than ``min_gain_s``."""
    cands = tuple(candidates) if candidates is not None else predictor.candidates
    t_cur = predictor.remaining_s(current, loads, max_len)
    lengths = [c for ld in loads for c in ld.contexts]
    best, t_best, t_switch = current, math.inf, 0.0
    rows = []
    for lay in cands:
        if lay == current:
            t = t_cur
            sw = 0.0
        else:
            parts = redistribute(loads, lay.dp)
            # the KV the requests need by the bound (the same conservative bound as the time)
            need = max(
                (
                    sum(c + max(max_len - g, 0) for c, g in zip(p.contexts, p.generated, strict=True))
                    for p in parts
                ),
                default=0,
            )
            if need > predictor.kv_capacity(lay):
                continue  # its replicas could not hold the requests: it would preempt them
            sw = predictor.switch_s(current, lay, lengths)
            t = predictor.remaining_s(lay, parts, max_len) + sw
        rows.append((lay.name, t))
        if t < t_best:
            best, t_best, t_switch = lay, t, sw
    if best != current and not t_cur > t_best + min_gain_s:
        best, t_best, t_switch = current, t_cur, 0.0
    return SwitchDecision(current, best, t_cur, t_best, t_switch, tuple(rows))


def best_layout(predictor: Predictor, batch: int, context: int, max_len: int) -> Layout:
    """The profiled best layout for a full batch of ``batch`` requests of ``context`` prompt
    tokens decoded to ``max_len``: where the per-step planner starts."""
    times = {}
    for lay in predictor.candidates:
        loads = redistribute([ReplicaLoad((context,) * batch, (0,) * batch)], lay.dp)
        times[lay] = predictor.remaining_s(lay, loads, max_len)
    return min(times, key=lambda k: (times[k], k.tp))


@dataclass(frozen=True)
class TrajectoryStep:
    """One measured step of a layout: per-replica (batch, context tokens) and its wall time."""

    loads: tuple[tuple[int, float], ...]
    seconds: float


def predict_step(predictor: Predictor, layout: Layout, step: TrajectoryStep) -> float:
    return max((predictor.decode_step_s(layout, b, t) for b, t in step.loads if b > 0), default=0.0)


@dataclass(frozen=True)
class TrajectoryError:
    steps: int
    windows: int
    measured_s: float
    predicted_s: float
    window_mape: float  # mean |pred - meas| / meas over windows of ``window`` steps
    step_mape: float  # the same per single step (noisier: one step is a few ms on a CPU)
    total_error: float  # |sum pred - sum meas| / sum meas


def trajectory_error(
    predictor: Predictor, layout: Layout, steps: Sequence[TrajectoryStep], window: int = 16
) -> TrajectoryError:
    if not steps:
        raise ProfileError("trajectory_error: no steps to compare")
    pred = [predict_step(predictor, layout, s) for s in steps]
    meas = [s.seconds for s in steps]
    step_err = [abs(p - m) / m for p, m in zip(pred, meas, strict=True) if m > 0]
    win_err = []
    for i in range(0, len(steps), window):
        pm, mm = sum(pred[i : i + window]), sum(meas[i : i + window])
        if mm > 0 and len(meas[i : i + window]) == window:
            win_err.append(abs(pm - mm) / mm)
    if not win_err:  # shorter than one window: the whole trajectory is the window
        win_err = [abs(sum(pred) - sum(meas)) / sum(meas)]
    return TrajectoryError(
        steps=len(steps),
        windows=len(win_err),
        measured_s=sum(meas),
        predicted_s=sum(pred),
        window_mape=sum(win_err) / len(win_err),
        step_mape=sum(step_err) / max(len(step_err), 1),
        total_error=abs(sum(pred) - sum(meas)) / sum(meas),
    )
