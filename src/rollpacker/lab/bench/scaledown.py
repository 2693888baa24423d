"""The scale-down benchmark: RollPacker's Algorithm 1 at runtime against the same arm without it.

Runs the tail-batching arm twice through the one RL step path (``experiment.train_arm``: the
stages, services in this process), on engines in a layout of ``planner.devices`` = 2 replicas of
TP 1 (one CPU core each here), for ``steps`` steps from a fresh start with the same seed: once with
``rollout.scale_down.enabled: false`` and once with ``true``. With it on, once 20-50 % of a
round's requests completed and the rest fit on one replica, the other replica's requests migrate,
it is parked, and its core goes to the stream trainer's gradient worker until the step's update.

Reported per arm and step, from the arms' MLflow runs: ``step/time_s``, ``rollout/time_s``, the
training stage's seconds (``stage/train_s``; ``train/time_s`` is the stream trainer's finish,
the part rollout did not hide), ``train/overlap_s``, and with scale-down the decision point
(``rollout/scaled_down_at``, ``_s``) and the trainer's devices (``train/devices``, the lease's
start and end): the ``train/devices`` series of each step is the step function 0 -> lent ->
0 over the seconds since the trainer's ``begin``. ``run_scaledown_bench`` writes
``scaledown.json`` and ``scaledown.png`` to ``out_dir`` and, given a tracker, logs both to a
``scaledown-bench`` run of its experiment.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rollpacker.core.errors import ConfigError
from rollpacker.experiment import train_arm, train_config
from rollpacker.lab.bench.tables import legend, wrap
from rollpacker.tracking import ExperimentTracker

# the layout and the arm both runs share (only rollout.scale_down.enabled differs)
BENCH_OVERRIDES: dict[str, Any] = {
    "rollout.policy": "tail_batching",
    "planner.devices": 2,  # two engine replicas ...
    "planner.max_tp": 1,  # ... of TP 1: one core each here (no TP-2 engine in the pool)
    "planner.initial_tp": 1,
    "planner.switching": False,
    "planner.profile_batches": [1, 8, 32, 128],  # the first step profiles the layout: keep it short
    "planner.profile_contexts": [16, 256],
    "planner.profile_window": 8,
    "planner.reprofile_margin": 100.0,  # no re-profile mid-benchmark (the trainer shares the cores)
    "validation.every": 1000,  # validated before RL and after the last step only (not step time)
    "validation.max_tokens": 256,
    "task.val_size": 32,
}
ARMS = ("off", "on")
KEYS = (
    "step/time_s",
    "rollout/time_s",
    "stage/train_s",
    "train/time_s",
    "train/overlap_s",
    "train/streamed_samples",
    "train/samples",
    "train/wait_s",
    "train/devices",
    "train/devices_max",
    "train/threads",
    "train/repurposed_s",
    "train/repurposed_at_s",
    "train/returned_at_s",
    "rollout/scaled_down",
    "rollout/scaled_down_at",
    "rollout/scaled_down_at_s",
    "rollout/scale_down_migrated",
    "rollout/scale_down_migrate_s",
    "rollout/bubble_ratio",
    "reward/mean",
)
MEANS = (
    "step/time_s",
    "rollout/time_s",
    "stage/train_s",
    "train/time_s",
    "train/overlap_s",
    "train/streamed_samples",
    "train/devices",
)
PAIRED = ("step/time_s", "rollout/time_s", "stage/train_s", "train/time_s")


def check_scaledown(
    config: Path,
    overrides: dict[str, Any] | None = None,
    steps: int = 6,
    out_dir: Path = Path("build/bench-scaledown"),
    arms: Sequence[str] = ARMS,
    repeats: int = 2,
) -> dict[str, Any]:
    """Every arm's training config checked (the bench's settings, the model, this machine) before
    anything runs or is made; the overrides the runs share."""
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise ConfigError(f"scale-down bench arms {list(arms)}: use {', '.join(ARMS)}")
    if steps < 1 or repeats < 1:
        raise ConfigError(f"steps {steps}, repeats {repeats}: at least one step and one run per arm")
    base = {
        "experiment": "rollpacker-scaledown-bench",
        "out_dir": str(Path(out_dir) / "runs"),
        "tracking_uri": f"sqlite:///{(Path(out_dir) / 'mlflow.db').resolve()}",
        **BENCH_OVERRIDES,
        **(overrides or {}),
        "steps": steps,
    }
    for arm in arms:
        train_config(config, _arm_overrides(base, arm), run_name=f"scaledown-{arm}", make_store=False)
    return base


def _arm_overrides(base: dict[str, Any], arm: str) -> dict[str, Any]:
    return {**base, "rollout.scale_down.enabled": arm == "on"}


def run_scaledown_bench(
    config: Path,
    overrides: dict[str, Any] | None = None,
    steps: int = 6,
    out_dir: Path = Path("build/bench-scaledown"),
    tracker: ExperimentTracker | None = None,
    progress: bool = True,
    arms: Sequence[str] = ARMS,
    say: Callable[[str], None] | None = None,
    repeats: int = 2,
) -> dict[str, Any]:
    """Each arm of ``arms`` (``off``, ``on``) for ``steps`` steps from a fresh start, ``repeats``
    times in ABBA order (off, on, on, off, ...: a drift in the machine's background load falls on
    both arms alike); the report (JSON-able), also written to ``out_dir``/scaledown.json with its
    plot ``scaledown.png``. Per arm, ``per_step`` pools the repeats (``repeat`` names each row's)."""
    out_dir = Path(out_dir)
    base = check_scaledown(config, overrides, steps, out_dir, arms, repeats)
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "config": str(config),
        "overrides": _jsonable(base),
        "steps": steps,
        "repeats": repeats,
        "runs": [],
        "arms": {},
    }
    order = [(r, a) for r in range(repeats) for a in (arms if r % 2 == 0 else list(reversed(arms)))]
    for rep, arm in order:
        text, cfg = train_config(config, _arm_overrides(base, arm), run_name=f"scaledown-{arm}-r{rep}")
        summary = train_arm(text, fresh=True, progress=progress, say=say)
        per_step = _per_step(
            ExperimentTracker(cfg.tracking_uri, cfg.experiment), summary.run_id, summary.steps
        )
        for m in per_step:
            m["repeat"] = float(rep)
        report["runs"].append(
            {
                "arm": arm,
                "repeat": rep,
                "run_id": summary.run_id,
                "wall_s": summary.wall_s,
                "mean": {k: _mean(per_step, k) for k in MEANS},
                "exactly_once": summary.exactly_once.ok,
            }
        )
        pooled = report["arms"].setdefault(arm, {"per_step": [], "devices_series": []})
        pooled["per_step"].extend(per_step)
        pooled["devices_series"].extend(_devices_series(m) for m in per_step)
    for a in report["arms"].values():
        a["mean"] = {k: _mean(a["per_step"], k) for k in MEANS}
    if "on" in report["arms"] and "off" in report["arms"]:
        on, off = report["arms"]["on"]["mean"], report["arms"]["off"]["mean"]
        report["effect"] = {
            k: {
                "off": off[k],
                "on": on[k],
                "on_minus_off": on[k] - off[k],
                "off_over_on": _ratio(off[k], on[k]),
            }
            for k in MEANS
        }
        report["paired"] = _paired(report["arms"]["off"]["per_step"], report["arms"]["on"]["per_step"])
    (out_dir / "scaledown.json").write_text(json.dumps(report, indent=2))
    png = plot(report, out_dir / "scaledown.png")
    if tracker is not None:
        run = tracker.client.create_run(tracker.experiment_id, run_name="scaledown-bench")
        tracker.client.log_artifact(run.info.run_id, str(out_dir / "scaledown.json"), "bench")
        tracker.client.log_artifact(run.info.run_id, str(png), "bench")
        tracker.client.set_terminated(run.info.run_id, "FINISHED")
        report["tracking_run_id"] = run.info.run_id
    return report


def _per_step(tracker: ExperimentTracker, run_id: str, steps: int) -> list[dict[str, float]]:
    """The arm's step metrics (MLflow steps 1..``steps``), one dict per step."""
    rows: list[dict[str, float]] = [{"step": float(s)} for s in range(1, steps + 1)]
    for key in KEYS:
        for s, v in tracker.metric_history(run_id, key):
            if 1 <= s <= steps:
                rows[s - 1][key] = v
    return rows


def _paired(off: list[dict[str, float]], on: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """on - off per (repeat, step): both arms roll out the same prompts at the same step (same
    seed), so the per-step differences cancel the steps' own spread (long rounds, long tails)."""
    key_of = {(m.get("repeat", 0.0), m["step"]): m for m in off}
    pairs = [
        (key_of[(m.get("repeat", 0.0), m["step"])], m)
        for m in on
        if (m.get("repeat", 0.0), m["step"]) in key_of
    ]
    out: dict[str, dict[str, float]] = {}
    for k in PAIRED:
        d = [b[k] - a[k] for a, b in pairs if k in a and k in b]
        if d:
            out[k] = {
                "mean_on_minus_off": statistics.fmean(d),
                "sd": statistics.stdev(d) if len(d) > 1 else 0.0,
                "steps": float(len(d)),
                "on_faster_steps": float(sum(x < 0 for x in d)),
            }
    return out


def _devices_series(m: dict[str, float]) -> list[tuple[float, float]]:
    """One step's ``train/devices`` step function, ``(seconds since the trainer's begin, devices)``."""
    if "train/repurposed_at_s" not in m:
        return [(0.0, 0.0)]
    a, b, n = m["train/repurposed_at_s"], m["train/returned_at_s"], m.get("train/devices_max", 0.0)
    return [(0.0, 0.0), (a, 0.0), (a, n), (b, n), (b, 0.0)]


def _mean(rows: list[dict[str, float]], key: str) -> float:
    vals = [r[key] for r in rows if key in r]
    return statistics.fmean(vals) if vals else float("nan")


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}


_LEGEND = (
    ("arm", "off / on: Algorithm 1's scale-down disabled / enabled (the same tail-batching arm otherwise)"),
    ("run", "the repeat (runs in ABBA order: off, on, on, off, ...)"),
    ("step s", "the RL step's seconds (step/time_s)"),
    ("rollout s", "the rollout's seconds (rollout/time_s)"),
    ("train s", "the training stage's seconds (stage/train_s)"),
    ("finish s", "the stream trainer's finish, the part of training rollout did not hide (train/time_s)"),
    ("overlap s", "gradient seconds that overlapped rollout (train/overlap_s)"),
    ("devices", "devices lent to the trainer, time-weighted from its begin to the give-back (train/devices)"),
    ("scaled at", "the share of the round's requests completed when it scaled down (- = it did not)"),
    ("lent s", "seconds the freed devices were lent to the trainer (train/repurposed_s)"),
)


def render(report: dict[str, Any]) -> str:
    """A table: per arm and step, the step, rollout and train seconds and the trainer's devices;
    the paired and mean effects; a legend."""
    hdr = (
        f"{'arm':<4} {'run':>3} {'step':>4} {'step s':>7} {'rollout s':>9} {'train s':>8} {'finish s':>8} "
        f"{'overlap s':>9} {'devices':>7} {'scaled at':>9} {'lent s':>7}"
    )
    lines = [hdr, "-" * len(hdr)]
    for arm, a in report["arms"].items():
        for m in a["per_step"]:
            at = m.get("rollout/scaled_down_at")
            lines.append(
                f"{arm:<4} {int(m.get('repeat', 0)):>3} {int(m['step']):>4} "
                f"{m.get('step/time_s', float('nan')):>7.2f} "
                f"{m.get('rollout/time_s', float('nan')):>9.2f} {m.get('stage/train_s', float('nan')):>8.2f} "
                f"{m.get('train/time_s', float('nan')):>8.2f} {m.get('train/overlap_s', float('nan')):>9.2f} "
                f"{m.get('train/devices', 0.0):>7.3f} {(f'{at:.0%}' if at is not None else '-'):>9} "
                f"{m.get('train/repurposed_s', 0.0):>7.2f}"
            )
    for k, e in report.get("paired", {}).items():
        lines += wrap(
            f"paired {k}: on - off {e['mean_on_minus_off']:+.3f} s (sd {e['sd']:.3f}), "
            f"on faster in {int(e['on_faster_steps'])} of {int(e['steps'])} steps"
        )
    for k, e in report.get("effect", {}).items():
        lines += wrap(
            f"mean {k}: off {e['off']:.3f}, on {e['on']:.3f} "
            f"({e['on_minus_off']:+.3f}; off/on {e['off_over_on']:.3f}x)"
        )
    return "\n".join(lines + legend(_LEGEND))


def plot(report: dict[str, Any], out: Path) -> Path:
    """Per step: step / rollout / train seconds of both arms; and the on arm's trainer devices over
    each step (seconds since the trainer's begin)."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 4.5), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax_t, ax_d = fig.subplots(1, 2)
    styles = {"off": "--", "on": "-"}
    colours = {"step/time_s": "black", "rollout/time_s": "tab:blue", "stage/train_s": "tab:orange"}
    for arm, a in report["arms"].items():
        # one point per step: the mean over the repeats
        steps = sorted({int(m["step"]) for m in a["per_step"]})
        for key, colour in colours.items():
            ys = [_mean([m for m in a["per_step"] if int(m["step"]) == s], key) for s in steps]
            ax_t.plot(
                steps,
                ys,
                styles.get(arm, ":"),
                color=colour,
                marker="o",
                markersize=3,
                label=f"{key} ({arm})",
            )
    ax_t.set(
        xlabel="RL step", ylabel="seconds (mean over repeats)", title="scale-down off (dashed) vs on (solid)"
    )
    ax_t.legend(fontsize=7)
    on = report["arms"].get("on")
    if on is not None:
        # one colour per step, one line per repeat; the legend gives each step's mean over repeats
        steps = sorted({int(m["step"]) for m in on["per_step"]})
        cmap = matplotlib.colormaps["tab10"]
        seen: set[int] = set()
        for m, series in zip(on["per_step"], on["devices_series"], strict=True):
            s = int(m["step"])
            mean = _mean([x for x in on["per_step"] if int(x["step"]) == s], "train/devices")
            ax_d.step(
                [t for t, _ in series],
                [n for _, n in series],
                where="post",
                color=cmap(steps.index(s) % 10),
                alpha=0.7,
                label=f"step {s}: mean {mean:.2f}" if s not in seen else None,
            )
            seen.add(s)
        ax_d.legend(fontsize=7)
    ax_d.set(
        xlabel="seconds since the trainer's begin",
        ylabel="devices lent to the trainer",
        title="train/devices over each step (scale-down on)",
    )
    fig.savefig(out, format="png")
    return out
