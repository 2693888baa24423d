"""``rollpacker lab whatif`` / ``lab profile`` and ``lab bench whatif`` / ``whatif-papers`` /
``planner``: the what-if simulator, the engine profiler and the planner benchmark."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated

import typer

from rollpacker.cli.common import Done, ReportOption, command, config_option, config_path, say, shown

from .groups import bench_app, lab_app
from .options import (
    ModelPreset,
    Policies,
    Preset,
    Seed,
    Shape,
    TraceFile,
    with_shape,
)


@command(lab_app, "whatif")
@with_shape(p0=16, r0=4, max_tokens=1024)
def whatif_cmd(
    shape: Shape,
    hardware: Annotated[
        str,
        typer.Option(
            help="Shipped accelerator (h100, h800, h200, a100), a spec YAML, or cpu-profile:<profile.json> "
            "(a measured `rollpacker lab profile`)."
        ),
    ] = "h800",
    model: Annotated[
        str | None,
        shown("Shipped model (qwen2.5-7b, -14b, -32b) or a spec YAML; needed with a roofline --hardware."),
    ] = None,
    tp: Annotated[int | None, shown("TP size of the policy comparison.", "every TP compared")] = None,
    gpus: Annotated[int | None, shown("Rollout devices (DP = gpus / TP).", "one node")] = None,
    preset: Preset = "paper-cpu",
    trace: TraceFile = None,
    mlflow_run: Annotated[
        str | None, shown("Take the trace from this MLflow run's recorded lengths.")
    ] = None,
    tracking_uri: Annotated[
        str, typer.Option(help="Tracking URI for --mlflow-run.")
    ] = "http://127.0.0.1:5000",
    concurrency: Annotated[
        int, typer.Option(help="Request slots per replica (max_num_seqs); 0 = every launched request.")
    ] = 0,
    periods: Annotated[int, typer.Option(help="Tail-batching periods per policy comparison.")] = 2,
    grid_periods: Annotated[int, typer.Option(help="Tail-batching periods per grid cell.")] = 1,
    grid_eta_p: Annotated[str, typer.Option(help="Grid: comma list of eta_p.")] = "1.0,1.25,1.5",
    grid_eta_r: Annotated[str, typer.Option(help="Grid: comma list of eta_r.")] = "1.0,1.25,1.5",
    grid_p0: Annotated[str, typer.Option(help="Grid: comma list of P0.", show_default="--p0 only")] = "",
    policies: Policies = "sync,tail_batching,sorted,sorted_partial,partial",
    seed: Seed = 0,
    out: Annotated[Path, typer.Option(help="JSON report path (the plot goes beside it, .png).")] = Path(
        "build/whatif.json"
    ),
) -> Done:
    """Predict each rollout policy's speedup on your model, GPUs and length distribution before
    spending them: the real policies on a simulated engine priced by a roofline or a measured
    profile; a grid over eta_p, eta_r, P0 and TP recommends settings (docs/whatif.md)."""
    from rollpacker.core.paths import writable_file
    from rollpacker.lab.bench.replay import bench_policies
    from rollpacker.lab.bench.whatif.report import plot, render
    from rollpacker.lab.bench.whatif.run import WhatIfConfig, parse_list, whatif, write_json

    out = writable_file(out)
    cfg = WhatIfConfig(
        **dataclasses.asdict(shape),
        concurrency=concurrency,
        periods=periods,
        grid_periods=grid_periods,
        policies=bench_policies(policies),
        eta_ps=parse_list(grid_eta_p, float, "--grid-eta-p"),
        eta_rs=parse_list(grid_eta_r, float, "--grid-eta-r"),
        p0s=parse_list(grid_p0, int, "--grid-p0"),
        seed=seed,
    )
    report = whatif(
        hardware, model, tp, gpus, cfg, (trace, preset, mlflow_run, tracking_uri), say("[whatif] ")
    )
    report["plot"] = str(plot(report, out.with_suffix(".png")))
    write_json(report, out)
    return Done(render(report), wrote=[out, report["plot"]])


@command(bench_app, "whatif")
@with_shape(p0=8, r0=4, max_tokens=512, eta=None)
def bench_whatif(
    shape: Shape,
    traces: Annotated[
        str, typer.Option(help="Validation traces, comma list of PRESET:SEED (none is used for fitting).")
    ] = "paper-cpu:1,paper-cpu:2",
    policies: Policies = "sync,tail_batching,sorted,partial",
    concurrency: Annotated[int, typer.Option(help="Engine concurrency limit (max_num_seqs).")] = 64,
    model: ModelPreset = "bench",
    out: ReportOption = Path("build/whatif-validation.json"),
) -> Done:
    """Validate the what-if simulator on the real vLLM engine: fit a profile (`rollpacker lab profile`'s
    measurement), then per trace simulate every policy on it and replay it for real; prints the
    error of rollout seconds per trained step per policy (docs/whatif.md)."""
    from rollpacker.core.paths import writable_file
    from rollpacker.lab.bench.replay import bench_policies
    from rollpacker.lab.bench.whatif.run import write_json
    from rollpacker.lab.bench.whatif.validate import WhatIfValidation, parse_traces, render, validate

    out = writable_file(out)
    vc = WhatIfValidation(
        model=model,
        traces=parse_traces(traces),
        p0=shape.p0,
        r0=shape.r0,
        max_tokens=shape.max_tokens,
        concurrency=concurrency,
        policies=bench_policies(policies),
    )
    report = validate(vc, say("[whatif] "))
    write_json(report, out)
    return Done(render(report), wrote=[out])


@command(bench_app, "whatif-papers")
def bench_whatif_papers(
    seed: Seed = 0,
    out: ReportOption = Path("build/whatif-papers.json"),
    only: Annotated[
        list[str] | None,
        shown(
            "Run one part only: rollpacker (RollPacker's cases) or sortedrl (SortedRL 4.4.1).", "both parts"
        ),
    ] = None,
) -> Done:
    """The what-if simulator on paper-like workloads (H800, Qwen2.5-7B/14B/32B, P0=128, R0=8,
    8k/16k/32k; SortedRL's 32B experiment on H100 with its sensitivity runs) beside RollPacker's
    and SortedRL's reported figures; prints Markdown tables."""
    from rollpacker.core.paths import writable_file
    from rollpacker.lab.bench.whatif.papers import PARTS, render_papers, run_papers
    from rollpacker.lab.bench.whatif.run import write_json

    out = writable_file(out)
    report = run_papers(say("[whatif] "), seed, tuple(only or PARTS))
    write_json(report, out)
    return Done(render_papers(report), wrote=[out])


@command(lab_app, "profile")
def profile_cmd(
    config: Annotated[str, config_option("model, engine, planner grid, task")] = "experiment",
    layouts: Annotated[str, shown("Layouts to profile, e.g. tp1dp2,tp2dp1.", "every TP of the node")] = "",
    held_out: Annotated[int, typer.Option(help="Held-out validation prompts decoded per layout.")] = 64,
    out: Annotated[Path, typer.Option(help="Profile JSON (the table and its validation).")] = Path(
        "build/profile.json"
    ),
) -> Done:
    """Profile each parallel layout (PAT's method: random prefixes of L tokens for B requests per
    replica, prefill timed, then a short decode window) over the planner's batch x context grid,
    then check the latency predictor on real decoding trajectories of held-out prompts. Writes the
    table as JSON and a plot next to it (docs/parallelism.md)."""
    from rollpacker.core.config import load_config
    from rollpacker.core.latency import ProfileTable
    from rollpacker.core.paths import writable_file
    from rollpacker.engines.profiler import plot_profile
    from rollpacker.lab.checks import check_engine_config
    from rollpacker.lab.profiling import profile_layouts, render_profile

    cfg = load_config(config_path(config))
    check_engine_config(cfg, layouts=True)
    out = writable_file(out)
    doc = profile_layouts(cfg, layouts, held_out, typer.echo)
    out.write_text(json.dumps(doc, indent=1))
    png = plot_profile(ProfileTable.from_dict(doc["table"], str(out)), out.with_suffix(".png"))
    return Done("\n" + render_profile(doc, str(out)), wrote=[out, png])


@command(bench_app, "planner")
@with_shape(p0=16, r0=4, max_tokens=1024, eta=None)
def bench_planner(
    shape: Shape,
    profile: Annotated[
        Path | None, shown("Profile JSON from `rollpacker lab profile`.", "none: profile now")
    ] = None,
    config: Annotated[str, config_option("model, engine, planner")] = "experiment",
    preset: Preset = "paper-cpu",
    trace: TraceFile = None,
    steps: Annotated[int, typer.Option(help="Tail-batching steps simulated per mode.")] = 12,
    real_steps: Annotated[int, typer.Option(help="Steps run on the real engines per mode (0: none).")] = 4,
    check_every: Annotated[int, typer.Option(help="Engine steps between switch decisions.")] = 16,
    constrained_kv: Annotated[
        int, typer.Option(help="KV tokens of a TP-1 replica (constrained scenario).")
    ] = 3_000,
    weights_share: Annotated[
        float, typer.Option(help="Share of a device the weights take at TP 1 (constrained scenario).")
    ] = 0.5,
    out: ReportOption = Path("build/bench-planner.json"),
) -> Done:
    """Fixed layouts vs the per-step planner (RollPacker) vs in-step switching (PAT) on the replay
    trace, in one run: simulated on the profile's predictor (measured and KV-constrained memory)
    and, with --real-steps, on this machine's real vLLM engines. Prints the table, writes JSON."""
    from rollpacker.core.config import RolloutConfig, load_config
    from rollpacker.core.paths import writable_file
    from rollpacker.lab.bench.planner import PlannerBenchConfig, render
    from rollpacker.lab.bench.replay import load_trace
    from rollpacker.lab.checks import check_engine_config
    from rollpacker.lab.profiling import planner_benchmark

    cfg = load_config(config_path(config))
    if profile is None or real_steps > 0:  # the layouts' engines start here
        check_engine_config(cfg, layouts=True)
    out = writable_file(out)
    engine = dataclasses.replace(
        cfg.engine, max_model_len=max(cfg.engine.max_model_len, shape.max_tokens + 160)
    )
    cfg = dataclasses.replace(cfg, engine=engine)
    records, source = load_trace(trace, preset, cfg.seed)
    bcfg = PlannerBenchConfig(
        rollout=RolloutConfig(
            prompts_per_step=shape.p0, responses_per_prompt=shape.r0, max_tokens=shape.max_tokens
        ),
        max_num_seqs=cfg.engine.max_num_seqs,
        steps=steps,
        real_steps=real_steps,
        check_every=check_every,
        switch_overhead_s=cfg.planner.switch_overhead_s,
        constrained_kv_tokens=constrained_kv,
        weights_share=weights_share,
        seed=cfg.seed,
    )
    report = planner_benchmark(cfg, records, source, bcfg, profile, typer.echo)
    out.write_text(json.dumps(report, indent=2, default=str))
    return Done("\n" + render(report), wrote=[out])
