"""``rollpacker lab whatif``: every rollout policy, and a grid of settings, on a simulated engine.

The simulator is the replay benchmark (``bench.replay.run_benchmark``: the real policies, the real
round driver, the same trace handling and accounting) on a ``SimEngine`` whose clock a cost model
prices: a measured profile, or a roofline of a named accelerator and model (``core.costmodel``).
Per deployment (TP x DP) it reports rollout seconds per trained step, speedup over sync, bubble
ratio and tokens wasted for each policy; a grid over ``eta_p``, ``eta_r``, ``P0`` and TP runs
sync and tail batching at each point and recommends settings:

- ``best_eta``: at each (TP, P0), the ``eta_p``/``eta_r`` with the highest tail-batching speedup
  over sync. The speedup is the fair figure across speculation settings: each cell's sync trains
  exactly the prompts its tail batching trained, while those prompts (and so the seconds per
  step) differ from one setting to another;
- ``tp_ranking``: per TP, tail batching's mean seconds per step over the grid cells at the user's
  P0 (the same settings, hence the same prompts, for every TP: a fair comparison of TPs);
- ``recommended``: at the user's P0, the TP given (or the first of the ranking), its best eta.
  P0 also changes the learning dynamics, which no rollout simulator sees: other P0s are reported
  per P0, never recommended across.

A cell without prompt speculation (``eta_p = 1``) has no long rounds, so "periods" would mean
steps; it runs as many steps as a period of the least prompt speculation in the grid takes, so
every cell covers about as much of the trace.

Invariants (tests/lab/bench/whatif/test_whatif.py):
- the grid holds one cell per (deployment, P0, eta_p, eta_r), each with sync and tail batching;
- at eta_p = eta_r = 1 tail batching is the synchronous schedule: speedup 1;
- the recommendation is a grid cell, and no cell at its (TP, P0) has a higher speedup.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollpacker.core.config import RolloutConfig, SortedConfig
from rollpacker.core.config import _positive_int as positive_int
from rollpacker.core.errors import ConfigError
from rollpacker.core.trace import TraceRecord
from rollpacker.core.types import RoundKind
from rollpacker.lab.bench.replay import ALL_POLICIES, BenchConfig, run_benchmark
from rollpacker.lab.bench.whatif.engine import SimEngine
from rollpacker.lab.bench.whatif.specfiles import Deployment

WHATIF_VERSION = 1
DEFAULT_ETAS = (1.0, 1.25, 1.5)
GRID_POLICIES = ("sync", "tail_batching")
SCALING_BATCHES = (1, 8, 32, 128, 256)
SCALING_CONTEXT = 1024  # mean context per request when the cost model's batch curve is printed


@dataclass(frozen=True)
class WhatIfConfig:
    """The user's settings (the per-policy comparison) and the grid around them."""

    p0: int = 16
    r0: int = 4
    eta_p: float = 1.25
    eta_r: float = 1.25
    max_tokens: int = 1024
    concurrency: int = 0  # max_num_seqs of one replica; 0 = every request of any grid setting at once
    periods: int = 2  # whole tail-batching periods per policy comparison
    grid_periods: int = 1  # per grid cell
    policies: tuple[str, ...] = ALL_POLICIES
    eta_ps: tuple[float, ...] = DEFAULT_ETAS
    eta_rs: tuple[float, ...] = DEFAULT_ETAS
    p0s: tuple[int, ...] = ()  # () = (p0,)
    group_size: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.eta_ps or not self.eta_rs:
            raise ConfigError("whatif: the grid needs at least one eta_p and one eta_r")
        if (
            isinstance(self.concurrency, bool)
            or not isinstance(self.concurrency, int)
            or self.concurrency < 0
        ):
            raise ConfigError(
                f"whatif.concurrency = {self.concurrency!r}: must be an integer >= 0 (0 = auto)"
            )
        for name in ("p0", "r0", "max_tokens", "periods", "grid_periods"):
            positive_int(f"whatif.{name}", getattr(self, name))
        self.rollout()  # validates P0, R0 and the speculation factors
        for p0 in self.grid_p0s:
            for ep in self.eta_ps:
                for er in self.eta_rs:
                    self.rollout(p0, ep, er)

    @property
    def grid_p0s(self) -> tuple[int, ...]:
        return self.p0s or (self.p0,)

    @property
    def responses_needed(self) -> int:
        """Lengths a trace prompt needs for every setting of the run (ceil(eta_r * R0) at most)."""
        return math.ceil(max((self.eta_r, *self.eta_rs)) * self.r0 - 1e-9)

    def replica_concurrency(self, dp: int) -> int:
        """Slots of one replica: ``concurrency``, or (0) enough for every request the most
        speculative grid setting launches, spread over ``dp`` replicas."""
        if self.concurrency:
            return self.concurrency
        launched = max(
            self.rollout(p0, ep, er).launched_prompts * self.rollout(p0, ep, er).launched_responses
            for p0 in (self.p0, *self.grid_p0s)
            for ep in (self.eta_p, *self.eta_ps)
            for er in (self.eta_r, *self.eta_rs)
        )
        return math.ceil(launched / dp)

    def rollout(
        self, p0: int | None = None, eta_p: float | None = None, eta_r: float | None = None
    ) -> RolloutConfig:
        return RolloutConfig(
            prompts_per_step=self.p0 if p0 is None else p0,
            responses_per_prompt=self.r0,
            eta_p=self.eta_p if eta_p is None else eta_p,
            eta_r=self.eta_r if eta_r is None else eta_r,
            max_tokens=self.max_tokens,
            sorted=SortedConfig(group_size=self.group_size),
        )


def simulate(
    records: Sequence[TraceRecord],
    dep: Deployment,
    rc: RolloutConfig,
    cfg: WhatIfConfig,
    policies: Sequence[str],
    periods: int,
    source: str,
) -> dict[str, Any]:
    """The replay benchmark of ``policies`` on ``dep``'s simulated engine; each policy's row."""
    engine = SimEngine(dep.cost, dp=dep.dp, concurrency=cfg.replica_concurrency(dep.dp))
    bcfg = BenchConfig(
        rollout=rc, periods=periods, seed=cfg.seed, policies=tuple(policies), scaledown_replicas=0
    )
    report = run_benchmark(engine, records, bcfg, source=source)
    return {name: policy_row(s) for name, s in report["policies"].items()}


def policy_row(s: dict[str, Any]) -> dict[str, Any]:
    """What the what-if reports of one arm of the replay benchmark."""
    gen = s["tokens_generated"]
    short, long = round_means(s)
    return {
        "steps": s["steps"],
        "short_rounds": s["short_rounds"],
        "long_rounds": s["long_rounds"],
        "rollout_s_per_step": s["rollout_s_per_step"],
        "speedup": s["speedup"],
        "speedup_note": s["speedup_note"],
        "bubble_ratio": s["bubble_ratio"],
        "tokens_generated": gen,
        "tokens_wasted": s["tokens_wasted"],
        "wasted_share": s["wasted_share"],
        "output_tokens_per_s": s["output_tokens_per_s"],
        "trained_tokens_per_s": s["trained_tokens_per_s"],
        "s_per_trained_step": s["s_per_trained_step"],
        "preemptions": s["preemptions"],
        "policy_lag": s["policy_lag"],
        "max_len_mean": sum(s["max_len_per_step"]) / max(1, len(s["max_len_per_step"])),
        "short_round_s": short,
        "long_round_s": long,
    }


def round_means(s: dict[str, Any]) -> tuple[float | None, float | None]:
    """Mean rollout seconds of the short and of the long rounds of a replay summary."""
    pairs = list(zip(s["round_kinds"], s["time_s_per_step"], strict=True))
    short = [t for k, t in pairs if k == RoundKind.SHORT.value]
    long = [t for k, t in pairs if k == RoundKind.LONG.value]
    return (sum(short) / len(short) if short else None, sum(long) / len(long) if long else None)


def grid(
    records: Sequence[TraceRecord],
    deps: Sequence[Deployment],
    cfg: WhatIfConfig,
    source: str,
    progress: Callable[[str], None] = lambda _s: None,
) -> list[dict[str, Any]]:
    """Sync and tail batching at every (deployment, P0, eta_p, eta_r)."""
    cells = []
    for dep in deps:
        for p0 in cfg.grid_p0s:
            for ep in cfg.eta_ps:
                for er in cfg.eta_rs:
                    rc = cfg.rollout(p0, ep, er)
                    rows = simulate(records, dep, rc, cfg, GRID_POLICIES, cell_periods(cfg, p0, ep), source)
                    sync, tb = rows["sync"], rows["tail_batching"]
                    cells.append(
                        {
                            "deployment": dep.name,
                            "tp": dep.cost.tp,
                            "dp": dep.dp,
                            "p0": p0,
                            "eta_p": ep,
                            "eta_r": er,
                            "sync_s_per_step": sync["rollout_s_per_step"],
                            "rollout_s_per_step": tb["rollout_s_per_step"],
                            "s_per_sample": tb["rollout_s_per_step"] / (p0 * cfg.r0),
                            "speedup": tb["speedup"],
                            "wasted_share": tb["wasted_share"],
                            "steps": tb["steps"],
                        }
                    )
            progress(f"grid: {dep.name} done ({len(cells)} cells)")
    return cells


def _best(cells: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The cell with the highest speedup (ties: less speculation)."""
    return min(cells, key=lambda c: (-(c["speedup"] or 0.0), c["eta_p"] + c["eta_r"]))


def recommend(cells: Sequence[dict[str, Any]], cfg: WhatIfConfig, tp: int | None) -> dict[str, Any]:
    """``best_eta`` per (TP, P0), ``tp_ranking`` and ``recommended``; see the module docstring."""
    if not cells:
        raise ConfigError("whatif: the grid is empty")
    keys = sorted({(c["tp"], c["p0"]) for c in cells})
    best_eta = [_best([c for c in cells if (c["tp"], c["p0"]) == k]) for k in keys]
    at_p0 = [c for c in cells if c["p0"] == cfg.p0] or list(cells)
    ranking = sorted(
        (
            {"tp": t, "mean_tb_s_per_step": sum(xs) / len(xs)}
            for t in sorted({c["tp"] for c in at_p0})
            for xs in [[c["rollout_s_per_step"] for c in at_p0 if c["tp"] == t]]
        ),
        key=lambda r: r["mean_tb_s_per_step"],
    )
    chosen = tp if tp is not None else ranking[0]["tp"]
    rec = next(c for c in best_eta if c["tp"] == chosen and c["p0"] == at_p0[0]["p0"])
    return {"best_eta": best_eta, "tp_ranking": ranking, "recommended": {**rec, "why": _why(rec, tp)}}


def _why(rec: dict[str, Any], tp: int | None) -> str:
    where = f"TP {rec['tp']}" if tp is not None else f"TP {rec['tp']} (the fastest TP over the grid)"
    return (
        f"highest simulated tail-batching speedup over sync at P0 = {rec['p0']}, {where}: "
        f"eta_p = {rec['eta_p']}, eta_r = {rec['eta_r']} -> {rec['speedup']:.2f}x "
        f"({rec['rollout_s_per_step']:.3g} s/step)"
    )


def cell_periods(cfg: WhatIfConfig, p0: int, eta_p: float) -> int:
    """Periods of one grid cell: ``grid_periods``, or without prompt speculation (no long rounds:
    a period is one step) the steps of that many periods at the least prompt speculation of the
    grid (4 short + 1 long at 1.25)."""
    if eta_p > 1.0:
        return cfg.grid_periods
    ref = min((e for e in cfg.eta_ps if e > 1.0), default=1.25)
    rc = cfg.rollout(p0, ref, 1.0)
    per_period = math.ceil(p0 / (rc.launched_prompts - p0)) + 1
    return cfg.grid_periods * per_period


def cost_curve(dep: Deployment, concurrency: int) -> list[dict[str, float]]:
    """The cost model's decode step at a few batch sizes (per replica, ``SCALING_CONTEXT`` tokens each)."""
    out = []
    for b in sorted({x for x in SCALING_BATCHES if x <= concurrency} | {concurrency}):
        step = dep.cost.decode_s(b, b * SCALING_CONTEXT)
        out.append({"batch": b, "step_ms": 1e3 * step, "tokens_per_s": b * dep.dp / step})
    return out


@dataclass
class WhatIf:
    """One what-if run: the trace, the deployments and the settings."""

    records: Sequence[TraceRecord]
    source: str
    deps: Sequence[Deployment]
    cfg: WhatIfConfig
    tp: int | None = None  # the user's TP (None: every deployment compared)
    meta: dict[str, Any] = field(default_factory=dict)  # hardware, model: echoed in the report

    def run(self, progress: Callable[[str], None] = lambda _s: None) -> dict[str, Any]:
        t0 = time.perf_counter()
        cfg = self.cfg
        main = [d for d in self.deps if self.tp is None or d.cost.tp == self.tp]
        if not main:
            have = ", ".join(d.name for d in self.deps)
            raise ConfigError(f"--tp {self.tp}: no deployment with that TP (have {have})")
        policies: dict[str, Any] = {}
        for dep in main:
            progress(f"policies on {dep.name} ({dep.cost.label})")
            policies[dep.name] = simulate(
                self.records, dep, cfg.rollout(), cfg, cfg.policies, cfg.periods, self.source
            )
        cells = grid(self.records, self.deps, cfg, self.source, progress)
        rec = recommend(cells, cfg, self.tp)
        return self._report(policies, cells, rec, time.perf_counter() - t0)

    def _report(
        self, policies: dict[str, Any], cells: list[dict[str, Any]], rec: dict[str, Any], runtime_s: float
    ) -> dict[str, Any]:
        from rollpacker.core.trace import length_stats

        cfg = self.cfg
        return {
            "whatif_version": WHATIF_VERSION,
            "simulated": True,
            "simulated_by": "SimEngine (rollpacker.lab.bench.whatif.engine): a skip-ahead virtual clock "
            "priced by a cost model",
            **self.meta,
            "trace": {
                "source": self.source,
                "prompts": len(self.records),
                **length_stats(self.records, cfg.r0),
            },
            "config": {
                **{k: getattr(cfg, k) for k in ("p0", "r0", "eta_p", "eta_r", "max_tokens", "concurrency")},
                **{k: getattr(cfg, k) for k in ("periods", "grid_periods", "group_size", "seed")},
                "policies": list(cfg.policies),
                "grid": {"eta_p": list(cfg.eta_ps), "eta_r": list(cfg.eta_rs), "p0": list(cfg.grid_p0s)},
                "tp": self.tp,
            },
            "deployments": [
                {
                    "name": d.name,
                    "tp": d.cost.tp,
                    "dp": d.dp,
                    "cost_model": d.cost.label,
                    "kv_capacity_tokens_per_replica": d.cost.kv_capacity_tokens,
                    "concurrency_per_replica": cfg.replica_concurrency(d.dp),
                    "decode_curve": cost_curve(d, cfg.replica_concurrency(d.dp)),
                }
                for d in self.deps
            ],
            "policies": policies,
            "grid": cells,
            **rec,
            "runtime_s": runtime_s,
        }


def write_json(report: dict[str, Any], path: Path) -> None:
    from rollpacker.lab.bench.replay import write_report

    write_report(report, path)


def parse_list(text: str, kind: type, flag: str) -> tuple[Any, ...]:
    """``1.0,1.25`` -> (1.0, 1.25); '' -> (); a clear error naming the flag otherwise."""
    try:
        return tuple(kind(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(
            f"{flag} {text!r}: use a comma list of {kind.__name__}s, e.g. 1.0,1.25,1.5"
        ) from None


def whatif(
    hardware: str,
    model: str | None,
    tp: int | None,
    gpus: int | None,
    cfg: WhatIfConfig,
    trace: tuple[Path | None, str, str | None, str],
    progress: Callable[[str], None] = lambda _s: None,
) -> dict[str, Any]:
    """``rollpacker lab whatif``: load the trace (``(file, preset, mlflow run, tracking uri)``) and the
    deployments, simulate, and return the report."""
    from rollpacker.lab.bench.whatif.specfiles import deployments
    from rollpacker.lab.bench.whatif.traces import load

    path, preset, run_id, uri = trace
    records, source = load(path, preset, cfg.seed, run_id, uri, cfg.r0, cfg.responses_needed)
    deps = deployments(hardware, model, (tp,) if tp else (), gpus)
    meta = {"hardware": hardware, "model": model, "gpus": deps[0].cost.tp * deps[0].dp}
    return WhatIf(records, source, deps, cfg, tp=tp, meta=meta).run(progress)
