"""The learning benchmark: does tail batching learn as well as the synchronous baseline?

Runs the same experiment config for each (policy, seed) arm, one after another on this machine,
each arm training the same number of samples (steps x P0 x R0), and reports validation accuracy
before RL (the warm-up's) and after, reward curves, wall-clock time per policy, and whether every
prompt drawn under tail batching was trained exactly once (checked from the arm's groups log).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from rollpacker.core.config import ExperimentConfig, PolicyName


def exactly_once(groups_log: Path, leftover_queue: list[str]) -> dict[str, Any]:
    """From a run's groups log: each prompt trained at most once, and every deferred prompt either
    trained later (in a long round) or still waiting in the queue when the run ended."""
    trained: Counter[str] = Counter()
    deferred: set[str] = set()
    for line in groups_log.read_text().splitlines():
        rec = json.loads(line)
        trained.update(rec["trained"])
        deferred.update(rec["deferred"])
    twice = sorted(p for p, n in trained.items() if n > 1)
    lost = sorted(deferred - set(trained) - set(leftover_queue))
    return {
        "prompts_trained": len(trained),
        "trained_twice": twice,
        "deferred_lost": lost,
        "deferred_total": len(deferred),
        "left_in_queue": len(leftover_queue),
        "ok": not twice and not lost,
    }


def run_learning(
    cfg: ExperimentConfig, policies: list[str], seeds: list[int], progress: bool = True
) -> dict[str, Any]:
    from rollpacker.loop.runner import RLRun

    arms = []
    for policy in policies:
        for seed in seeds:
            arm_cfg = dataclasses.replace(
                cfg,
                seed=seed,
                run_name=f"{policy}-seed{seed}",
                rollout=dataclasses.replace(cfg.rollout, policy=PolicyName(policy)),
            )
            run = RLRun(arm_cfg, quiet=not progress)
            try:
                s = run.run(progress=progress)
            finally:
                run.close()
            arms.append(
                {
                    "policy": policy,
                    "seed": seed,
                    "run_id": s.run_id,
                    "trained_samples": s.trained_samples,
                    "val_accuracy_start": s.val_accuracy_start,
                    "val_accuracy_end": s.val_accuracy_end,
                    "wall_s": s.wall_s,
                    "rollout_s": sum(r.metrics["rollout/time_s"] for r in s.records),
                    "step_s_mean": statistics.fmean(r.metrics["step/time_s"] for r in s.records),
                    "reward_curve": [r.metrics["reward/mean"] for r in s.records],
                    "round_kinds": [r.round_kind for r in s.records],
                    "exactly_once": exactly_once(Path(s.run_dir) / "groups.jsonl", s.leftover_queue),
                }
            )
    per_policy = {}
    for policy in policies:
        a = [x for x in arms if x["policy"] == policy]
        per_policy[policy] = {
            "val_accuracy_end_mean": statistics.fmean(x["val_accuracy_end"] for x in a),
            "val_accuracy_start_mean": statistics.fmean(x["val_accuracy_start"] for x in a),
            "wall_s_mean": statistics.fmean(x["wall_s"] for x in a),
            "rollout_s_mean": statistics.fmean(x["rollout_s"] for x in a),
            "trained_samples": a[0]["trained_samples"],
        }
    report: dict[str, Any] = {"arms": arms, "per_policy": per_policy, "config": _jsonable(cfg)}
    if {"sync", "tail_batching"} <= set(per_policy):
        report["tail_minus_sync_points"] = 100 * (
            per_policy["tail_batching"]["val_accuracy_end_mean"] - per_policy["sync"]["val_accuracy_end_mean"]
        )
    return report


def render(report: dict[str, Any]) -> str:
    lines = [
        f"{'policy':<14} {'seed':>4} {'val start':>9} {'val end':>8} {'wall s':>7} {'rollout s':>9} once"
    ]
    for a in report["arms"]:
        lines.append(
            f"{a['policy']:<14} {a['seed']:>4} {a['val_accuracy_start']:>9.3f} {a['val_accuracy_end']:>8.3f} "
            f"{a['wall_s']:>7.1f} {a['rollout_s']:>9.1f} {a['exactly_once']['ok']}"
        )
    for p, s in report["per_policy"].items():
        lines.append(
            f"{p:<14} mean val {s['val_accuracy_start_mean']:.3f} -> {s['val_accuracy_end_mean']:.3f}, "
            f"{s['trained_samples']} samples, {s['wall_s_mean']:.0f} s/run"
        )
    if "tail_minus_sync_points" in report:
        lines.append(f"tail_batching - sync: {report['tail_minus_sync_points']:+.1f} points")
    return "\n".join(lines)


def plot(report: dict[str, Any], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    colors = {"sync": "tab:blue", "tail_batching": "tab:orange"}
    for a in report["arms"]:
        ax.plot(
            a["reward_curve"],
            color=colors.get(a["policy"], "gray"),
            alpha=0.7,
            label=f"{a['policy']} seed {a['seed']}",
        )
    ax.set_xlabel("RL step")
    ax.set_ylabel("mean reward (train groups)")
    ax.set_title("reward per step: sync vs tail batching")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {k: _jsonable(v) for k, v in dataclasses.asdict(obj).items()}
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    return obj.value if hasattr(obj, "value") else obj
