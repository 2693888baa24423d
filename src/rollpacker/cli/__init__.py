"""The ``rollpacker`` command: the root and its groups, one module per group.

rollpacker train                                           # RL steps of the `default` config, to MLflow
rollpacker run                                             # the embedded experiment: every arm, kfp.local
rollpacker config list / rollpacker config show default    # the shipped configs, to start your own from
rollpacker trace generate --preset paper-cpu --out t.jsonl # write a preset's trace
rollpacker model build --preset bench                      # build (or find) a tiny model
rollpacker model warmup --config default                   # the supervised warm-up `train` uses (cached)
rollpacker sandbox run --code a.py --tests t.py --json     # a program and its tests in the jail
rollpacker up / rollpacker down                            # local S3 store, MLflow server, Ray head
rollpacker compile / rollpacker submit --host URL          # the KFP pipelines; upload, one run per arm
rollpacker lab --help                                      # the lab: benchmarks, what-if, profiling, soak...

``--config`` takes a YAML file or a shipped config by name (``rollpacker config list``), from any
directory. An expected failure (a bad input, a path that cannot be written, a service that does not
answer) prints one ``error:`` line and exits 2; ``rollpacker --debug ...`` shows the traceback.

Modules: ``common`` (the one command wrapper and shared options), ``run`` (train, run, compare),
``pipeline`` (compile, submit), ``services`` (up, down), ``config``, ``model`` (model, trace),
``sandbox``. The lab's group (``rollpacker.lab.cli``) is mounted by name in :data:`LAB` and loaded
only when one of its commands runs or is listed: the product never imports the lab.
"""

from __future__ import annotations

import copy
import importlib
import os
import sys
from typing import TYPE_CHECKING, Annotated

import typer
from typer.core import TyperGroup

from .common import failure
from .config import config_app
from .model import model_app, trace_app
from .pipeline import pipeline_app
from .run import run_app
from .sandbox import sandbox_app
from .services import services_app

if TYPE_CHECKING:
    from typer import _click  # typer vendors click; TyperGroup's methods are typed with it

# The lab's commands by name: "lab" is its group; the others are the spellings users knew before the
# lab had a group of its own (`rollpacker bench ...`, `rollpacker whatif`, ...), kept working, hidden.
LAB_MODULE = "rollpacker.lab.cli"
LAB = ("lab", "bench", "whatif", "profile", "soak", "chaos")


class Root(TyperGroup):
    """The root group: the product's commands, and the lab's mounted by name (see :data:`LAB`)."""

    def list_commands(self, ctx: _click.Context) -> list[str]:
        return [*super().list_commands(ctx), *LAB]

    def get_command(self, ctx: _click.Context, cmd_name: str) -> _click.Command | None:
        if cmd_name not in LAB:
            return super().get_command(ctx, cmd_name)
        lab = typer.main.get_group(importlib.import_module(LAB_MODULE).lab_app)
        cmd = copy.copy(lab if cmd_name == "lab" else lab.commands[cmd_name])
        cmd.name, cmd.hidden = cmd_name, cmd_name != "lab"
        return cmd


app = typer.Typer(
    cls=Root,
    help="rollpacker: tail batching and friends for synchronous on-policy RL post-training.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
for _commands in (run_app, pipeline_app, services_app):
    app.add_typer(_commands)
app.add_typer(config_app, name="config")
app.add_typer(model_app, name="model")
app.add_typer(trace_app, name="trace")
app.add_typer(sandbox_app, name="sandbox")
_debug = False


@app.callback()
def _root(
    debug: Annotated[
        bool, typer.Option("--debug", help="Show the traceback of a failure.", show_default="off")
    ] = False,
) -> None:
    """rollpacker: tail batching and friends for synchronous on-policy RL post-training.

    --config options take a YAML file or a shipped config by name (`rollpacker config list`).
    The lab's benchmarks, what-if simulator, profiler, soak and chaos runs: `rollpacker lab --help`.
    """
    global _debug
    _debug = debug


def main() -> None:
    """The console entry point: every failure that reaches here becomes one ``error:`` line."""
    try:
        app()
    except Exception as e:
        if _debug or os.environ.get("ROLLPACKER_DEBUG"):
            raise
        typer.secho(f"error: {failure(e)}", fg=typer.colors.RED, err=True)
        sys.exit(2)
