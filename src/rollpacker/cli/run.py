"""``rollpacker train`` / ``run`` / ``compare``: RL steps on this machine, whole experiments, and
the comparison of their arms in MLflow."""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Annotated

import typer

from rollpacker.core.errors import RunExistsError
from rollpacker.core.types import Runner

from .common import (
    CONFIG_HELP,
    NO_OVERRIDES,
    Done,
    command,
    config_option,
    config_path,
    flag,
    mlflow_look,
    parse_sets,
    shown,
)

run_app = typer.Typer()


@command(run_app, "train")
def train(
    config: Annotated[str, typer.Option(help=CONFIG_HELP + " docs/training.md.")] = "default",
    set_: Annotated[
        list[str],
        typer.Option(
            "--set", help="Override a key: --set rollout.policy=sync (repeatable).", show_default=NO_OVERRIDES
        ),
    ] = [],  # noqa: B006 - typer needs a literal default
    resume: Annotated[bool, typer.Option(help="Continue the run from its last committed step.")] = False,
    fresh: Annotated[bool, typer.Option(help="Delete the run's committed steps and start over.")] = False,
) -> Done:
    """Run N RL steps of one policy on this machine through the same stages as the pipeline
    (services in this process, no KFP, no Ray): rollout on vLLM, rewards during rollout, the stream
    trainer's one update per step, weights pushed in place. The state goes to the config's store
    (default: <out_dir>/store), metrics and plots to MLflow (default: a SQLite file)."""
    from rollpacker.experiment import train_arm, train_config
    from rollpacker.logs import library_output_to, log_path

    try:
        text, cfg = train_config(config_path(config), parse_sets(set_))
        with library_output_to(log_path(cfg, cfg.arm_names[0])):
            s = train_arm(text, resume=resume, fresh=fresh)
    except RunExistsError as e:  # the exact commands that continue it and start it over
        again = shlex.join(
            ["rollpacker", "train", "--config", config, *(a for v in set_ for a in ("--set", v))]
        )
        raise RunExistsError(
            f"{e}\n  continue it:     {again} --resume\n  start it over:   {again} --fresh"
        ) from e
    first_last = (s.val_accuracy[0], s.val_accuracy[-1]) if s.val_accuracy else ()
    val = " -> ".join(f"{a:.3f} (step {st})" for st, a in first_last) or "-"
    once = s.exactly_once
    return Done(
        f"done: {s.steps} steps ({s.steps_run} now), {s.trained_samples} samples, validation accuracy {val}, "
        f"{s.wall_s:.0f} s\n"
        f"exactly once: {once.prompts_trained} prompts trained, {len(once.trained_twice)} twice, "
        f"{len(once.deferred_lost)} lost, {once.waiting} waiting\n"
        f"MLflow run {s.run_id} (experiment {cfg.experiment!r}); look: {mlflow_look(cfg.tracking_uri)}\n"
        f"state: {s.store_uri}"
    )


@command(run_app, "run")
def run_cmd(
    config: Annotated[str, config_option("arms, store, services, task, ...")] = "experiment",
    runner: Annotated[
        Runner,
        typer.Option(
            help="`kfp`: each step a kfp.local pipeline run, services in Ray; `inline`: "
            "the same stages in this process (quick debugging)."
        ),
    ] = Runner.KFP,
    arm: Annotated[list[str] | None, shown("Run only this arm (repeatable).", "every arm")] = None,
    retries: Annotated[int, typer.Option(help="Re-runs of an arm after a failed step.")] = 1,
    fresh: Annotated[bool, typer.Option(help="Delete the arms' committed state and start over.")] = False,
    no_services: Annotated[
        bool, flag("--no-services", "Do not start the local S3 / MLflow / Ray services.")
    ] = False,
) -> Done:
    """Run an experiment: every arm's remaining RL steps through the pipeline, then `compare`.

    On an experiment that already has committed steps it continues from the last one. The local
    services (SeaweedFS S3, MLflow server, Ray head) are started when the config points at
    127.0.0.1 and none runs, and stopped again at the end.
    """
    from rollpacker.experiment import check_experiment, run_experiment
    from rollpacker.logs import library_output_to, log_path

    # every refusal that needs no service comes before the log opens: it leaves nothing
    path, cfg, _ = check_experiment(config_path(config), runner, arm or None)
    with library_output_to(log_path(cfg, "run")):
        out = run_experiment(
            path,
            runner=runner,
            arms=arm or None,
            retries=retries,
            start_services=not no_services,
            fresh=fresh,
        )
    ui = mlflow_look(out.tracking_uri)
    return Done(
        f"{out.compare_table}\n\nMLflow: {ui}  (experiment {out.experiment}; `make mlflow-ui` to browse it)"
    )


@command(run_app, "compare")
def compare_cmd(
    experiment: Annotated[str, typer.Argument(help="MLflow experiment (the config's `experiment`).")],
    tracking_uri: Annotated[
        str | None,
        typer.Option(
            help="MLflow tracking URI.", show_default="$MLFLOW_TRACKING_URI or http://127.0.0.1:5000"
        ),
    ] = None,
    baseline: Annotated[str, typer.Option(help="Arm the speedups are measured against.")] = "sync",
    out: Annotated[Path | None, shown("Also write the comparison as JSON here.", "not written")] = None,
) -> Done:
    """Compare the arms (one MLflow run per rollout policy) of an experiment: mean seconds per
    stage, speedup over the baseline, bubble ratio, accuracy; logs the table and a chart to the
    experiment's `compare` run."""
    from rollpacker.core.paths import writable_file
    from rollpacker.tracking import compare, log_compare

    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or "http://127.0.0.1:5000"
    out = writable_file(out) if out is not None else None
    report = compare(uri, experiment, baseline=baseline)
    run_id = log_compare(report, uri, experiment)
    if out is not None:
        out.write_text(report.to_json())
    logged = f"\nlogged compare.json, compare.md, compare.png to MLflow run {run_id}"
    return Done(report.render() + logged, wrote=[out] if out is not None else [])
