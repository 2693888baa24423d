"""``rollpacker lab whatif`` / ``lab profile`` and ``lab bench whatif`` / ``whatif-papers`` /
``planner``: the what-if simulator, the engine profiler and the planner benchmark."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated

import typer

from rollpacker.cli.common import Done, ReportOption, command, config_path, say

from .groups import bench_app, lab_app

TraceOption = Annotated[
    Path | None, typer.Option(help="JSON Lines trace file; overrides --preset.", show_default="none")
]
P0Option = Annotated[int, typer.Option("--p0", help="P0: prompts trained per step.")]
R0Option = Annotated[int, typer.Option("--r0", help="R0: responses per prompt.")]


@command(lab_app, "whatif")
def whatif_cmd(
    hardware: Annotated[
        str,
        typer.Option(
            help="Shipped accelerator (h100, h800, h200, a100), a spec YAML, or cpu-profile:<profile.json> "
            "(a measured `rollpacker lab profile`)."
        ),
    ] = "h800",
    model: Annotated[
        str | None,
        typer.Option(
            help="Shipped model (qwen2.5-7b, -14b, -32b) or a spec YAML; needed with a roofline --hardware.",
            show_default="none",
        ),
    ] = None,
    tp: Annotated[
        int | None, typer.Option(help="TP size of the policy comparison.", show_default="every TP compared")
    ] = None,
    gpus: Annotated[
        int | None, typer.Option(help="Rollout devices (DP = gpus / TP).", show_default="one node")
    ] = None,
    preset: Annotated[
        str, typer.Option(help="Trace preset (`rollpacker trace presets`, or paper-8k/16k/32k).")
    ] = "paper-cpu",
    trace: TraceOption = None,
    mlflow_run: Annotated[
        str | None,
        typer.Option(help="Take the trace from this MLflow run's recorded lengths.", show_default="none"),
    ] = None,
    tracking_uri: Annotated[
        str, typer.Option(help="MLflow tracking URI for --mlflow-run.")
    ] = "http://127.0.0.1:5000",
    p0: P0Option = 16,
    r0: R0Option = 4,
    eta_p: Annotated[float, typer.Option(help="Prompt speculation factor of the comparison.")] = 1.25,
    eta_r: Annotated[float, typer.Option(help="Response speculation factor of the comparison.")] = 1.25,
    max_tokens: Annotated[int, typer.Option(help="Max response length.")] = 1024,
    concurrency: Annotated[
        int, typer.Option(help="Request slots per replica (max_num_seqs); 0 = every launched request.")
    ] = 0,
    periods: Annotated[int, typer.Option(help="Tail-batching periods per policy comparison.")] = 2,
    grid_periods: Annotated[int, typer.Option(help="Tail-batching periods per grid cell.")] = 1,
    grid_eta_p: Annotated[str, typer.Option(help="Grid: comma list of eta_p.")] = "1.0,1.25,1.5",
    grid_eta_r: Annotated[str, typer.Option(help="Grid: comma list of eta_r.")] = "1.0,1.25,1.5",
    grid_p0: Annotated[str, typer.Option(help="Grid: comma list of P0.", show_default="--p0 only")] = "",
    policies: Annotated[
        str, typer.Option(help="Comma list of policies (sync and tail_batching always run).")
    ] = "sync,tail_batching,sorted,sorted_partial,partial",
    seed: Annotated[int, typer.Option(help="Seed of the preset trace.")] = 0,
    out: Annotated[Path, typer.Option(help="JSON report path (the plot goes beside it, .png).")] = Path(
        "build/whatif.json"
    ),
) -> Done:
    """Predict each rollout policy's speedup on your model, GPUs and length distribution before
    spending them: the real policies on a simulated engine priced by a roofline or a measured
    profile; a grid over eta_p, eta_r, P0 and TP recommends settings (docs/whatif.md)."""
    from rollpacker.bench.replay import bench_policies
    from rollpacker.bench.whatif.report import plot, render
    from rollpacker.bench.whatif.run import WhatIfConfig, parse_list, whatif, write_json
    from rollpacker.core.paths import writable_file

    out = writable_file(out)
    cfg = WhatIfConfig(
        p0=p0,
        r0=r0,
        eta_p=eta_p,
        eta_r=eta_r,
        max_tokens=max_tokens,
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
def bench_whatif(
    traces: Annotated[
        str, typer.Option(help="Validation traces, comma list of PRESET:SEED (none is used for fitting).")
    ] = "paper-cpu:1,paper-cpu:2",
    policies: Annotated[str, typer.Option(help="Comma list of policies to validate.")] = (
        "sync,tail_batching,sorted,partial"
    ),
    p0: P0Option = 8,
    r0: R0Option = 4,
    max_tokens: Annotated[int, typer.Option(help="Max response length (traced lengths are clipped).")] = 512,
    concurrency: Annotated[int, typer.Option(help="Engine concurrency limit (max_num_seqs).")] = 64,
    model: Annotated[str, typer.Option(help="Tiny-model preset of the real engine.")] = "bench",
    out: ReportOption = Path("build/whatif-validation.json"),
) -> Done:
    """Validate the what-if simulator on the real vLLM engine: fit a profile (`rollpacker lab profile`'s
    measurement), then per trace simulate every policy on it and replay it for real; prints the
    error of rollout seconds per trained step per policy (docs/whatif.md)."""
    from rollpacker.bench.replay import bench_policies
    from rollpacker.bench.whatif.run import write_json
    from rollpacker.bench.whatif.validate import ValidationConfig, parse_traces, render, validate
    from rollpacker.core.paths import writable_file

    out = writable_file(out)
    vc = ValidationConfig(
        model=model,
        traces=parse_traces(traces),
        p0=p0,
        r0=r0,
        max_tokens=max_tokens,
        concurrency=concurrency,
        policies=bench_policies(policies),
    )
    report = validate(vc, say("[whatif] "))
    write_json(report, out)
    return Done(render(report), wrote=[out])


@command(bench_app, "whatif-papers")
def bench_whatif_papers(
    seed: Annotated[int, typer.Option(help="Seed of the paper-like traces.")] = 0,
    out: ReportOption = Path("build/whatif-papers.json"),
    only: Annotated[
        list[str] | None,
        typer.Option(
            help="Run one part only: rollpacker (RollPacker's cases) or sortedrl (SortedRL 4.4.1).",
            show_default="both parts",
        ),
    ] = None,
) -> Done:
    """The what-if simulator on paper-like workloads (H800, Qwen2.5-7B/14B/32B, P0=128, R0=8,
    8k/16k/32k; SortedRL's 32B experiment on H100 with its sensitivity runs) beside RollPacker's
    and SortedRL's reported figures; prints Markdown tables."""
    from rollpacker.bench.whatif.papers import PARTS, render_papers, run_papers
    from rollpacker.bench.whatif.run import write_json
    from rollpacker.core.paths import writable_file

    out = writable_file(out)
    report = run_papers(say("[whatif] "), seed, tuple(only or PARTS))
    write_json(report, out)
    return Done(render_papers(report), wrote=[out])


@command(lab_app, "profile")
def profile_cmd(
    config: Annotated[
        str, typer.Option(help="Experiment YAML: model, engine, planner grid, task; NAME: shipped.")
    ] = "experiment",
    layouts: Annotated[
        str,
        typer.Option(help="Layouts to profile, e.g. tp1dp2,tp2dp1.", show_default="every TP of the node"),
    ] = "",
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
    from rollpacker.profiling import profile_layouts, render_profile

    out = writable_file(out)
    doc = profile_layouts(load_config(config_path(config)), layouts, held_out, typer.echo)
    out.write_text(json.dumps(doc, indent=1))
    png = plot_profile(ProfileTable.from_dict(doc["table"], str(out)), out.with_suffix(".png"))
    return Done("\n" + render_profile(doc, str(out)), wrote=[out, png])


@command(bench_app, "planner")
def bench_planner(
    profile: Annotated[
        Path | None,
        typer.Option(help="Profile JSON from `rollpacker lab profile`.", show_default="none: profile now"),
    ] = None,
    config: Annotated[
        str, typer.Option(help="Experiment YAML (model, engine, planner); NAME: shipped.")
    ] = "experiment",
    preset: Annotated[str, typer.Option(help="Trace preset (see `rollpacker trace presets`).")] = "paper-cpu",
    trace: TraceOption = None,
    steps: Annotated[int, typer.Option(help="Tail-batching steps simulated per mode.")] = 12,
    real_steps: Annotated[int, typer.Option(help="Steps run on the real engines per mode (0: none).")] = 4,
    p0: P0Option = 16,
    r0: R0Option = 4,
    max_tokens: Annotated[int, typer.Option(help="Max response length.")] = 1024,
    check_every: Annotated[int, typer.Option(help="Engine steps between switch decisions.")] = 16,
    constrained_kv: Annotated[
        int, typer.Option(help="KV tokens of a TP-1 replica in the memory-constrained scenario.")
    ] = 3_000,
    weights_share: Annotated[
        float, typer.Option(help="Share of a device the weights take at TP 1 (constrained scenario).")
    ] = 0.5,
    out: ReportOption = Path("build/bench-planner.json"),
) -> Done:
    """Fixed layouts vs the per-step planner (RollPacker) vs in-step switching (PAT) on the replay
    trace, in one run: simulated on the profile's predictor (measured and KV-constrained memory)
    and, with --real-steps, on this machine's real vLLM engines. Prints the table, writes JSON."""
    from rollpacker.bench.planner import PlannerBenchConfig, render
    from rollpacker.bench.replay import load_trace
    from rollpacker.core.config import RolloutConfig, load_config
    from rollpacker.core.paths import writable_file
    from rollpacker.profiling import planner_benchmark

    out = writable_file(out)
    cfg = load_config(config_path(config))
    engine = dataclasses.replace(cfg.engine, max_model_len=max(cfg.engine.max_model_len, max_tokens + 160))
    cfg = dataclasses.replace(cfg, engine=engine)
    records, source = load_trace(trace, preset, cfg.seed)
    bcfg = PlannerBenchConfig(
        rollout=RolloutConfig(prompts_per_step=p0, responses_per_prompt=r0, max_tokens=max_tokens),
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
