"""``rollpacker lab soak`` / ``lab chaos``: long runs that watch for growth, and runs with faults."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from rollpacker.cli.common import (
    CONFIG_HELP,
    Done,
    ReportOption,
    SetOption,
    comma_list,
    command,
    config_path,
    parse_sets,
    say,
    shown,
)

from .groups import lab_app
from .options import (
    Seed,
)


@command(lab_app, "soak")
def soak_cmd(
    config: Annotated[str, typer.Option(help=CONFIG_HELP + " Made small (lab/bench/soak.py).")] = "default",
    steps: Annotated[int, typer.Option(help="RL steps to run (from step 0).")] = 200,
    services: Annotated[
        str, typer.Option(help="`inline`: services in this process; `ray`: Ray actors (`make up`).")
    ] = "inline",
    warmup: Annotated[int | None, shown("Steps before growth is measured.", "a quarter of --steps")] = None,
    max_growth_pct: Annotated[float, typer.Option(help="Growth after the warm-up that fails (%).")] = 5.0,
    set_: SetOption = [],  # noqa: B006 - typer needs a literal default
    out_dir: Annotated[Path, typer.Option(help="State, MLflow and logs of the soak.")] = Path("build/soak"),
    out: ReportOption = Path("build/soak.json"),
) -> Done:
    """Run N steps of a small config through the one step path and sample, after every step, each
    service process's RSS, threads and open fds and the object store's size; print the growth per
    100 steps (docs/operations.md, "Soak"). Exits 1 when a series grows past --max-growth-pct or a
    garbage-collected part of the store is not bounded."""
    from rollpacker.core.paths import writable_dir, writable_file
    from rollpacker.lab.bench.soak import check_soak, render, run_soak
    from rollpacker.logs import library_output_to

    check_soak(config_path(config), steps, out_dir, parse_sets(set_), services, warmup)  # before any output
    out = writable_file(out)
    out_dir = writable_dir(out_dir, "--out-dir")
    with library_output_to(out_dir / "soak.log"):
        report = run_soak(
            config_path(config),
            steps,
            out_dir,
            overrides=parse_sets(set_),
            services=services,
            warmup=warmup,
            max_growth_pct=max_growth_pct,
            say=say(),
        )
    d = report.to_dict()
    out.write_text(json.dumps(d, indent=1))
    grows = [r for r in d["growth"] if not r["holds"]]
    unbounded = [p for p, e in d["store"].items() if e.get("bounded") is False]
    note = f"(library output in {out_dir / 'soak.log'})"
    return Done(render(d), wrote=[out], note=note, code=1 if grows or unbounded else 0)


@command(lab_app, "chaos")
def chaos_cmd(
    steps: Annotated[int, typer.Option(help="RL steps per arm.")] = 30,
    faults: Annotated[int, typer.Option(help="Faults to inject (spread over the arms).")] = 12,
    seed: Seed = 0,
    arms: Annotated[str, typer.Option(help="Comma-separated arms (policies).")] = "sync,tail_batching",
    task: Annotated[str, typer.Option(help="Task (a code task hosts sandbox hangs).")] = "synthetic_code",
    kinds: Annotated[str, shown("Comma-separated fault kinds (lab/bench/chaos.py KINDS).", "all")] = "",
    retries: Annotated[int | None, shown("In-run retries per arm.", "2 per fault + 2")] = None,
    ref_runner: Annotated[str, typer.Option(help="Runner of the fault-free reference.")] = "inline",
    devices: Annotated[
        int,
        typer.Option(
            help="CPU devices of the rollout's engine layouts (planner.devices): each replica's vLLM "
            "engine core runs in a process of its own, which adds the engine-core kind. 0: one "
            "in-process engine."
        ),
    ] = 0,
    out_dir: Annotated[Path, typer.Option(help="Services, state, logs of the run.")] = Path("build/chaos"),
    out: ReportOption = Path("build/chaos.json"),
) -> Done:
    """Run an experiment with faults injected at seeded random points (SIGKILL of stage and service
    processes, an S3 restart, MLflow down for a step, a hung sandbox run), then check that every
    fault was recovered within the run, no prompt was lost or trained twice, the state matches a
    fault-free run, and nothing was left behind (docs/operations.md, "Chaos"). Exits 1 otherwise."""
    from rollpacker.core.paths import writable_dir, writable_file
    from rollpacker.lab.bench.chaos import check_chaos, render, run_chaos
    from rollpacker.logs import library_output_to

    check_chaos(steps, faults, seed, comma_list(arms), task, ref_runner, comma_list(kinds) or None, devices)
    out = writable_file(out)
    out_dir = writable_dir(out_dir, "--out-dir")
    with library_output_to(out_dir / "chaos.log"):
        report = run_chaos(
            steps,
            faults,
            seed,
            out_dir,
            arms=comma_list(arms),
            task=task,
            retries=retries,
            ref_runner=ref_runner,
            kinds=comma_list(kinds) or None,
            devices=devices,
            say=say(),
        )
    d = report.to_dict()
    out.write_text(json.dumps(d, indent=1))
    note = f"(library output in {out_dir / 'chaos.log'})"
    return Done(render(d), wrote=[out], note=note, code=0 if d["ok"] else 1)
