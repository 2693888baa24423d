"""``rollpacker compile`` / ``submit``: the KFP pipelines, compiled and sent to a KFP server."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from .common import Done, SetOption, command, config_option, config_path, parse_sets, shown

pipeline_app = typer.Typer()


@command(pipeline_app, "compile")
def compile_cmd(
    out: Annotated[Path, typer.Option(help="Directory for rl_step.yaml and rl_experiment.yaml.")] = Path(
        "build"
    ),
    steps: Annotated[int | None, shown("RL steps chained in rl_experiment.", "the config's `steps`")] = None,
    config: Annotated[str, config_option("its `steps` is the default")] = "experiment",
) -> Done:
    """Compile the KFP pipelines (rl_step: one RL step; rl_experiment: N steps chained) to YAML for
    the KFP UI or API. It prints the steps chained and the images baked in (components/images.py;
    ROLLPACKER_IMAGE_<NAME>=... overrides one)."""
    from rollpacker.core.paths import writable_dir
    from rollpacker.pipeline_compile import compile_pipelines, images_in_use, steps_from_config

    out = writable_dir(out)
    source = f"--steps {steps}"
    if steps is None:
        cfg_path = config_path(config)
        steps = steps_from_config(cfg_path)
        source = f"`steps` of {cfg_path}"
    paths = compile_pipelines(out, steps)
    images = ", ".join(f"{name} {ref}" for name, ref in images_in_use().items())
    wrote = "\n".join(f"wrote {p}" for p in paths)
    return Done(f"{wrote}\nrl_experiment chains {steps} steps ({source})\nimages: {images}")


@command(pipeline_app, "submit")
def submit_cmd(
    host: Annotated[
        str, typer.Option(help="The KFP API's URL, e.g. http://localhost:8888 (a port-forward).")
    ],
    experiment: Annotated[str, shown("KFP experiment.", "the config's `experiment`")] = "",
    steps: Annotated[int | None, shown("RL steps chained in the run.", "the config's `steps`")] = None,
    config: Annotated[
        str,
        typer.Option(
            help="Experiment YAML the runs get: a file or a shipped name (`cluster`: Qwen2.5-7B, "
            "manifests/experiment.yaml)."
        ),
    ] = "cluster",
    arm: Annotated[list[str], typer.Option(help="Arm to run (repeatable).", show_default="every arm")] = [],  # noqa: B006
    set_: SetOption = [],  # noqa: B006 - typer needs a literal default
    namespace: Annotated[
        str, shown("KFP namespace (multi-user KFP's profile).", "none: single-user KFP")
    ] = "",
    service_account: Annotated[str, typer.Option(help="Service account the runs' pods use.")] = (
        "rollpacker-pipeline"
    ),
    pipeline_name: Annotated[
        str, typer.Option(help="KFP pipeline to upload to.")
    ] = "rollpacker-rl-experiment",
    out: Annotated[Path, typer.Option(help="Where the compiled YAML goes.")] = Path("build"),
) -> None:
    """Compile rl_experiment, upload it to a Kubeflow Pipelines server and start one run per arm
    (credentials: $KFP_TOKEN if the server wants a bearer token). docs/operations.md."""
    from rollpacker.core.paths import writable_dir
    from rollpacker.submit import submit

    submit(
        host,
        config_path(config),
        overrides=parse_sets(set_),
        experiment=experiment,
        steps=steps,
        arms=arm,
        pipeline_name=pipeline_name,
        namespace=namespace,
        service_account=service_account,
        out_dir=writable_dir(out, make=False),  # made by the compile: a refused submit leaves none
        token=os.environ.get("KFP_TOKEN", ""),
        log=typer.echo,
    )
