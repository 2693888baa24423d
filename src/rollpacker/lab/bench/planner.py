"""The planner benchmark: fixed layouts vs the per-step planner vs in-step switching (PAT), in one
run, on the replay trace.

Two parts, both driving the real tail-batching policy, the real round driver and the real
``SwitchingEngine`` / ``LayoutEngine`` code:

- **simulated** (always): every replica is a ``FakeEngine`` whose step time is the latency
  predictor's (``rollpacker.core.latency``) for the measured profile, prefill and recompute
  included, on a virtual clock. Two KV scenarios: the profile's measured KV capacity, and a
  memory-constrained node where the model's weights take a share of each device, so a larger TP
  frees KV (RollPacker's reason for raising TP when preemptions rise).
- **real** (``real_steps > 0``): the same trace steps on the warm vLLM engines of each layout on
  this machine (TP 1 x DP 2 and TP 2 x DP 1 on two cores here), wall-clock timed.

Plus the predictor's view of the trade-off (remaining time of a tail on each layout, and the
switch cost), which says in numbers why a switch does or does not pay on this hardware.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from rollpacker.core import planner as plan_mod
from rollpacker.core.config import PolicyName, RolloutConfig
from rollpacker.core.errors import ConfigError
from rollpacker.core.latency import (
    Layout,
    Predictor,
    ProfileTable,
    ReplicaLoad,
    best_layout,
    redistribute,
)
from rollpacker.core.policies.tail_batching import TailBatchingPolicy
from rollpacker.core.prompts import PromptCursor
from rollpacker.core.trace import TraceRecord, check_serves, to_prompts
from rollpacker.engines.fake import FakeEngine
from rollpacker.engines.layout import EnginePool, LayoutEngine, SwitchingEngine
from rollpacker.lab.bench.replay import replay_sampling
from rollpacker.lab.bench.tables import MAX_COLUMNS, clip, legend, wrap
from rollpacker.rollout.driver import run_round


@dataclass(frozen=True)
class PlannerBenchConfig:
    rollout: RolloutConfig
    max_num_seqs: int = 128  # per replica
    steps: int = 12
    real_steps: int = 4
    check_every: int = 16
    switch_overhead_s: float = 0.02
    # the constrained scenario: KV tokens one TP-1 replica holds, and the share of a device the
    # weights take at TP 1 (at TP t they take 1/t of it; the rest is KV)
    constrained_kv_tokens: int = 3_000
    weights_share: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps < 1 or self.real_steps < 0 or self.check_every < 1:
            raise ConfigError("bench planner: steps >= 1, real_steps >= 0, check_every >= 1")
        if not 0.0 <= self.weights_share < 1.0:
            raise ConfigError(f"bench planner: weights_share = {self.weights_share}: must be in [0, 1)")


def kv_capacity(lay: Layout, tp1_tokens: int, weights_share: float) -> int:
    """KV tokens of one replica of ``lay`` when a TP-1 replica holds ``tp1_tokens``: each device
    keeps ``1 - w/tp`` of its memory for KV, and a token's KV is split over the ``tp`` ranks."""
    per_device = tp1_tokens * (1.0 - weights_share / lay.tp) / (1.0 - weights_share)
    return int(lay.tp * per_device)


def simulated_pool(
    pred: Predictor,
    layouts: Sequence[Layout],
    max_num_seqs: int,
    capacity: Callable[[Layout], int],
    vocab_size: int = 320,
) -> EnginePool:
    """Simulated replicas per layout, timed by the predictor (decode + (re)prefill per step)."""

    def step_time(lay: Layout) -> Callable[[int, int, Sequence[int]], float]:
        def f(batch: int, tokens: int, prefill: Sequence[int]) -> float:
            t = pred.decode_step_s(lay, batch, tokens) if batch else 0.0
            if prefill:
                rms = math.sqrt(sum(x * x for x in prefill) / len(prefill))
                t += pred.prefill_s(lay, len(prefill), rms)
            return t

        return f

    engines = {}
    for lay in layouts:
        reps = [
            FakeEngine(
                concurrency=max_num_seqs,
                kv_capacity_tokens=capacity(lay),
                vocab_size=vocab_size,
                tp_size=lay.tp,
                step_time=step_time(lay),
            )
            for _ in range(lay.dp)
        ]
        engines[lay] = LayoutEngine(lay, reps, virtual=True)
    return EnginePool.of(engines)


@dataclass
class ModeRun:
    mode: str
    time_s: float = 0.0
    per_step_s: list[float] = dataclasses.field(default_factory=list)
    layouts: list[str] = dataclasses.field(default_factory=list)  # each step's starting layout
    preemptions: list[int] = dataclasses.field(default_factory=list)
    switches: int = 0
    switch_s: float = 0.0
    round_kinds: list[str] = dataclasses.field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "rollout_time_s": self.time_s,
            "per_step_s": self.per_step_s,
            "layouts": self.layouts,
            "preemptions": self.preemptions,
            "switches": self.switches,
            "switch_s": self.switch_s,
            "round_kinds": self.round_kinds,
        }


def run_mode(
    mode: str,
    pool: EnginePool,
    pred: Predictor,
    start: Layout,
    records: Sequence[TraceRecord],
    cfg: PlannerBenchConfig,
    steps: int,
    devices: int,
    max_tp: int,
    progress: Callable[[str], None] = lambda _m: None,
) -> ModeRun:
    """One layout policy over ``steps`` tail-batching steps of the trace.

    ``mode``: ``fixed`` (stay on ``start``), ``per-step`` (RollPacker: TP per round kind from the
    preemption history), ``switching`` (PAT inside each round), ``per-step+switching``.
    """

    rc = dataclasses.replace(cfg.rollout, policy=PolicyName.TAIL_BATCHING)
    prompts = to_prompts(records, vocab_size=259, seed=cfg.seed)
    ns = f"{mode}-{start.name}-{time.time_ns()}"
    policy = TailBatchingPolicy(
        rc,
        PromptCursor(prompts, shuffle=False, epochs=1),
        replay_sampling(rc.max_tokens, cfg.seed),
        namespace=ns,
    )
    switching = "switching" in mode
    per_step = mode.startswith("per-step")
    eng = SwitchingEngine(pool, pred, start, check_every=cfg.check_every, enabled=switching)
    pcfg = plan_mod.PlannerConfig(initial_tp=start.tp, max_tp=max_tp)
    pstate = plan_mod.initial(pcfg)
    run = ModeRun(mode=f"{mode} ({start.name})" if mode == "fixed" else mode)
    for step in range(steps):
        plan = policy.plan_step(step)
        kind = plan.round_kind.value if plan.round_kind.value in plan_mod.KINDS else "short"
        if per_step:
            tp = pstate.tp_for(kind)
            eng.set_layout(Layout(tp, devices // tp))
        run.layouts.append(eng.current.name)
        n_events = len(eng.events)
        rr = run_round(eng, policy.open_round(plan))
        policy.commit(rr.result)
        new = eng.events[n_events:]
        run.switches += len(new)
        run.switch_s += sum(e.seconds for e in new)
        run.per_step_s.append(rr.metrics.time_s)
        run.preemptions.append(rr.metrics.preemptions)
        run.round_kinds.append(plan.round_kind.value)
        if per_step:
            pstate = plan_mod.observe(pcfg, pstate, kind, rr.metrics.preemptions)
        progress(
            f"{run.mode:<28} step {step:>2} {plan.round_kind.value:<5} on {run.layouts[-1]}: "
            f"{rr.metrics.time_s:7.2f} s, {rr.metrics.preemptions} preemptions, {len(new)} switches"
        )
    run.time_s = sum(run.per_step_s)
    return run


def predictor_view(pred: Predictor, max_len: int) -> list[dict[str, Any]]:
    """Remaining decode time of a tail (B requests, 256 tokens generated, context 320) on each
    layout, and what switching to it costs: the numbers behind every switch decision."""
    rows = []
    for b in (128, 32, 8, 2, 1):
        loads = [ReplicaLoad((320,) * b, (256,) * b)]
        row: dict[str, Any] = {"requests": b}
        for lay in pred.candidates:
            row[f"remaining_s_{lay.name}"] = pred.remaining_s(lay, redistribute(loads, lay.dp), max_len)
            others = [c for c in pred.candidates if c != lay]
            if others:
                row[f"switch_to_s_{lay.name}"] = pred.switch_s(others[0], lay, [320] * b)
        rows.append(row)
    return rows


# one mode's run: (mode, pool, predictor, starting layout, steps) -> its result
_RunMode = Callable[[str, EnginePool, Predictor, Layout, int], ModeRun]


def run_planner_bench(
    table: ProfileTable,
    records: Sequence[TraceRecord],
    cfg: PlannerBenchConfig,
    source: str,
    real_pool: EnginePool | None = None,
    progress: Callable[[str], None] = lambda _m: None,
) -> dict[str, Any]:
    rc = cfg.rollout
    check_serves(records, rc.launched_responses, source)
    pred = Predictor(table, switch_overhead_s=cfg.switch_overhead_s)
    layouts = table.candidates
    devices = max(lay.devices for lay in layouts)
    max_tp = max(lay.tp for lay in layouts)
    batch = rc.launched_prompts * rc.launched_responses
    prompt_len = round(sum(r.prompt_len for r in records) / len(records))
    best = best_layout(pred, batch, prompt_len, rc.max_tokens)
    progress(f"profiled best layout for {batch} x {rc.max_tokens} tokens: {best.name}")

    def mode_run(mode: str, pool: EnginePool, predictor: Predictor, start: Layout, steps: int) -> ModeRun:
        return run_mode(mode, pool, predictor, start, records, cfg, steps, devices, max_tp, progress)

    sim: dict[str, Any] = {}
    for name, cap in _kv_scenarios(table, cfg).items():
        pred = _scenario_predictor(table, cap, cfg.switch_overhead_s)
        sim[name] = _simulate(mode_run, pred, layouts, best, cap, cfg)
    # from here on ``pred`` is the last scenario's predictor
    out: dict[str, Any] = {
        "config": {**asdict(cfg), "rollout": asdict(rc), "source": source},
        "profile": {
            "model": table.model,
            "hardware": table.hardware,
            "layouts": [lay.name for lay in layouts],
        },
        "best_layout": best.name,
        "simulated": sim,
        "predictor_view": predictor_view(pred, rc.max_tokens),
    }
    if real_pool is not None and cfg.real_steps > 0:
        runs = [mode_run("fixed", real_pool, pred, lay, cfg.real_steps) for lay in layouts]
        runs.append(mode_run("switching", real_pool, pred, best, cfg.real_steps))
        out["real"] = _with_speedups(runs, {})
    return out


# the simulated KV scenarios, each in words
KV_SCENARIOS = {
    "measured_kv": "the profiled KV capacity",
    "constrained_kv": "memory-constrained: the weights take a share of each device",
}


def _kv_scenarios(table: ProfileTable, cfg: PlannerBenchConfig) -> dict[str, Callable[[Layout], int]]:
    """Each simulated scenario's KV tokens per replica of a layout (``KV_SCENARIOS`` says each)."""
    capacities = {lp.layout: lp.kv_capacity_tokens for lp in table.layouts}
    return {
        "measured_kv": lambda lay: capacities[lay],
        "constrained_kv": lambda lay: kv_capacity(lay, cfg.constrained_kv_tokens, cfg.weights_share),
    }


def _scenario_predictor(
    table: ProfileTable, cap: Callable[[Layout], int], switch_overhead_s: float
) -> Predictor:
    """The predictor knows the scenario's KV capacity (switch targets must hold the requests)."""
    return Predictor(
        dataclasses.replace(
            table,
            layouts=tuple(dataclasses.replace(lp, kv_capacity_tokens=cap(lp.layout)) for lp in table.layouts),
        ),
        switch_overhead_s=switch_overhead_s,
    )


def _simulate(
    mode_run: _RunMode,
    pred: Predictor,
    layouts: Sequence[Layout],
    best: Layout,
    cap: Callable[[Layout], int],
    cfg: PlannerBenchConfig,
) -> dict[str, Any]:
    """One KV scenario on simulated replicas: every fixed layout, then the planner modes from
    ``best``, each on a fresh pool."""
    runs = []
    for lay in layouts:
        pool = simulated_pool(pred, layouts, cfg.max_num_seqs, cap)
        runs.append(mode_run("fixed", pool, pred, lay, cfg.steps))
    for mode in ("per-step", "switching", "per-step+switching"):
        pool = simulated_pool(pred, layouts, cfg.max_num_seqs, cap)
        runs.append(mode_run(mode, pool, pred, best, cfg.steps))
    return _with_speedups(runs, {lay.name: cap(lay) for lay in layouts})


def _with_speedups(runs: Sequence[ModeRun], kv: dict[str, int]) -> dict[str, Any]:
    base = min((r.time_s for r in runs if r.mode.startswith("fixed")), default=0.0)
    rows = []
    for r in runs:
        s = r.summary()
        s["vs_best_fixed"] = base / r.time_s if r.time_s > 0 else 0.0
        rows.append(s)
    return {"kv_tokens_per_replica": kv, "modes": rows}


_MODE_LEGEND = (
    (
        "mode",
        "fixed (L) = layout L for every step; per-step = RollPacker's planner picks each round's TP from "
        "the preemptions of earlier rounds of its kind; switching = PAT switches layout inside a round; "
        "per-step+switching = both",
    ),
    ("rollout s", "rollout seconds over all the steps (the predictor's seconds where SIMULATED)"),
    (
        "vs best fixed",
        "the fastest fixed layout's rollout s / this mode's (> 1 = faster than every fixed layout)",
    ),
    ("preempted", "requests preempted because the KV cache was full, over all the steps"),
    ("switches", "layout switches inside rounds"),
    ("layouts", "each step's starting layout (tpTdpD = D replicas of TP T), xN = for N steps in a row"),
)


def render(report: dict[str, Any]) -> str:
    """The printed report: one table per KV scenario SIMULATED on the predictor, one MEASURED on the
    real engines (when run), a legend, and the predictor's view of a tail; at most ``MAX_COLUMNS``
    wide."""
    p = report["profile"]
    lines = wrap(
        f"planner benchmark, profile of {p['model']} on {p['hardware']}; best layout for a full round: "
        f"{report['best_layout']}"
    )
    for name, part in report["simulated"].items():
        title = f"SIMULATED on the profile's latency predictor, {name} ({KV_SCENARIOS[name]}):"
        lines += ["", *_mode_table(title, part)]
    if "real" in report:
        lines += [
            "",
            *_mode_table("MEASURED on this machine's real vLLM engines (wall clock):", report["real"]),
        ]
    lines += legend(_MODE_LEGEND)
    lines += ["", *_predictor_lines(report["predictor_view"])]
    return "\n".join(lines)


def _mode_table(title: str, part: dict[str, Any]) -> list[str]:
    """One scenario's modes: rollout seconds, speed against the best fixed layout, preemptions,
    switches and each step's layout."""
    lines = wrap(title)
    if part.get("kv_tokens_per_replica"):
        kv = ", ".join(f"{k} {v}" for k, v in part["kv_tokens_per_replica"].items())
        lines += wrap(f"KV tokens per replica: {kv}", indent="  ")
    hdr = (
        f"  {'mode':<20}  {'rollout s':>9}  {'vs best fixed':>13}  {'preempted':>9}  {'switches':>8}  layouts"
    )
    lines += [hdr, "  " + "-" * (len(hdr) - 2)]
    room = MAX_COLUMNS - len(hdr) + len("layouts")
    for m in part["modes"]:
        lines.append(
            f"  {clip(m['mode'], 20):<20}  {m['rollout_time_s']:>9.2f}  {m['vs_best_fixed']:>12.2f}x  "
            f"{sum(m['preemptions']):>9}  {m['switches']:>8}  {clip(_layout_runs(m['layouts']), room)}"
        )
    return lines


def _layout_runs(layouts: Sequence[str]) -> str:
    """Each step's layout, a run of the same one written once: ``tp1dp2 x4, tp2dp1 x2``."""
    return ", ".join(f"{lay} x{len(list(run))}" for lay, run in itertools.groupby(layouts))


def _predictor_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The predictor's view of a tail: per layout, seconds to finish it there and to switch there."""
    lines = wrap(
        "PREDICTED by the latency predictor: a tail of B requests (context 320, 256 tokens generated) "
        "on each layout"
    )
    layouts = [k.removeprefix("remaining_s_") for k in rows[0] if k.startswith("remaining_s_")]
    batches = "".join(f" {'B=' + str(r['requests']):>8}" for r in rows)
    lines.append(f"  {'layout':<8} {'seconds':<9}{batches}")
    for lay in layouts:
        finish = "".join(f" {r[f'remaining_s_{lay}']:>8.3f}" for r in rows)
        switch = "".join(f" {_seconds(r.get(f'switch_to_s_{lay}')):>8}" for r in rows)
        lines += [f"  {lay:<8} {'to finish':<9}{finish}", f"  {'':<8} {'to switch':<9}{switch}"]
    return lines + legend(
        (
            ("to finish", "predicted seconds to decode the rest of the tail on that layout"),
            ("to switch", "predicted seconds to switch to that layout from another (- = no other layout)"),
        ),
        indent="  ",
    )


def _seconds(s: float | None) -> str:
    return "-" if s is None else f"{s:.3f}"
