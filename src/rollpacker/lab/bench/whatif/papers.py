"""``rollpacker lab bench whatif-papers``: the simulator on paper-like workloads, beside the papers' tables.

RollPacker ("RollPacker: Mitigating Long-Tail Rollouts for Fast, Synchronous RL Post-Training",
arXiv:2509.21009; at NSDI'26 "RollPacker: Taming Long-Tail Rollouts for RL Post-Training with Tail
Batching"), section 6, table 2 and section 6.3: Qwen2.5-7B/8k, 14B/16k and 32B/32k on
H800s, GRPO with P0 = 128 prompts x R0 = 8 responses, eta_p = eta_r = 1.25. It reports tail
batching alone at 1.30x / 1.48x / 2.21x *end to end* over veRL (table 2), rollout up to 3.9x on
average (section 6.3) and up to 7.8x in short rounds (figure 11b). The simulator gives rollout
seconds; an end-to-end figure needs the rest of the step: with rollout a share ``rho`` of the
synchronous step (table 1: 66-72 % for the 14B/16k model), ``e2e = 1 / ((1 - rho) + rho / s)``
for a rollout speedup ``s``, the other stages unchanged (tail batching alone does not overlap them).

SortedRL ("SortedRL: Accelerating RL Training for LLMs through Online Length-Aware Scheduling",
arXiv:2603.23414), section 4.4.1: its configuration, checks and sensitivity runs are in
``bench.whatif.sortedrl``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollpacker.core.errors import ConfigError
from rollpacker.lab.bench.whatif.run import WhatIfConfig, simulate
from rollpacker.lab.bench.whatif.sortedrl import render_sortedrl, sortedrl_report
from rollpacker.lab.bench.whatif.specfiles import deployments
from rollpacker.lab.bench.whatif.traces import load

ROLLOUT_SHARE = 0.72  # RollPacker table 1, math task (14B/16k on veRL): rollout 72 % of the step
PAPER_ROLLOUT_AVG_MAX = 3.9  # RollPacker section 6.3: "accelerates the average rollout speed by up to 3.9x"
PAPER_SHORT_ROUND_MAX = 7.8  # RollPacker section 6.2, figure 11b: short-round rollout time, up to 7.8x


@dataclass(frozen=True)
class PaperCase:
    model: str
    preset: str
    max_tokens: int
    tp: int
    paper_e2e: float  # RollPacker table 2, "+ Tail Batching" over veRL


CASES = (
    PaperCase("qwen2.5-7b", "paper-8k", 8192, 1, 1.30),
    PaperCase("qwen2.5-14b", "paper-16k", 16384, 2, 1.48),
    PaperCase("qwen2.5-32b", "paper-32k", 32768, 4, 2.21),
    PaperCase("qwen2.5-32b", "paper-32k-heavy", 32768, 4, 2.21),
)
HARDWARE = "h800"
GPUS = 8  # one H800 node for the rollout of each model (TP x DP = 8)


def implied_e2e(rollout_speedup: float, rho: float = ROLLOUT_SHARE) -> float:
    """End-to-end speedup when only the rollout (a share ``rho`` of the step) gets faster."""
    return 1.0 / ((1.0 - rho) + rho / rollout_speedup)


def rollpacker_case(case: PaperCase, seed: int = 0) -> dict[str, Any]:
    cfg = WhatIfConfig(
        p0=128,
        r0=8,
        max_tokens=case.max_tokens,
        periods=1,
        eta_ps=(1.25,),
        eta_rs=(1.25,),
        seed=seed,
        policies=("sync", "tail_batching"),
    )
    records, source = load(None, case.preset, seed)
    dep = deployments(HARDWARE, case.model, (case.tp,), GPUS)[0]
    rows = simulate(records, dep, cfg.rollout(), cfg, cfg.policies, cfg.periods, source)
    sync, tb = rows["sync"], rows["tail_batching"]
    s = tb["speedup"] or 0.0
    short = sync["rollout_s_per_step"] / tb["short_round_s"] if tb["short_round_s"] else None
    return {
        "case": f"{case.model}/{case.max_tokens // 1024}k"
        + ("" if case.preset.count("-") == 1 else " (heavy tail)"),
        "deployment": f"{dep.name} on {HARDWARE}",
        "trace": source,
        "sync_s_per_step": sync["rollout_s_per_step"],
        "tb_s_per_step": tb["rollout_s_per_step"],
        "sim_rollout_speedup": s,
        "sim_short_round_speedup": short,
        "sim_implied_e2e": implied_e2e(s) if s > 0 else None,
        "paper_e2e": case.paper_e2e,
        "sync_max_len": sync["max_len_mean"],
        "tb_short_max_len": tb["max_len_mean"],
        "wasted_share": tb["wasted_share"],
        "preemptions": {"sync": sync["preemptions"], "tail_batching": tb["preemptions"]},
        "rounds": {"short": tb["short_rounds"], "long": tb["long_rounds"]},
    }


PARTS = ("rollpacker", "sortedrl")


def run_papers(
    progress: Callable[[str], None] = lambda _s: None, seed: int = 0, only: tuple[str, ...] = PARTS
) -> dict[str, Any]:
    """The RollPacker cases and SortedRL's experiment (``only`` picks one of ``PARTS``)."""
    unknown = sorted(set(only) - set(PARTS))
    if unknown:
        raise ConfigError(f"whatif-papers: unknown part(s) {unknown}; use {', '.join(PARTS)}")
    t0 = time.perf_counter()
    rows = []
    for case in CASES if "rollpacker" in only else ():
        t = time.perf_counter()
        rows.append(rollpacker_case(case, seed))
        progress(f"{case.model}/{case.max_tokens // 1024}k simulated in {time.perf_counter() - t:.0f} s")
    sorted_rep = sortedrl_report(seed) if "sortedrl" in only else None
    if sorted_rep is not None:
        progress("SortedRL's experiment and its sensitivity runs simulated")
    return {
        "simulated": True,
        "hardware": HARDWARE,
        "rollout_share": ROLLOUT_SHARE,
        "paper_rollout_avg_max": PAPER_ROLLOUT_AVG_MAX,
        "paper_short_round_max": PAPER_SHORT_ROUND_MAX,
        "rollpacker": rows,
        "sortedrl": sorted_rep,
        "seconds": time.perf_counter() - t0,
    }


def render_papers(report: dict[str, Any]) -> str:
    """The comparison as a Markdown table (printed, and pasted into docs/whatif.md)."""
    lines = (
        []
        if not report["rollpacker"]
        else [
            "| case | deployment | sim rollout x (mean) | sim short-round x "
            "| sim end-to-end x (rollout 72 %) | paper end-to-end x (TB alone) | paper rollout x |",
            "|---|---|---|---|---|---|---|",
        ]
    )
    for r in report["rollpacker"]:
        short = "-" if r["sim_short_round_speedup"] is None else f"{r['sim_short_round_speedup']:.2f}"
        lines.append(
            f"| {r['case']} | {r['deployment']} | {r['sim_rollout_speedup']:.2f} | {short} | "
            f"{r['sim_implied_e2e']:.2f} | {r['paper_e2e']:.2f} | up to {report['paper_rollout_avg_max']} "
            f"(avg), {report['paper_short_round_max']} (short rounds) |"
        )
    if report["sortedrl"] is not None:
        lines += ["", *render_sortedrl(report["sortedrl"])]
    lines += ["", f"simulated in {report['seconds']:.0f} s"]
    return "\n".join(lines)
