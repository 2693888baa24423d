"""The learning benchmark: does RL learn, and does each answer to the long tail learn as well as
the synchronous baseline?

Runs the same experiment config for each (arm, seed), one after another on this machine, through
the one RL step path (``experiment.train_arm``: the stages, services in this process). Each arm
trains the same number of samples (steps x P0 x R0). An arm is a rollout policy (``sync``,
``tail_batching``, ...), an algorithm under tail batching (``dapo``, ``reinforce_pp``, ``gspo``;
GRPO is ``tail_batching`` itself; ``tis`` and ``mis``: GRPO with the token-level rollout correction,
truncated at 2 or masked outside [0.5, 2], for runs with a lower-precision engine,
``--set engine.dtype=bfloat16``: docs/training.md) or the no-RL ``control`` (sync rollouts,
every advantage 0: what sampling noise alone does to the held-out score). Reports validation
accuracy before RL (step 0) and at the end, the gain in points, reward curves, the engine/trainer
mismatch and the share of tokens corrected per step, seconds per step and in rollout, and the
exactly-once check per arm (no prompt trained twice, every deferred prompt trained later or still
waiting); ``plot`` draws each arm's mean over seeds with a min-max band, ``log_to_mlflow`` logs
the plot, the report and the mean curves to one ``bench-learning`` run of the experiment.

The ``dapo`` arm is DAPO whole: clip-higher and the token-level loss (the defaults), overlong
shaping and filtering, and dynamic sampling (``rollout.dynamic_sampling.enabled``): each complete
group's rewards go back to the round, a group whose rewards are all equal is dropped (neither
trained nor queued) and a replacement prompt is drawn, so every update holds ``P0`` groups with
signal; the arm's steps log ``rollout/extra_prompts`` and ``rollout/dropped_groups``
(docs/training.md).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from rollpacker.core.errors import ConfigError
from rollpacker.experiment import SUMMARY_KEYS, TrainSummary, train_arm, train_config
from rollpacker.lab.bench.tables import legend, wrap

# arm -> the config keys it sets (every other key comes from the shared config)
ARMS: dict[str, dict[str, Any]] = {
    "sync": {"rollout.policy": "sync"},
    "tail_batching": {"rollout.policy": "tail_batching"},
    "sorted": {"rollout.policy": "sorted", "rollout.sorted.mode": "on_policy"},
    "sorted_partial": {"rollout.policy": "sorted", "rollout.sorted.mode": "partial"},
    "partial": {"rollout.policy": "partial"},
    "one_off": {"rollout.policy": "tail_batching", "rollout.one_off": True},
    "control": {"rollout.policy": "sync", "train.advantage": "zero"},
    "dapo": {
        "rollout.policy": "tail_batching",
        "train.overlong_buffer": 128,
        "train.overlong_filter": True,
        "rollout.dynamic_sampling.enabled": True,
        "train.clip_eps_high": 0.28,
        "train.loss_norm": "token_mean",
    },
    "reinforce_pp": {
        "rollout.policy": "tail_batching",
        "train.advantage": "reinforce_pp",
        "train.reward_kl_coef": 0.01,
    },
    "gspo": {
        "rollout.policy": "tail_batching",
        "train.objective": "gspo",
        "train.clip_eps_low": 0.0003,
        "train.clip_eps_high": 0.0004,
        "train.loss_norm": "seq_mean",
    },
    "tis": {
        "rollout.policy": "tail_batching",
        "train.correction.level": "token",
        "train.correction.mode": "truncate",
        "train.correction.upper": 2.0,
    },
    "mis": {
        "rollout.policy": "tail_batching",
        "train.correction.level": "token",
        "train.correction.mode": "mask",
        "train.correction.lower": 0.5,
        "train.correction.upper": 2.0,
    },
}
COLORS = {
    "sync": "tab:blue",
    "tail_batching": "tab:orange",
    "sorted": "tab:green",
    "sorted_partial": "tab:olive",
    "partial": "tab:red",
    "one_off": "tab:purple",
    "control": "black",
    "dapo": "tab:cyan",
    "reinforce_pp": "tab:brown",
    "gspo": "tab:pink",
    "tis": "tab:gray",
    "mis": "gold",
}


def learning_arms(text: str) -> list[str]:
    """The comma-separated arm names, checked against ``ARMS``."""
    names = [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in names if a not in ARMS]
    if unknown or not names:
        raise ConfigError(f"--arms {text!r}: unknown arm(s) {unknown}; known: {', '.join(ARMS)}")
    return names


def check_learning(config: Path, overrides: dict[str, Any], arms: list[str], seeds: list[int]) -> None:
    """Every (arm, seed)'s training config checked (the config, the model, this machine) before any
    trains or anything is made: a refusal of the last one costs no training of the first."""
    for arm in arms:
        for seed in seeds:
            train_config(config, _overrides(overrides, arm, seed), f"{arm}-seed{seed}", make_store=False)


def _overrides(overrides: dict[str, Any], arm: str, seed: int) -> dict[str, Any]:
    return {**overrides, **ARMS[arm], "seed": seed}


def run_learning(
    config: Path, overrides: dict[str, Any], arms: list[str], seeds: list[int], progress: bool = True
) -> dict[str, Any]:
    """Every (arm, seed) from a fresh start (each checked first: ``check_learning``); the report
    (JSON-able)."""
    check_learning(config, overrides, arms, seeds)
    runs = []
    for arm in arms:
        for seed in seeds:
            text, _ = train_config(config, _overrides(overrides, arm, seed), run_name=f"{arm}-seed{seed}")
            runs.append(_arm_record(arm, seed, train_arm(text, fresh=True, progress=progress)))
    per_arm = {arm: _aggregate([r for r in runs if r["arm"] == arm]) for arm in arms}
    report: dict[str, Any] = {"runs": runs, "per_arm": per_arm, "seeds": seeds}
    if "sync" in per_arm:
        base = per_arm["sync"]["val_accuracy_end_mean"]
        report["minus_sync_points"] = {
            a: 100 * (p["val_accuracy_end_mean"] - base) for a, p in per_arm.items()
        }
    report["criteria"] = criteria(per_arm)
    return report


def criteria(per_arm: dict[str, Any]) -> dict[str, bool]:
    """The bar a learning comparison should clear, for the arms that ran: GRPO under sync and
    under tail batching each gain >= 15 points of held-out accuracy over the warm-up (mean of the
    seeds), the no-RL control < 3, and tail batching ends within 2 points of sync."""
    out: dict[str, bool] = {}
    for arm in ("sync", "tail_batching"):
        if arm in per_arm:
            out[f"{arm}_gains_15_points"] = per_arm[arm]["gain_points_mean"] >= 15
    if "control" in per_arm:
        out["control_gains_under_3_points"] = per_arm["control"]["gain_points_mean"] < 3
    if "sync" in per_arm and "tail_batching" in per_arm:
        gap = per_arm["tail_batching"]["val_accuracy_end_mean"] - per_arm["sync"]["val_accuracy_end_mean"]
        out["tail_batching_within_2_points_of_sync"] = 100 * gap >= -2
    return out


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
        "rollout_s": sum(_curve(s, "rollout/time_s", 0.0)),
        "step_s_mean": statistics.fmean(_curve(s, "step/time_s", 0.0)),
        "reward_curve": _curve(s, "reward/mean", float("nan")),
        # the off-policy degree of the trained tokens, step means over the run (0 when on-policy)
        "policy_lag_mean": _step_mean(s, "train/policy_lag"),
        "off_policy_frac_mean": _step_mean(s, "train/off_policy_frac"),
        # the engine/trainer mismatch per step, and the share of tokens the correction changed
        "mismatch_curve": _curve(s, "mismatch/abs_logp_mean", float("nan")),
        "corrected_frac_curve": [
            a + b
            for a, b in zip(
                _curve(s, "correction/truncated_frac", 0.0),
                _curve(s, "correction/masked_frac", 0.0),
                strict=True,
            )
        ],
        "exactly_once": {
            "ok": once.ok,
            "prompts_trained": once.prompts_trained,
            "trained_twice": list(once.trained_twice),
            "deferred_total": once.deferred_total,
            "deferred_lost": list(once.deferred_lost),
            "waiting": once.waiting,
        },
    }


def _curve(s: TrainSummary, key: str, missing: float) -> list[float]:
    """The metric ``key`` at each step of the run (``missing`` where a step did not log it). Only a
    key the summary reads back (``SUMMARY_KEYS``) is there at all: any other would read as missing
    at every step, a curve of NaN or a mean of 0 that looks measured, so it is refused."""
    if key not in SUMMARY_KEYS:
        raise KeyError(f"{key!r} is not read back into a run's summary: add it to experiment.SUMMARY_KEYS")
    return [m.get(key, missing) for m in s.step_metrics]


def _step_mean(s: TrainSummary, key: str) -> float:
    return statistics.fmean(_curve(s, key, 0.0)) if s.step_metrics else 0.0


def _aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    end = [r["val_accuracy_end"] for r in runs]
    gain = [100 * (r["val_accuracy_end"] - r["val_accuracy_start"]) for r in runs]
    return {
        "gain_points_mean": statistics.fmean(gain),
        "gain_points_sd": statistics.stdev(gain) if len(gain) > 1 else 0.0,
        "val_accuracy_start_mean": statistics.fmean(r["val_accuracy_start"] for r in runs),
        "val_accuracy_end_mean": statistics.fmean(end),
        "val_accuracy_end_sd": statistics.stdev(end) if len(end) > 1 else 0.0,
        "wall_s_mean": statistics.fmean(r["wall_s"] for r in runs),
        "rollout_s_mean": statistics.fmean(r["rollout_s"] for r in runs),
        "trained_samples": runs[0]["trained_samples"],
        "policy_lag_mean": statistics.fmean(r.get("policy_lag_mean", 0.0) for r in runs),
        "off_policy_frac_mean": statistics.fmean(r.get("off_policy_frac_mean", 0.0) for r in runs),
        "exactly_once_ok": all(r["exactly_once"]["ok"] for r in runs),
        "mismatch_mean": statistics.fmean(x for r in runs for x in r.get("mismatch_curve", []))
        if any(r.get("mismatch_curve") for r in runs)
        else float("nan"),
        "corrected_frac_mean": statistics.fmean(x for r in runs for x in r.get("corrected_frac_curve", []))
        if any(r.get("corrected_frac_curve") for r in runs)
        else float("nan"),
    }


_LEGEND = (
    ("val start", "held-out validation accuracy before RL (step 0)"),
    ("val end", "held-out validation accuracy after the last step"),
    ("wall s", "the run's wall-clock seconds"),
    ("rollout s", "the run's seconds in rollout"),
    ("once", "every prompt trained exactly once (yes / NO), prompts trained and still waiting"),
    ("lag", "policy lag of the trained tokens (updates behind the trained weights), mean over steps"),
    ("off-policy", "the share of trained tokens sampled by an older policy, mean over steps"),
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
            f"(sd {p['val_accuracy_end_sd']:.3f}, {p['gain_points_mean']:+.1f} points), "
            f"{p['trained_samples']} samples, lag {p['policy_lag_mean']:.2f}, "
            f"off-policy {p['off_policy_frac_mean']:.0%}, "
            f"{p['wall_s_mean']:.0f} s/run" + (f", {vs:+.1f} points vs sync" if vs is not None else "")
        )
    for name, ok in report.get("criteria", {}).items():
        lines.append(f"{'pass' if ok else 'FAIL'}  {name}")
    return "\n".join(lines + legend(_LEGEND))


def _band(curves: list[list[tuple[int, float]]]) -> tuple[list[int], list[float], list[float], list[float]]:
    """Steps every curve has, and the mean, min and max over the curves at each."""
    common = sorted(set.intersection(*(set(x for x, _ in c) for c in curves))) if curves else []
    at = [dict(c) for c in curves]
    ys = [[a[x] for a in at] for x in common]
    return common, [statistics.fmean(y) for y in ys], [min(y) for y in ys], [max(y) for y in ys]


def _measured(curve: list[float]) -> bool:
    return any(x == x for x in curve)  # a value that is not NaN


def plot(report: dict[str, Any], out: Path) -> list[Path]:
    """Reward per step and held-out accuracy per step: each arm's mean over seeds, min-max band;
    and the engine/trainer mismatch per step (``mismatch/abs_logp_mean``, log scale) when the runs
    measured it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mismatch = any(_measured(r.get("mismatch_curve", [])) for r in report["runs"])
    fig, axes = plt.subplots(1, 3 if mismatch else 2, figsize=(18 if mismatch else 12, 4.5))
    ax_r, ax_v = axes[0], axes[1]
    for arm in dict.fromkeys(r["arm"] for r in report["runs"]):
        runs = [r for r in report["runs"] if r["arm"] == arm]
        color = COLORS.get(arm, "gray")
        label = f"{arm} ({len(runs)} seed{'s' if len(runs) > 1 else ''})"
        rewards = [list(enumerate(r["reward_curve"], start=1)) for r in runs]
        vals = [[(int(x), float(y)) for x, y in r["val_curve"]] for r in runs]
        panels = [(ax_r, rewards, None), (ax_v, vals, "o")]
        if mismatch:
            gaps = [list(enumerate(r.get("mismatch_curve", []), start=1)) for r in runs]
            panels.append((axes[2], [g for g in gaps if _measured([y for _, y in g])], None))
        for ax, curves, marker in panels:
            xs, mean, lo, hi = _band(curves)
            if xs:
                ax.plot(xs, mean, color=color, marker=marker, label=label)
                ax.fill_between(xs, lo, hi, color=color, alpha=0.2)
    ax_r.set(xlabel="RL step", ylabel="mean reward (trained groups)", title="reward per step")
    ax_v.set(
        xlabel="RL step", ylabel="held-out accuracy", title="held-out accuracy (band: min-max over seeds)"
    )
    if mismatch:
        axes[2].set(
            xlabel="RL step",
            ylabel="mean |logp_trainer - logp_rollout| (nats)",
            title="engine/trainer mismatch of the trained tokens",
            yscale="log",
        )
    ax_r.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return [out]


def log_to_mlflow(report: dict[str, Any], files: list[Path], tracking_uri: str, experiment: str) -> str:
    """One ``bench-learning`` run in ``experiment``: the plots and the report as artifacts, each
    arm's mean reward and held-out accuracy per step as metrics (``learning/<arm>/...``)."""
    from rollpacker.tracking import TAG_KIND, ExperimentTracker

    tracker = ExperimentTracker(tracking_uri, experiment)
    client = tracker.client
    run_id = str(
        client.create_run(
            tracker.experiment_id, run_name="bench-learning", tags={TAG_KIND: "bench"}
        ).info.run_id
    )
    for arm in dict.fromkeys(r["arm"] for r in report["runs"]):
        runs = [r for r in report["runs"] if r["arm"] == arm]
        for key, curves in (
            ("reward_mean", [list(enumerate(r["reward_curve"], start=1)) for r in runs]),
            ("val_accuracy", [[(int(x), float(y)) for x, y in r["val_curve"]] for r in runs]),
        ):
            xs, mean, _, _ = _band(curves)
            for x, y in zip(xs, mean, strict=True):
                if y == y:  # NaN (a step without a reward) is not logged
                    client.log_metric(run_id, f"learning/{arm}/{key}", y, step=x)
    for f in files:
        client.log_artifact(run_id, str(f), "plots" if f.suffix == ".png" else "")
    client.set_terminated(run_id, "FINISHED")
    return run_id
