"""SortedRL's throughput experiment (arXiv:2603.23414, section 4.4.1) on the what-if simulator.

The paper's configuration: Qwen2.5-32B, PPO on DAPO-Math-17k, rollout batch 128 prompts x 1
response, group 512 (``rollout.sorted.group_size`` 4), update batch 128, max length 8k, lengths
replayed ("512 samples in 4 separate batches"). It reports 3,987 / 4,289 / 5,559 output tokens/s
(baseline / on-policy / partial: +7.57 %, +39.48 %) and a bubble ratio (eq. 4) of 74 % -> 5.81 % /
3.37 %.

Here: the trace ``sortedrl-8k`` (section 2.3's statistics: 80 % within 3k, ~5 % at the limit), one
H100 engine at TP 4 (the paper ran H100 and MI300X; at TP 4 the KV cache holds 848k tokens, ~6.5k
a request at Q = 128, so Q is not cut by preemptions), and the engine's running capacity Q = 128
(``max_num_seqs``). Q is chosen from the paper's own words: its controller feeds "more prompts than
its maximum queue capacity in most iterations": a group launches 512, 384, 256 and 128 requests,
so Q < 256 for most of them to exceed it, and the rollout batch (128) is the largest such setting a
user would run. The baseline is the synchronous rollout of the same 512 samples as 4 batches of 128
(``sync``); ``sync_512`` (one rollout batch of 512, the math experiment's baseline with 4
off-policy updates) is reported beside it. Every arm rolls out the same ``groups x 512`` prompts.

Per arm: output tokens/s over every generated token (SortedRL's figure) and trained tokens/s with
seconds per trained step (rollpacker's), each over the baseline; the bubble ratio by eq. 4 with Q;
the wasted share. A sensitivity run repeats the arms over Q and over the trace's tail
(``sigma_prompt``), the two assumptions that move the figures.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from rollpacker.core.config import PolicyName, RolloutConfig, SortedConfig, SortedMode
from rollpacker.core.config import _positive_int as positive_int
from rollpacker.core.policies.base import RolloutPolicy
from rollpacker.core.policies.sorted import SortedPolicy
from rollpacker.core.policies.sync import SyncPolicy
from rollpacker.core.prompts import PromptCursor
from rollpacker.core.trace import generate, to_prompts
from rollpacker.lab.bench.replay import (
    SORTEDRL_PAPER_BUBBLE,
    PolicyRun,
    bubble_before_drain,
    replay_sampling,
    run_policy,
)
from rollpacker.lab.bench.whatif.engine import SimEngine
from rollpacker.lab.bench.whatif.specfiles import deployments
from rollpacker.lab.bench.whatif.traces import PAPER_PRESETS

PRESET = "sortedrl-8k"
PAPER_OUTPUT_TPS = {"sync": 3987.0, "sorted": 4289.0, "sorted_partial": 5559.0}  # section 4.4.1
BUBBLE_TOLERANCE = 0.05  # the baseline bubble within 5 points of the paper's 74 %
SORTED_BUBBLE_MAX = 0.10  # the sorted arms' bubbles at most 10 %
RATIO_TOLERANCE = 0.15  # output tokens/s ratios within 15 % of the paper's
ROW_KEYS = (
    "steps",
    "output_tokens_per_s",
    "trained_tokens_per_s",
    "s_per_trained_step",
    "bubble_ratio",
    "wasted_share",
    "tokens_generated",
    "tokens_trained",
)
SENSITIVITY_Q = (16, 32, 64, 128, 256, 512)
SENSITIVITY_SIGMA = (0.8, 1.15, 1.5)


@dataclass(frozen=True)
class SortedRLCase:
    """One simulated setting: the engine's running capacity ``q`` and the trace's tail."""

    q: int = 128
    sigma_prompt: float = 1.15
    groups: int = 2  # SortedRL groups of 4 x 128 prompts each arm rolls out
    batch: int = 128  # rollout batch = update batch (prompts, one response each)
    group_size: int = 4
    max_tokens: int = 8192
    hardware: str = "h100"
    model: str = "qwen2.5-32b"
    tp: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("q", "groups", "batch", "group_size", "max_tokens", "tp"):
            positive_int(f"sortedrl.{name}", getattr(self, name))


def _rollout(case: SortedRLCase, policy: PolicyName, p0: int, mode: SortedMode) -> RolloutConfig:
    return RolloutConfig(
        policy=policy,
        prompts_per_step=p0,
        responses_per_prompt=1,
        eta_p=1.0,
        eta_r=1.0,
        max_tokens=case.max_tokens,
        sorted=SortedConfig(mode=mode, group_size=case.group_size),
    )


def run_case(case: SortedRLCase) -> dict[str, dict[str, Any]]:
    """Every arm on the same prompts, one fresh simulated engine each; each arm's row with its
    output and trained tokens/s over the baseline's (``sync``)."""
    preset = dataclasses.replace(PAPER_PRESETS[PRESET], sigma_prompt=case.sigma_prompt)
    prompts = to_prompts(generate(preset, seed=case.seed), vocab_size=259, seed=case.seed)
    prompts = prompts[: case.groups * case.group_size * case.batch]
    by_id = {p.prompt_id: p for p in prompts}
    sampling = replay_sampling(case.max_tokens, case.seed)
    group = case.group_size * case.batch

    def cursor() -> PromptCursor:
        return PromptCursor(prompts, shuffle=False, epochs=1)

    def sorted_arm(mode: SortedMode) -> RolloutPolicy:
        cfg = _rollout(case, PolicyName.SORTED, case.batch, mode)
        return SortedPolicy(cfg, cursor(), sampling, by_id, namespace=f"sorted-{mode.value}")

    arms: dict[str, tuple[RolloutPolicy, int]] = {
        "sync": (
            SyncPolicy(_rollout(case, PolicyName.SYNC, case.batch, SortedMode.ON_POLICY), cursor(), sampling),
            case.group_size,
        ),
        "sorted": (sorted_arm(SortedMode.ON_POLICY), case.group_size),
        "sorted_partial": (sorted_arm(SortedMode.PARTIAL), case.group_size),
        "sync_512": (
            SyncPolicy(_rollout(case, PolicyName.SYNC, group, SortedMode.ON_POLICY), cursor(), sampling),
            1,
        ),
    }
    rows = {
        name: _row(_run(case, pol, per_group * case.groups), case) for name, (pol, per_group) in arms.items()
    }
    base = rows["sync"]
    for r in rows.values():
        for key in ("output_tokens_per_s", "trained_tokens_per_s"):
            r[key.replace("_tokens_per_s", "_x")] = r[key] / base[key] if base[key] else None
    return rows


def _run(case: SortedRLCase, policy: RolloutPolicy, steps: int) -> tuple[PolicyRun, int]:
    dep = deployments(case.hardware, case.model, (case.tp,), case.tp)[0]
    engine = SimEngine(dep.cost, dp=dep.dp, concurrency=case.q)
    run = run_policy(engine, policy, lambda _p, done: len(done) >= steps, steps)
    return run, engine.concurrency


def _row(ran: tuple[PolicyRun, int], case: SortedRLCase) -> dict[str, Any]:
    run, q = ran
    s = run.summary(q, 0.0)  # no saturated throughput measured: efficiency is not reported here
    row = {k: s[k] for k in ROW_KEYS}
    row["bubble_ratio_before_drain"] = (
        bubble_before_drain(run, case.group_size) if "sorted" in run.policy else None
    )
    return row


def checks(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each of the paper's figures against the simulated one and its tolerance."""
    pb = SORTEDRL_PAPER_BUBBLE
    out = {
        "baseline bubble": _check(
            rows["sync"]["bubble_ratio"], pb["baseline"], "within 5 points", BUBBLE_TOLERANCE
        ),
    }
    for arm in ("sorted", "sorted_partial"):
        b = rows[arm]["bubble_ratio"]
        out[f"{arm} bubble"] = {"sim": b, "paper": pb[arm], "bar": "<= 10 %", "ok": b <= SORTED_BUBBLE_MAX}
        paper_x = PAPER_OUTPUT_TPS[arm] / PAPER_OUTPUT_TPS["sync"]
        x = rows[arm]["output_x"]
        ok = x is not None and abs(x / paper_x - 1.0) <= RATIO_TOLERANCE
        out[f"{arm} output tokens/s x"] = {"sim": x, "paper": paper_x, "bar": "within 15 %", "ok": ok}
    return out


def _check(sim: float, paper: float, bar: str, tol: float) -> dict[str, Any]:
    return {"sim": sim, "paper": paper, "bar": bar, "ok": abs(sim - paper) <= tol}


def sortedrl_report(seed: int = 0) -> dict[str, Any]:
    """The paper's configuration, its checks, and the sensitivity runs over Q and the tail."""
    main = SortedRLCase(seed=seed)
    rows = run_case(main)
    sens_q = [
        {"q": q, "rows": run_case(dataclasses.replace(main, q=q))} for q in SENSITIVITY_Q if q != main.q
    ]
    sens_tail = [
        {"sigma_prompt": s, "rows": run_case(dataclasses.replace(main, sigma_prompt=s))}
        for s in SENSITIVITY_SIGMA
        if s != main.sigma_prompt
    ]
    sens_q.append({"q": main.q, "rows": rows})
    sens_tail.append({"sigma_prompt": main.sigma_prompt, "rows": rows})
    return {
        "case": dataclasses.asdict(main),
        "trace": PRESET,
        "rows": rows,
        "checks": checks(rows),
        "paper_output_tokens_per_s": dict(PAPER_OUTPUT_TPS),
        "paper_bubble": dict(SORTEDRL_PAPER_BUBBLE),
        "sensitivity_q": sorted(sens_q, key=lambda r: r["q"]),
        "sensitivity_tail": sorted(sens_tail, key=lambda r: r["sigma_prompt"]),
    }


def render_sortedrl(report: dict[str, Any]) -> list[str]:
    """The arms, the checks and the sensitivity runs as Markdown tables."""
    c = report["case"]
    lines = [
        f"SortedRL 4.4.1 (SIMULATED): {c['model']} TP {c['tp']} on {c['hardware']}, Q = {c['q']}, "
        f"rollout batch {c['batch']} x 1, group {c['group_size'] * c['batch']}, update {c['batch']}, "
        f"max {c['max_tokens']}, trace {report['trace']}, {c['groups']} groups",
        "",
        "| arm | out tok/s (all) | out x | trained tok/s | trained x | s/trained step | bubble (Q) "
        "| bubble before the drain | wasted |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in report["rows"].items():
        cells = (
            f"{r['output_tokens_per_s']:.0f}",
            f"{r['output_x']:.2f}",
            f"{r['trained_tokens_per_s']:.0f}",
            f"{r['trained_x']:.2f}",
            f"{r['s_per_trained_step']:.1f}",
            f"{r['bubble_ratio']:.1%}",
            _pct(r["bubble_ratio_before_drain"]),
            f"{r['wasted_share']:.1%}",
        )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "| paper figure | simulated | paper | bar | met |", "|---|---|---|---|---|"]
    for name, k in report["checks"].items():
        fmt = "{:.1%}" if "bubble" in name else "{:.2f}"
        sim = "-" if k["sim"] is None else fmt.format(k["sim"])
        met = "yes" if k["ok"] else "no"
        lines.append(f"| {name} | {sim} | {fmt.format(k['paper'])} | {k['bar']} | {met} |")
    lines += _sensitivity_lines(report["sensitivity_q"], "q", "Q")
    lines += _sensitivity_lines(report["sensitivity_tail"], "sigma_prompt", "tail sigma_prompt")
    return lines


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _sensitivity_lines(runs: list[dict[str, Any]], key: str, label: str) -> list[str]:
    lines = [
        "",
        f"| {label} | bubble sync / sorted / partial / sync_512 | sorted / partial before the drain "
        "| out x sorted / partial | trained x sorted / partial |",
        "|---|---|---|---|---|",
    ]
    for run in runs:
        r = run["rows"]
        arms = ("sync", "sorted", "sorted_partial", "sync_512")
        cells = (
            " / ".join(f"{r[a]['bubble_ratio']:.1%}" for a in arms),
            " / ".join(_pct(r[a]["bubble_ratio_before_drain"]) for a in arms[1:3]),
            " / ".join(f"{r[a]['output_x']:.2f}" for a in arms[1:3]),
            " / ".join(f"{r[a]['trained_x']:.2f}" for a in arms[1:3]),
        )
        lines.append(f"| {run[key]} | " + " | ".join(cells) + " |")
    return lines
