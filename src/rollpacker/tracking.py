"""Experiment-level MLflow tracking for the pipeline: one MLflow run per arm, plots, comparison.

Model: one MLflow experiment per rollpacker experiment (``config.experiment``), one MLflow run per
**arm** (a rollout policy name such as ``sync`` or ``tail_batching``) tagged ``rollpacker.arm``,
per-step metrics logged with ``step=``, params from the config, and the state pointer kept as the
run tags ``rollpacker.state`` (an ``s3://`` URI) and ``rollpacker.step``.

Each pipeline step runs in fresh processes (one per KFP task), so nothing is kept in memory between
calls: runs are found by tag, metric histories and artifacts are read back from the store.

Invariants:

- at most one live (not deleted) run per arm in an experiment: ``arm_run`` is get-or-create, and if
  two processes race to create one, the older run wins and the other is deleted;
- params are logged once, when the arm's run is created (MLflow params are immutable);
- a step logged twice (a re-run after a failure) counts once: readers keep the newest value per step;
- ``compare`` never crashes on a missing baseline: speedups are ``None`` and a note says why;
- an experiment without arm runs is a ``ConfigError`` of ``compare`` and ``log_compare`` that says
  what to run; no empty compare run is logged.

mlflow and matplotlib are imported inside functions: importing this module stays cheap.
"""

from __future__ import annotations

import json
import logging
import math
import re
import tempfile
import textwrap
import time
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollpacker.core.environ import environ_set
from rollpacker.core.errors import ConfigError, TrackingUnavailable
from rollpacker.core.fidelity import COMPARE_KEYS
from rollpacker.core.metrics import throughput
from rollpacker.core.redact import redact_uri

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

TAG_ARM = "rollpacker.arm"
TAG_POLICY = "rollpacker.policy"
TAG_KIND = "rollpacker.kind"
TAG_STATE = "rollpacker.state"
TAG_STEP = "rollpacker.step"

#: Per-step stage seconds, in pipeline order (stacked in the step-time plots).
STAGE_KEYS: tuple[str, ...] = (
    "rollout/time_s",
    "reward/tail_s",
    "train/time_s",
    "weights/sync_s",
    "pipeline/overhead_s",
)
STEP_KEY = "step/time_s"
BUBBLE_KEY = "rollout/bubble_ratio"
LONG_QUEUE_KEY = "rollout/long_queue_size"
VAL_KEY = "val/accuracy"
REWARD_KEY = "reward/mean"
LAG_KEY = "train/policy_lag"  # token-weighted policy-version lag of the trained tokens
OFF_POLICY_KEY = "train/off_policy_frac"
# the rollout's token counts per step: generated (all), trained, wasted (core.metrics.Throughput)
TOKEN_KEYS: tuple[str, ...] = ("rollout/tokens_generated", "rollout/tokens_trained", "rollout/tokens_wasted")
ROUND_KINDS: tuple[str, ...] = ("standard", "short", "long")

PLOT_FILES: tuple[str, ...] = ("plots/step_time.png", "plots/response_lengths.png", "plots/long_queue.png")

_STAGE_COLOURS = {
    "rollout/time_s": "#4C72B0",
    "reward/tail_s": "#DD8452",
    "train/time_s": "#55A868",
    "weights/sync_s": "#C44E52",
    "pipeline/overhead_s": "#8C8C8C",
}
_KIND_COLOURS = {"standard": "#4C72B0", "short": "#55A868", "long": "#C44E52"}
_OTHER_COLOUR = "#8C8C8C"

_PARAM_BATCH = 100
_PARAM_VALUE_MAX = 6000
_CHECK_TIMEOUT_S = 3
_ARM_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")


def flatten_params(obj: Any, prefix: str = "") -> dict[str, str]:
    """A dataclass (or nested dict) as flat ``a.b.c -> str`` params; enums by value."""
    out: dict[str, str] = {}
    data = asdict(obj) if is_dataclass(obj) and not isinstance(obj, type) else obj
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten_params(v, key + "."))
        else:
            out[key] = redact_uri(str(v.value if hasattr(v, "value") else v))  # no password in a URL
    return out


def artifact_root(tracking_uri: str) -> str | None:
    """Artifacts beside a SQLite store (``sqlite:///build/mlflow.db`` -> ``build/mlartifacts``).

    ``None`` for any other store: an HTTP server decides its artifact location itself.
    """
    if tracking_uri.startswith("sqlite:///"):
        db = Path(tracking_uri[len("sqlite:///") :])
        db.parent.mkdir(parents=True, exist_ok=True)
        return (db.parent.resolve() / "mlartifacts").as_uri()
    return None


def _is_http(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def _env(**values: str) -> AbstractContextManager[None]:
    """Environment variables set while the block runs (MLflow reads them on every call)."""
    return environ_set(values)


def _fail_fast_http() -> Any:
    """No retries and a short timeout for MLflow's HTTP client while the block runs.

    MLflow's default is 7 retries with exponential backoff and a 120 s timeout: minutes before a
    dead server is reported.
    """
    return _env(MLFLOW_HTTP_REQUEST_MAX_RETRIES="0", MLFLOW_HTTP_REQUEST_TIMEOUT=str(_CHECK_TIMEOUT_S))


def _client(tracking_uri: str) -> MlflowClient:
    logging.getLogger("alembic").setLevel(logging.WARNING)
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


def unreachable(tracking_uri: str, e: Exception) -> TrackingUnavailable:
    """The error for an MLflow server that did not answer (or answered with an error), naming the URI."""
    from mlflow.exceptions import RestException

    tracking_uri = redact_uri(tracking_uri)
    text = redact_uri(" ".join(str(e).split()))
    errno = re.search(r"\[Errno -?\d+\] [^\"')]+", text)
    if errno:
        cause = errno.group(0)
    elif "timed out" in text.lower():
        cause = f"no answer within {_CHECK_TIMEOUT_S} s"
    else:
        cause = text if len(text) <= 240 else text[:240] + "..."
    if isinstance(e, RestException):
        return TrackingUnavailable(
            f"tracking_uri = {tracking_uri!r}: the MLflow server answered with an error: {cause}; "
            "check the server's logs or fix tracking_uri"
        )
    if _is_http(tracking_uri):
        return TrackingUnavailable(
            f"tracking_uri = {tracking_uri!r}: no MLflow server answers there ({cause}); "
            "start the local one with `make up` or fix tracking_uri"
        )
    return TrackingUnavailable(
        f"tracking_uri = {tracking_uri!r}: the MLflow store could not be opened ({cause}); fix tracking_uri"
    )


def _lookup_experiment(client: MlflowClient, tracking_uri: str, experiment: str) -> Any:
    """The experiment (or None), failing fast with a ConfigError when the store does not answer."""
    try:
        with _fail_fast_http():
            return client.get_experiment_by_name(experiment)
    except Exception as e:  # MLflow raises many types; name the URI
        raise unreachable(tracking_uri, e) from e


def _deleted_error(experiment: str) -> ConfigError:
    return ConfigError(
        f"experiment {experiment!r} is deleted in MLflow; restore it "
        f"(`mlflow experiments restore --experiment-id ...`) or use another experiment name"
    )


def _series(history: list[Any]) -> list[tuple[int, float]]:
    """(step, value) sorted by step; a step logged twice keeps its newest value."""
    best: dict[int, tuple[int, float]] = {}
    for m in history:
        prev = best.get(m.step)
        if prev is None or m.timestamp >= prev[0]:
            best[m.step] = (m.timestamp, float(m.value))
    return [(s, best[s][1]) for s in sorted(best)]


def _mean(values: list[float]) -> float | None:
    vals = [v for v in values if not math.isnan(v)]
    return sum(vals) / len(vals) if vals else None


def _search_all(client: MlflowClient, experiment_id: str, filter_string: str = "") -> list[Any]:
    runs: list[Any] = []
    token: str | None = None
    while True:
        page = client.search_runs([experiment_id], filter_string, max_results=1000, page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def _oldest(runs: list[Any]) -> Any:
    return min(runs, key=lambda r: (r.info.start_time or 0, r.info.run_id))


class ExperimentTracker:
    """One rollpacker experiment in MLflow; every call is stateless apart from the experiment id."""

    def __init__(self, tracking_uri: str, experiment: str) -> None:
        if not experiment.strip():
            raise ConfigError("experiment = '': give the experiment a name")
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.client = _client(tracking_uri)
        self._experiment_id: str | None = None

    # -- experiment ---------------------------------------------------------------------------

    def check(self) -> str:
        """Fail fast (a few seconds) if the store does not answer; create the experiment if missing.

        Returns the experiment id.
        """
        exp = _lookup_experiment(self.client, self.tracking_uri, self.experiment)
        if exp is not None:
            if exp.lifecycle_stage == "deleted":
                raise _deleted_error(self.experiment)
            self._experiment_id = str(exp.experiment_id)
            return self._experiment_id
        from mlflow.exceptions import MlflowException

        try:
            exp_id = self.client.create_experiment(
                self.experiment, artifact_location=artifact_root(self.tracking_uri)
            )
        except MlflowException as e:  # created by a concurrent task in between
            again = self.client.get_experiment_by_name(self.experiment)
            if again is None or again.lifecycle_stage == "deleted":
                raise ConfigError(
                    f"tracking_uri = {redact_uri(self.tracking_uri)!r}: could not create experiment "
                    f"{self.experiment!r}: {redact_uri(str(e))}"
                ) from e
            exp_id = again.experiment_id
        self._experiment_id = str(exp_id)
        return self._experiment_id

    @property
    def experiment_id(self) -> str:
        return self._experiment_id if self._experiment_id is not None else self.check()

    # -- arm runs -----------------------------------------------------------------------------

    def _arm_runs(self, arm: str) -> list[Any]:
        return _search_all(self.client, self.experiment_id, f"tags.`{TAG_ARM}` = '{arm}'")

    def find_arm_run(self, arm: str) -> str | None:
        """The arm's live run id, or None."""
        _check_arm(arm)
        runs = self._arm_runs(arm)
        return _oldest(runs).info.run_id if runs else None

    def arm_run(self, arm: str, params: dict[str, str]) -> str:
        """The live run tagged ``rollpacker.arm == arm``, created (with ``params``) if missing."""
        _check_arm(arm)
        runs = self._arm_runs(arm)
        if runs:
            return str(_oldest(runs).info.run_id)
        policy = params.get("rollout.policy", arm)
        run = self.client.create_run(
            self.experiment_id,
            run_name=arm,
            tags={TAG_ARM: arm, TAG_POLICY: str(policy), TAG_KIND: "arm"},
        )
        run_id = str(run.info.run_id)
        # another task may have created the arm's run at the same moment: the older one wins
        winner = _oldest(self._arm_runs(arm) or [run])
        if winner.info.run_id != run_id:
            self.client.delete_run(run_id)
            return str(winner.info.run_id)
        from mlflow.entities import Param

        items = [Param(str(k), str(v)[:_PARAM_VALUE_MAX]) for k, v in sorted(params.items())]
        for i in range(0, len(items), _PARAM_BATCH):
            self.client.log_batch(run_id, params=items[i : i + _PARAM_BATCH])
        return run_id

    def log_step(self, run_id: str, step: int, metrics: dict[str, float]) -> None:
        """One step's metrics in one request, all at ``step``."""
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        self.client.log_batch(
            run_id, metrics=[Metric(k, float(v), ts, int(step)) for k, v in metrics.items()]
        )

    def set_state_pointer(self, run_id: str, uri: str, step: int) -> None:
        """Point the arm at the newest committed state document (both tags in one request)."""
        from mlflow.entities import RunTag

        self.client.log_batch(run_id, tags=[RunTag(TAG_STATE, uri), RunTag(TAG_STEP, str(int(step)))])

    def state_pointer(self, run_id: str) -> tuple[str, int] | None:
        """``(state uri, step)`` of the newest committed step, or None before the first commit."""
        tags = self.client.get_run(run_id).data.tags
        if TAG_STATE not in tags or TAG_STEP not in tags:
            return None
        return tags[TAG_STATE], int(tags[TAG_STEP])

    def log_step_lengths(self, run_id: str, step: int, round_kind: str, lengths: list[int]) -> None:
        """The step's response lengths (tokens) as ``lengths/step-<n:06d>.json``."""
        doc = {"step": int(step), "round_kind": round_kind, "lengths": [int(x) for x in lengths]}
        self.client.log_text(run_id, json.dumps(doc), f"lengths/step-{int(step):06d}.json")

    def log_profile(self, run_id: str, step: int, uri: str, doc: dict[str, Any]) -> None:
        """Register a profile table with the arm's run: the table and its plot under
        ``profiles/``, its store URI as a tag, its cost and prediction error as metrics."""
        from mlflow.entities import RunTag

        from rollpacker.core.latency import ProfileTable
        from rollpacker.engines.profiler import plot_profile

        name = f"profiles/profile-step-{int(step):06d}"
        self.client.log_text(run_id, json.dumps(doc, indent=1), f"{name}.json")
        table = ProfileTable.from_dict(doc["table"], uri)
        with tempfile.TemporaryDirectory() as tmp:
            png = Path(tmp) / f"profile-step-{int(step):06d}.png"
            plot_profile(table, png)
            self.client.log_artifact(run_id, str(png), "profiles")
        metrics = {"profile/seconds": table.profile_seconds}
        for lay, err in doc.get("validation", {}).items():
            metrics[f"profile/error_{lay}"] = float(err["window_mape"])
        self.log_step(run_id, step, metrics)
        self.client.log_batch(run_id, tags=[RunTag("rollpacker.profile_uri", uri)])

    def metric_history(self, run_id: str, key: str) -> list[tuple[int, float]]:
        """(step, value) sorted by step, newest value per step."""
        return _series(self.client.get_metric_history(run_id, key))

    def step_lengths(self, run_id: str) -> list[dict[str, Any]]:
        """Every ``lengths/step-*.json`` of the run, sorted by step."""
        if not self.client.list_artifacts(run_id, "lengths"):
            return []
        with tempfile.TemporaryDirectory() as tmp, _env(MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR="false"):
            local = Path(self.client.download_artifacts(run_id, "lengths", tmp))
            docs = [json.loads(p.read_text()) for p in sorted(local.glob("step-*.json"))]
        return sorted(docs, key=lambda d: d["step"])

    def finish_arm(self, run_id: str) -> list[str]:
        """Render the arm's plots, log them under ``plots/``, mark the run FINISHED.

        Returns the artifact paths of the plots.
        """
        series = {k: self.metric_history(run_id, k) for k in (*STAGE_KEYS, STEP_KEY, LONG_QUEUE_KEY)}
        lengths = self.step_lengths(run_id)
        arm = self.client.get_run(run_id).data.tags.get(TAG_ARM, run_id[:8])
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp)
            render_arm_plots(arm, series, lengths, out)
            self.client.log_artifacts(run_id, str(out), "plots")
        self.client.set_terminated(run_id, "FINISHED")
        return list(PLOT_FILES)


def _check_arm(arm: str) -> None:
    if not _ARM_RE.match(arm):
        raise ConfigError(f"arm {arm!r}: use letters, digits, '_', '.', '-' (a rollout policy name)")


# -- plots ------------------------------------------------------------------------------------


def _figure(width: float = 9.0, height: float = 4.5) -> Any:
    from matplotlib.figure import Figure  # no pyplot: no global state, Agg canvas on savefig

    return Figure(figsize=(width, height), dpi=110, layout="constrained")


def _no_data(ax: Any, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} logged", ha="center", va="center", transform=ax.transAxes, color="grey")


def _save(fig: Any, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    fig.savefig(path, format="png")


def render_arm_plots(
    arm: str, series: dict[str, list[tuple[int, float]]], lengths: list[dict[str, Any]], out_dir: Path
) -> list[Path]:
    """The three per-arm plots as PNGs in ``out_dir`` (names as in ``PLOT_FILES``, without ``plots/``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / Path(p).name for p in PLOT_FILES]
    kind_of = {int(d["step"]): str(d.get("round_kind", "standard")) for d in lengths}
    _plot_stage_times(arm, series, paths[0])
    _plot_lengths(arm, lengths, paths[1])
    _plot_long_queue(arm, series, kind_of, paths[2])
    return paths


def _plot_stage_times(arm: str, series: dict[str, list[tuple[int, float]]], path: Path) -> None:
    """(1) step time by stage: stacked bars + step/time_s line."""
    fig = _figure()
    ax = fig.add_subplot()
    present = [k for k in STAGE_KEYS if series.get(k)]
    steps = sorted({s for k in (*present, STEP_KEY) for s, _ in series.get(k, [])})
    if steps:
        bottom = dict.fromkeys(steps, 0.0)
        for k in present:
            vals = dict(series[k])
            heights = [vals.get(s, 0.0) for s in steps]
            ax.bar(
                steps, heights, bottom=[bottom[s] for s in steps], label=k, color=_STAGE_COLOURS[k], width=0.8
            )
            for s, h in zip(steps, heights, strict=True):
                bottom[s] += h
        if series.get(STEP_KEY):
            xs, ys = zip(*series[STEP_KEY], strict=True)
            ax.plot(xs, ys, color="black", marker="o", markersize=3, linewidth=1.2, label=STEP_KEY)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        _no_data(ax, "stage times")
    ax.set(xlabel="step", ylabel="seconds", title=f"{arm}: step time by stage")
    _save(fig, path)


def _plot_lengths(arm: str, lengths: list[dict[str, Any]], path: Path) -> None:
    """(2) response-length distribution per step, coloured by round kind."""
    from matplotlib.patches import Patch

    fig = _figure()
    ax = fig.add_subplot()
    docs = [d for d in lengths if d.get("lengths")]
    if docs:
        positions = [int(d["step"]) for d in docs]
        box = ax.boxplot(
            [d["lengths"] for d in docs],
            positions=positions,
            widths=0.6,
            patch_artist=True,
            showfliers=True,
            flierprops={"markersize": 2, "alpha": 0.5},
            medianprops={"color": "black"},
        )
        for patch, d in zip(box["boxes"], docs, strict=True):
            patch.set_facecolor(_KIND_COLOURS.get(str(d.get("round_kind")), _OTHER_COLOUR))
            patch.set_alpha(0.8)
        kinds = [k for k in ROUND_KINDS if any(d.get("round_kind") == k for d in docs)]
        others = sorted({str(d.get("round_kind")) for d in docs} - set(ROUND_KINDS))
        handles = [Patch(color=_KIND_COLOURS[k], label=f"{k} round") for k in kinds]
        handles += [Patch(color=_OTHER_COLOUR, label=f"{k} round") for k in others]
        ax.legend(handles=handles, fontsize=8, loc="upper right")
        if len(positions) > 20:
            stride = math.ceil(len(positions) / 20)
            ax.set_xticks(positions[::stride], [str(p) for p in positions[::stride]])
    else:
        _no_data(ax, "response lengths")
    ax.set(xlabel="step", ylabel="response length (tokens)", title=f"{arm}: response lengths per step")
    _save(fig, path)


def _plot_long_queue(
    arm: str, series: dict[str, list[tuple[int, float]]], kind_of: dict[int, str], path: Path
) -> None:
    """(3) long-prompt queue size per step, coloured by its round kind (``kind_of[step]``), long
    rounds shaded."""
    from matplotlib.patches import Patch

    fig = _figure(9.0, 3.5)
    ax = fig.add_subplot()
    q = series.get(LONG_QUEUE_KEY, [])
    if q:
        xs = [s for s, _ in q]
        colours = [_KIND_COLOURS.get(kind_of.get(s, ""), _OTHER_COLOUR) for s in xs]
        ax.bar(xs, [v for _, v in q], color=colours, width=0.8)
        for st, kind in kind_of.items():  # a long round drains the queue: shade its column
            if kind == "long":
                ax.axvspan(st - 0.5, st + 0.5, color=_KIND_COLOURS["long"], alpha=0.15, linewidth=0)
        if kind_of:
            kinds = [k for k in ROUND_KINDS if k in kind_of.values()]
            ax.legend(handles=[Patch(color=_KIND_COLOURS[k], label=f"{k} round") for k in kinds], fontsize=8)
    else:
        _no_data(ax, LONG_QUEUE_KEY)
    ax.set(xlabel="step", ylabel="prompts", title=f"{arm}: long-prompt queue size after each step")
    _save(fig, path)


# -- comparison -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArmSummary:
    arm: str
    run_id: str
    policy: str
    steps: int
    stage_mean_s: dict[str, float | None]  # STAGE_KEYS + STEP_KEY
    bubble_ratio_mean: float | None
    speedup_step: float | None  # baseline mean step/time_s / this arm's
    speedup_rollout: float | None  # baseline mean rollout/time_s / this arm's
    val_accuracy_first: float | None
    val_accuracy_final: float | None
    reward_mean_final: float | None
    policy_lag_mean: float | None = None
    off_policy_frac_mean: float | None = None
    # core.metrics.Throughput over the arm's steps (None where the run logged no token counts)
    output_tokens_per_s: float | None = None  # every generated token / rollout second (SortedRL's)
    trained_tokens_per_s: float | None = None  # trained response tokens / rollout second
    wasted_share: float | None = None
    # engine/trainer mismatch and rollout correction (core.fidelity.COMPARE_KEYS), mean over steps
    fidelity_mean: dict[str, float | None] = field(default_factory=dict)


@dataclass(frozen=True)
class CompareReport:
    experiment: str
    tracking_uri: str
    baseline: str
    arms: list[ArmSummary]
    notes: list[str] = field(default_factory=list)

    def arm(self, name: str) -> ArmSummary:
        for a in self.arms:
            if a.arm == name:
                return a
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def _rows(self) -> list[tuple[str, list[str]]]:
        def num(v: float | None, fmt: str = "{:.2f}") -> str:
            return "-" if v is None else fmt.format(v)

        rows: list[tuple[str, list[str]]] = [
            ("policy", [a.policy for a in self.arms]),
            ("steps", [str(a.steps) for a in self.arms]),
        ]
        for k in (*STAGE_KEYS, STEP_KEY):
            rows.append((f"{k} mean", [num(a.stage_mean_s.get(k)) for a in self.arms]))
        for k in ("rollout/time_s", "pipeline/overhead_s"):
            rows.append((f"{k} share of step", [num(_share(a, k), "{:.0%}") for a in self.arms]))
        rows += [
            (f"speedup {STEP_KEY}", [num(a.speedup_step, "{:.2f}x") for a in self.arms]),
            ("speedup rollout/time_s", [num(a.speedup_rollout, "{:.2f}x") for a in self.arms]),
            (f"{BUBBLE_KEY} mean", [num(a.bubble_ratio_mean, "{:.3f}") for a in self.arms]),
            ("rollout output tokens/s (all)", [num(a.output_tokens_per_s, "{:.1f}") for a in self.arms]),
            ("rollout trained tokens/s", [num(a.trained_tokens_per_s, "{:.1f}") for a in self.arms]),
            ("rollout wasted share", [num(a.wasted_share, "{:.1%}") for a in self.arms]),
            (f"{LAG_KEY} mean", [num(a.policy_lag_mean, "{:.3f}") for a in self.arms]),
            (f"{OFF_POLICY_KEY} mean", [num(a.off_policy_frac_mean, "{:.3f}") for a in self.arms]),
            *(
                (f"{k} mean", [num(a.fidelity_mean.get(k), "{:.2e}") for a in self.arms])
                for k in COMPARE_KEYS
            ),
            (f"{VAL_KEY} first", [num(a.val_accuracy_first, "{:.3f}") for a in self.arms]),
            (f"{VAL_KEY} final", [num(a.val_accuracy_final, "{:.3f}") for a in self.arms]),
            (f"{REWARD_KEY} final", [num(a.reward_mean_final, "{:.3f}") for a in self.arms]),
            ("run", [a.run_id[:12] for a in self.arms]),
        ]
        return rows

    def render(self) -> str:
        """An aligned text table, arms as columns (as many per block as fit in ``TABLE_COLUMNS``),
        a legend, and the notes."""
        head = f"experiment {self.experiment!r}   baseline {self.baseline!r}   ({self.tracking_uri})"
        lines = _wrap(head)
        if self.arms:
            rows = self._rows()
            w0 = max(len(r[0]) for r in rows)
            widths = [max(len(a.arm), *(len(r[1][i]) for r in rows)) for i, a in enumerate(self.arms)]
            for block in _column_blocks(w0, widths):
                lines.append("")
                lines.append(" " * w0 + "".join(f"  {self.arms[i].arm:>{widths[i]}}" for i in block))
                lines += [
                    f"{name:<{w0}}" + "".join(f"  {cells[i]:>{widths[i]}}" for i in block)
                    for name, cells in rows
                ]
            lines += ["", *_compare_legend()]
        for n in self.notes:
            lines += _wrap(f"note: {n}")
        return "\n".join(lines)

    def to_markdown(self) -> str:
        out = [f"# {self.experiment}: arms compared (baseline `{self.baseline}`)", ""]
        if self.arms:
            out.append("| metric | " + " | ".join(a.arm for a in self.arms) + " |")
            out.append("|---|" + "---:|" * len(self.arms))
            out += [f"| {name} | " + " | ".join(cells) + " |" for name, cells in self._rows()]
        out += [""] + [f"- {n}" for n in self.notes]
        return "\n".join(out) + "\n"


# the printed tables' width, as the benchmarks' (rollpacker.lab.bench.tables.MAX_COLUMNS)
TABLE_COLUMNS = 120

_COMPARE_LEGEND = (
    ("mean", "the metric's mean over the arm's steps (seconds where the name ends in _s)"),
    ("share of step", "that stage's mean seconds / the mean step/time_s"),
    ("speedup", "the baseline arm's mean seconds / this arm's (> 1 = faster than the baseline)"),
    ("bubble_ratio", "SortedRL eq. 4: the share of the engine's Q request slots left idle during rollout"),
    (
        "output tokens/s (all)",
        "every token the rollout generated (terminated, cached ones included) per rollout second, "
        "as SortedRL counts; not the trained tokens/s",
    ),
    ("trained tokens/s", "tokens of the trained responses per rollout second (rollout/time_s is s/step)"),
    ("wasted share", "tokens generated then thrown away, share of all generated"),
    ("policy_lag", "updates between the weights that generated a trained token and those it trains from"),
    ("off_policy", "the share of the trained tokens generated by an older policy"),
    ("first / final", "the metric's first and last logged value"),
    ("run", "the arm's MLflow run id (its first 12 characters)"),
)


def _compare_legend() -> list[str]:
    """``legend:`` then what each part of the compare table's row names means, wrapped."""
    term_w = max(len(term) for term, _ in _COMPARE_LEGEND)
    return ["legend:"] + [
        line
        for term, meaning in _COMPARE_LEGEND
        for line in _wrap(f"{term:<{term_w}}  {meaning}", indent="  ", hang=term_w + 2)
    ]


def _wrap(text: str, indent: str = "", hang: int = 2) -> list[str]:
    """``text`` wrapped to ``TABLE_COLUMNS``, continuation lines indented ``hang`` more spaces."""
    return textwrap.wrap(
        text,
        width=TABLE_COLUMNS,
        initial_indent=indent,
        subsequent_indent=indent + " " * hang,
        break_on_hyphens=False,
    )


def _column_blocks(first: int, widths: list[int]) -> list[list[int]]:
    """The arm columns (of ``widths``, each after two spaces) in blocks that fit in ``TABLE_COLUMNS``
    beside the ``first`` column; at least one arm per block."""
    blocks: list[list[int]] = [[]]
    used = first
    for i, w in enumerate(widths):
        if blocks[-1] and used + 2 + w > TABLE_COLUMNS:
            blocks.append([])
            used = first
        blocks[-1].append(i)
        used += 2 + w
    return blocks


def _share(a: ArmSummary, key: str) -> float | None:
    """Mean ``key`` seconds over mean step seconds (None without both)."""
    part, step = a.stage_mean_s.get(key), a.stage_mean_s.get(STEP_KEY)
    return part / step if part is not None and step else None


def _experiment_or_fail(client: MlflowClient, tracking_uri: str, experiment: str) -> str:
    exp = _lookup_experiment(client, tracking_uri, experiment)
    if exp is None:
        names = sorted(e.name for e in client.search_experiments(max_results=1000))
        raise ConfigError(
            f"experiment {experiment!r} does not exist at tracking_uri = {redact_uri(tracking_uri)!r}; "
            f"existing experiments: {', '.join(names) if names else '(none)'}"
        )
    if exp.lifecycle_stage == "deleted":
        raise _deleted_error(experiment)
    return str(exp.experiment_id)


def compare(tracking_uri: str, experiment: str, baseline: str = "sync") -> CompareReport:
    """Summarize every arm run of the experiment and its speedup over the baseline arm."""
    client = _client(tracking_uri)
    exp_id = _experiment_or_fail(client, tracking_uri, experiment)
    runs: dict[str, list[Any]] = {}
    for r in _search_all(client, exp_id):
        arm = r.data.tags.get(TAG_ARM)
        if arm:
            runs.setdefault(arm, []).append(r)
    if not runs:
        raise _no_arms_error(tracking_uri, experiment)
    notes: list[str] = []
    raw: dict[str, tuple[Any, dict[str, list[tuple[int, float]]]]] = {}
    for arm, rs in runs.items():
        run = _oldest(rs)
        if len(rs) > 1:
            notes.append(f"arm {arm!r} has {len(rs)} live runs; using the oldest, {run.info.run_id}")
        keys = (
            *STAGE_KEYS,
            STEP_KEY,
            BUBBLE_KEY,
            VAL_KEY,
            REWARD_KEY,
            LAG_KEY,
            OFF_POLICY_KEY,
            *TOKEN_KEYS,
            *COMPARE_KEYS,
        )
        raw[arm] = (run, {k: _series(client.get_metric_history(run.info.run_id, k)) for k in keys})

    def mean_of(arm: str, key: str) -> float | None:
        return _mean([v for _, v in raw[arm][1][key]])

    baseline = _baseline_arm(baseline, {arm: str(r.data.tags.get(TAG_POLICY)) for arm, (r, _) in raw.items()})
    base_step = mean_of(baseline, STEP_KEY) if baseline in raw else None
    base_roll = mean_of(baseline, "rollout/time_s") if baseline in raw else None
    if baseline not in raw:
        notes.append(
            f"baseline arm {baseline!r} is not in the experiment (arms: {', '.join(sorted(raw))}); "
            "speedups omitted; pass --baseline ARM"
        )

    def ratio(base: float | None, this: float | None) -> float | None:
        return base / this if base is not None and this else None

    arms: list[ArmSummary] = []
    order = sorted(raw, key=lambda a: (a != baseline, a))
    for arm in order:
        run, s = raw[arm]
        stage_mean = {k: mean_of(arm, k) for k in (*STAGE_KEYS, STEP_KEY)}
        steps = {st for k in (*STAGE_KEYS, STEP_KEY) for st, _ in s[k]}
        val = s[VAL_KEY]
        arms.append(
            ArmSummary(
                arm=arm,
                run_id=str(run.info.run_id),
                policy=str(run.data.tags.get(TAG_POLICY, arm)),
                steps=len(steps),
                stage_mean_s=stage_mean,
                bubble_ratio_mean=mean_of(arm, BUBBLE_KEY),
                speedup_step=ratio(base_step, stage_mean[STEP_KEY]),
                speedup_rollout=ratio(base_roll, stage_mean["rollout/time_s"]),
                val_accuracy_first=val[0][1] if val else None,
                val_accuracy_final=val[-1][1] if val else None,
                reward_mean_final=s[REWARD_KEY][-1][1] if s[REWARD_KEY] else None,
                policy_lag_mean=mean_of(arm, LAG_KEY),
                off_policy_frac_mean=mean_of(arm, OFF_POLICY_KEY),
                **_throughput(s),
                fidelity_mean={k: mean_of(arm, k) for k in COMPARE_KEYS},
            )
        )
    step_counts = {a.arm: a.steps for a in arms}
    if len(set(step_counts.values())) > 1:
        each = ", ".join(f"{arm} {n}" for arm, n in step_counts.items())
        notes.append(
            f"the arms ran different numbers of steps ({each}): each mean is over the arm's own steps"
        )
    return CompareReport(experiment, redact_uri(tracking_uri), baseline, arms, notes)


def _throughput(series: dict[str, list[tuple[int, float]]]) -> dict[str, float | None]:
    """``core.metrics.throughput`` over the steps that logged rollout seconds and every token count
    (none of the three fields where no step did: a run from before the counts were logged)."""
    by_key = {k: dict(series[k]) for k in ("rollout/time_s", *TOKEN_KEYS)}
    steps = set.intersection(*(set(v) for v in by_key.values()))
    if not steps:
        return {"output_tokens_per_s": None, "trained_tokens_per_s": None, "wasted_share": None}
    gen, trained, wasted = (int(sum(by_key[k][st] for st in steps)) for k in TOKEN_KEYS)
    t = throughput(gen, trained, wasted, sum(by_key["rollout/time_s"][st] for st in steps), len(steps))
    return {
        "output_tokens_per_s": t.output_tokens_per_s,
        "trained_tokens_per_s": t.trained_tokens_per_s,
        "wasted_share": t.wasted_share,
    }


def _baseline_arm(baseline: str, policies: dict[str, str]) -> str:
    """The arm named ``baseline``, else the one arm that runs the policy ``baseline`` (``train``
    names its arm ``<policy>-seed<seed>``), else ``baseline``."""
    same = [arm for arm, policy in policies.items() if policy == baseline]
    return same[0] if baseline not in policies and len(same) == 1 else baseline


def _no_arms_error(tracking_uri: str, experiment: str) -> ConfigError:
    tracking_uri = redact_uri(tracking_uri)
    return ConfigError(
        f"experiment {experiment!r} at tracking_uri = {tracking_uri!r} has no arm runs (runs tagged "
        f"{TAG_ARM}): nothing to compare, nothing logged. `rollpacker run --config CONFIG` runs every "
        "arm of a config (one MLflow run each) and compares them; `rollpacker train --config CONFIG "
        "--set rollout.policy=POLICY` adds one arm, <policy>-seed<seed>, to the config's experiment at "
        "its tracking_uri (default sqlite:///build/mlflow.db): compare those with "
        f"`rollpacker compare {experiment} --tracking-uri URI`"
    )


def render_compare_chart(report: CompareReport, path: Path) -> Path:
    """Bar chart: mean step time by stage per arm (stacked), mean step/time_s marked, speedup above."""
    fig = _figure(max(5.0, 2.0 + 1.6 * len(report.arms)), 4.8)
    ax = fig.add_subplot()
    if report.arms:
        xs = list(range(len(report.arms)))
        bottom = [0.0] * len(xs)
        for k in STAGE_KEYS:
            vals = [a.stage_mean_s.get(k) or 0.0 for a in report.arms]
            if any(vals):
                ax.bar(xs, vals, bottom=bottom, label=k, color=_STAGE_COLOURS[k], width=0.6)
                bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        tops = []
        for i, a in enumerate(report.arms):
            step = a.stage_mean_s.get(STEP_KEY)
            if step is not None:
                ax.hlines(step, i - 0.38, i + 0.38, colors="black", linewidth=2)
            top = max(bottom[i], step or 0.0)
            tops.append(top)
            label = f"{a.speedup_step:.2f}x" if a.speedup_step is not None else "-"
            ax.annotate(label, (i, top), xytext=(0, 4), textcoords="offset points", ha="center", fontsize=10)
        ax.plot([], [], color="black", linewidth=2, label=f"{STEP_KEY} mean")
        ax.set_xticks(xs, [a.arm for a in report.arms])
        ax.set_ylim(0, max(tops or [1.0]) * 1.18 or 1.0)
        ax.legend(fontsize=8, loc="upper right")
    else:
        _no_data(ax, "arm runs")
    ax.set(
        ylabel="mean seconds per step",
        title=f"{report.experiment}: step time by stage (speedup vs {report.baseline})",
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    _save(fig, path)
    return path


def log_compare(report: CompareReport, tracking_uri: str, experiment: str) -> str:
    """Write ``compare.json``, ``compare.md`` and ``compare.png`` to the experiment's ``compare`` run.

    The run (tag ``rollpacker.kind=compare``) is reused if it exists. Returns its id. A report
    without arms is refused (nothing is logged).
    """
    if not report.arms:
        raise _no_arms_error(tracking_uri, experiment)
    tracker = ExperimentTracker(tracking_uri, experiment)
    client = tracker.client
    runs = _search_all(client, tracker.experiment_id, f"tags.`{TAG_KIND}` = 'compare'")
    if runs:
        run_id = str(_oldest(runs).info.run_id)
    else:
        run_id = str(
            client.create_run(
                tracker.experiment_id, run_name="compare", tags={TAG_KIND: "compare"}
            ).info.run_id
        )
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "compare.json").write_text(report.to_json())
        (d / "compare.md").write_text(report.to_markdown())
        render_compare_chart(report, d / "compare.png")
        client.log_artifacts(run_id, str(d))
    with _env(MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT="true"):  # the CLI prints its own line
        client.set_terminated(run_id, "FINISHED")
    return run_id
