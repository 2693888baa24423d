"""The learning benchmark: does each answer to the long tail learn as well as the synchronous baseline?

Runs the same experiment config for each (arm, seed), one after another on this machine, through
the one RL step path (``experiment.train_arm``: the stages, services in this process). Each arm
trains the same number of samples (steps x P0 x R0). Reports validation accuracy before RL (step 0)
and at the end, reward curves, seconds per step and in rollout, and the exactly-once check per arm
(no prompt trained twice, every deferred prompt trained later or still waiting).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from rollpacker.bench.tables import legend, wrap
from rollpacker.core.errors import ConfigError
from rollpacker.experiment import TrainSummary, train_arm, train_config

# arm -> the config keys it sets (every other key comes from the shared config)
ARMS: dict[str, dict[str, Any]] = {
    "sync": {"rollout.policy": "sync"},
    "tail_batching": {"rollout.policy": "tail_batching"},
    "sorted": {"rollout.policy": "sorted", "rollout.sorted.mode": "on_policy"},
    "sorted_partial": {"rollout.policy": "sorted", "rollout.sorted.mode": "partial"},
    "partial": {"rollout.policy": "partial"},
    "one_off": {"rollout.policy": "tail_batching", "rollout.one_off": True},
}
COLORS = {
    "sync": "tab:blue",
    "tail_batching": "tab:orange",
    "sorted": "tab:green",
    "sorted_partial": "tab:olive",
    "partial": "tab:red",
    "one_off": "tab:purple",
}


def learning_arms(text: str) -> list[str]:
    """The comma-separated arm names, checked against ``ARMS``."""
    names = [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in names if a not in ARMS]
    if unknown or not names:
        raise ConfigError(f"--arms {text!r}: unknown arm(s) {unknown}; known: {', '.join(ARMS)}")
    return names


def run_learning(
    config: Path, overrides: dict[str, Any], arms: list[str], seeds: list[int], progress: bool = True
) -> dict[str, Any]:
    """Every (arm, seed) from a fresh start; the report (JSON-able)."""
    runs = []
    for arm in arms:
        for seed in seeds:
            text, _ = train_config(
                config, {**overrides, **ARMS[arm], "seed": seed}, run_name=f"{arm}-seed{seed}"
            )
            runs.append(_arm_record(arm, seed, train_arm(text, fresh=True, progress=progress)))
    per_arm = {arm: _aggregate([r for r in runs if r["arm"] == arm]) for arm in arms}
    report: dict[str, Any] = {"runs": runs, "per_arm": per_arm, "seeds": seeds}
    if "sync" in per_arm:
        base = per_arm["sync"]["val_accuracy_end_mean"]
        report["minus_sync_points"] = {
            a: 100 * (p["val_accuracy_end_mean"] - base) for a, p in per_arm.items()
        }
    return report


def _arm_record(arm: str, seed: int, s: TrainSummary) -> dict[str, Any]:
    once = s.exactly_once
    return {
        "arm": arm,
        "seed": seed,
        "run_id": s.run_id,
        "steps": s.steps,
        "trained_samples": s.trained_samples,
        "val_accuracy_start": s.val_accuracy[0][1] if s.val_accuracy else float("nan"),
        "val_accuracy_end": s.val_accuracy[-1][1] if s.val_accuracy else float("nan"),
        "val_curve": [list(x) for x in s.val_accuracy],
        "wall_s": s.wall_s,
        "rollout_s": sum(m.get("rollout/time_s", 0.0) for m in s.step_metrics),
        "step_s_mean": statistics.fmean(m.get("step/time_s", 0.0) for m in s.step_metrics),
        "reward_curve": [m.get("reward/mean", float("nan")) for m in s.step_metrics],
        "exactly_once": {
            "ok": once.ok,
            "prompts_trained": once.prompts_trained,
            "trained_twice": list(once.trained_twice),
            "deferred_total": once.deferred_total,
            "deferred_lost": list(once.deferred_lost),
            "waiting": once.waiting,
        },
    }


def _aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    end = [r["val_accuracy_end"] for r in runs]
    return {
        "val_accuracy_start_mean": statistics.fmean(r["val_accuracy_start"] for r in runs),
        "val_accuracy_end_mean": statistics.fmean(end),
        "val_accuracy_end_sd": statistics.stdev(end) if len(end) > 1 else 0.0,
        "wall_s_mean": statistics.fmean(r["wall_s"] for r in runs),
        "rollout_s_mean": statistics.fmean(r["rollout_s"] for r in runs),
        "trained_samples": runs[0]["trained_samples"],
        "exactly_once_ok": all(r["exactly_once"]["ok"] for r in runs),
    }


_LEGEND = (
    ("val start", "held-out validation accuracy before RL (step 0)"),
    ("val end", "held-out validation accuracy after the last step"),
    ("wall s", "the run's wall-clock seconds"),
    ("rollout s", "the run's seconds in rollout"),
    ("once", "every prompt trained exactly once (yes / NO), prompts trained and still waiting"),
)


def render(report: dict[str, Any]) -> str:
    """One row per (arm, seed), then each arm's means over its seeds; a legend."""
    head = (
        f"{'arm':<15}  {'seed':>4}  {'val start':>9}  {'val end':>7}  {'wall s':>7}  {'rollout s':>9}  once"
    )
    lines = [head, "-" * len(head)]
    for r in report["runs"]:
        once = r["exactly_once"]
        lines.append(
            f"{r['arm']:<15}  {r['seed']:>4}  {r['val_accuracy_start']:>9.3f}  "
            f"{r['val_accuracy_end']:>7.3f}  {r['wall_s']:>7.1f}  {r['rollout_s']:>9.1f}  "
            f"{'yes' if once['ok'] else 'NO'} "
            f"({once['prompts_trained']} prompts, {once['waiting']} waiting)"
        )
    lines.append("")
    for arm, p in report["per_arm"].items():
        vs = report.get("minus_sync_points", {}).get(arm)
        lines += wrap(
            f"{arm:<15} val {p['val_accuracy_start_mean']:.3f} -> {p['val_accuracy_end_mean']:.3f} "
            f"(sd {p['val_accuracy_end_sd']:.3f}), {p['trained_samples']} samples, "
            f"{p['wall_s_mean']:.0f} s/run" + (f", {vs:+.1f} points vs sync" if vs is not None else "")
        )
    return "\n".join(lines + legend(_LEGEND))


def plot(report: dict[str, Any], out: Path) -> list[Path]:
    """Reward per step and validation accuracy per step, one line per (arm, seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_v) = plt.subplots(1, 2, figsize=(12, 4.5))
    seen: set[str] = set()
    for r in report["runs"]:
        color = COLORS.get(r["arm"], "gray")
        label = r["arm"] if r["arm"] not in seen else None
        seen.add(r["arm"])
        ax_r.plot(
            range(1, len(r["reward_curve"]) + 1), r["reward_curve"], color=color, alpha=0.6, label=label
        )
        steps, acc = zip(*r["val_curve"], strict=True) if r["val_curve"] else ((), ())
        ax_v.plot(steps, acc, marker="o", color=color, alpha=0.6, label=label)
    ax_r.set(xlabel="RL step", ylabel="mean reward (trained groups)", title="reward per step")
    ax_v.set(xlabel="RL step", ylabel="held-out accuracy", title="validation accuracy")
    ax_r.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return [out]
