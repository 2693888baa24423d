"""The per-step parallelism planner (RollPacker section 4.2): TP sizes from preemption counts.

Start from the profiled best TP size. After each step, for the kind of round it ran (short or
long; tail batching's short rounds put more concurrent requests on the engine than long rounds,
so each kind keeps its own TP size and is compared with its own previous step):

- a sudden rise in preemptions, more than ``rise_factor`` (1.05) times the previous step of the
  same kind, doubles TP (a step with preemptions after one with none is a rise);
- ``calm_steps`` (4) consecutive steps of the kind with zero preemptions halve TP;
- TP stays a power of two within ``[min_tp, max_tp]``, ``max_tp`` being the devices of one node
  (TP groups never cross nodes).

The planner is a pure function of the step history, so the controller stores the history and
replays it (``replay``); a restart can never lose or double a decision.

Invariants (tests/core/test_planner.py):
- every TP size is a power of two in ``[min_tp, max_tp]``, and with ``devices`` it divides them
  (``devices`` is a multiple of ``max_tp``), so each layout fills the devices;
- ``replay(h)`` equals applying ``observe`` one step at a time (the state round-trips);
- a short round's preemptions never change the long rounds' TP, and the other way round;
- TP only grows on a rise above ``rise_factor`` and only shrinks after ``calm_steps`` calm steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from rollpacker.core.errors import ConfigError
from rollpacker.core.types import RoundKind

KINDS = (RoundKind.SHORT, RoundKind.LONG)


@dataclass(frozen=True)
class PlannerConfig:
    initial_tp: int = 1  # the profiled best TP size without tail batching
    max_tp: int = 8  # devices of one node
    min_tp: int = 1
    rise_factor: float = 1.05
    calm_steps: int = 4
    # Engines in layouts (tp x dp over ``devices`` devices of one node; 0 = one engine of
    # engine.tensor_parallel_size, no layouts): the round's TP picks its layout.
    devices: int = 0
    switching: bool = False  # PAT: switch layout inside a round when the predictor says it pays
    check_every: int = 16  # engine steps between switch decisions
    min_gain_s: float = 0.0  # a switch must beat staying by more than this
    switch_overhead_s: float = 0.02  # fixed control cost of a switch, on top of the recompute
    reprofile_margin: float = 0.25  # re-profile when a step's decode time drifts more than this
    profile_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    profile_contexts: tuple[int, ...] = (16, 64, 256, 768)
    profile_window: int = 16  # decode steps timed per profile point

    def __post_init__(self) -> None:
        for name in ("initial_tp", "max_tp", "min_tp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ConfigError(f"planner.{name} = {v!r}: must be a power of two >= 1")
        if not self.min_tp <= self.initial_tp <= self.max_tp:
            raise ConfigError(
                f"planner: need min_tp <= initial_tp <= max_tp, got {self.min_tp}, {self.initial_tp}, "
                f"{self.max_tp}"
            )
        if not self.rise_factor >= 1.0:
            raise ConfigError(f"planner.rise_factor = {self.rise_factor!r}: must be >= 1.0")
        if isinstance(self.calm_steps, bool) or self.calm_steps < 1:
            raise ConfigError(f"planner.calm_steps = {self.calm_steps!r}: must be >= 1")
        if isinstance(self.devices, bool) or not isinstance(self.devices, int) or self.devices < 0:
            raise ConfigError(f"planner.devices = {self.devices!r}: a device count >= 0 (0 = no layouts)")
        if self.devices and self.max_tp > self.devices:
            raise ConfigError(
                f"planner.max_tp = {self.max_tp} exceeds planner.devices = {self.devices}: a TP group "
                "never spans more devices than one node has"
            )
        if self.devices and self.devices % self.max_tp:
            raise ConfigError(
                f"planner.devices = {self.devices} is not a multiple of planner.max_tp = {self.max_tp}: "
                f"a round planned at TP {self.max_tp} would leave {self.devices % self.max_tp} device(s) "
                "idle (every layout must fill the devices); use a power-of-two max_tp dividing devices"
            )
        if self.check_every < 1 or self.profile_window < 2:
            raise ConfigError("planner.check_every must be >= 1 and planner.profile_window >= 2")
        if self.min_gain_s < 0 or self.switch_overhead_s < 0 or not self.reprofile_margin > 0:
            raise ConfigError("planner.min_gain_s and switch_overhead_s must be >= 0, reprofile_margin > 0")
        for name in ("profile_batches", "profile_contexts"):
            v = getattr(self, name)
            if not v or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in v):
                raise ConfigError(f"planner.{name} = {v!r}: a non-empty list of positive integers")


@dataclass(frozen=True)
class KindPlan:
    """One round kind's TP size and what its next decision depends on."""

    tp: int
    last_preemptions: int | None = None  # the previous step of this kind
    calm: int = 0  # consecutive steps of this kind with zero preemptions


@dataclass(frozen=True)
class PlannerState:
    short: KindPlan
    long: KindPlan

    def tp_for(self, kind: RoundKind) -> int:
        return self._kind(kind).tp

    def _kind(self, kind: RoundKind) -> KindPlan:
        if kind == RoundKind.SHORT:
            return self.short
        if kind == RoundKind.LONG:
            return self.long
        raise ConfigError(f"round kind {kind!r}: the planner keeps TP for {', '.join(KINDS)}")


def initial(cfg: PlannerConfig) -> PlannerState:
    return PlannerState(KindPlan(cfg.initial_tp), KindPlan(cfg.initial_tp))


def observe(cfg: PlannerConfig, state: PlannerState, kind: RoundKind, preemptions: int) -> PlannerState:
    """The state after a step of ``kind`` that saw ``preemptions`` KV-cache preemptions."""
    if isinstance(preemptions, bool) or not isinstance(preemptions, int) or preemptions < 0:
        raise ConfigError(f"preemptions = {preemptions!r}: must be a count >= 0")
    k = state._kind(kind)
    tp, calm = k.tp, k.calm
    rose = k.last_preemptions is not None and preemptions > cfg.rise_factor * k.last_preemptions
    if rose:
        tp, calm = min(tp * 2, cfg.max_tp), 0
    elif preemptions == 0:
        calm += 1
        if calm >= cfg.calm_steps:
            tp, calm = max(tp // 2, cfg.min_tp), 0
    else:
        calm = 0
    new = KindPlan(tp=tp, last_preemptions=preemptions, calm=calm)
    return dataclasses.replace(state, **{RoundKind(kind).value: new})


def replay(cfg: PlannerConfig, history: Iterable[tuple[RoundKind, int]]) -> PlannerState:
    """The planner's state after the (round kind, preemptions) steps of ``history``; rounds of any
    other kind (a sync policy's standard rounds count as short) are planned as short rounds."""
    state = initial(cfg)
    for kind, preemptions in history:
        state = observe(cfg, state, kind if kind in KINDS else RoundKind.SHORT, preemptions)
    return state
