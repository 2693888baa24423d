"""``rollpacker lab bench rollout-replay`` / ``rollout-task``: the rollout policies on the real engine."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from rollpacker.cli.common import (
    Done,
    SetOption,
    command,
    config_option,
    config_path,
    fail,
    parse_sets,
    say,
    shown,
)

from .groups import bench_app
from .options import (
    EngineSlots,
    KvCacheGib,
    ModelPreset,
    Periods,
    Preset,
    Seed,
    Shape,
    TraceFile,
    with_shape,
)

REPLAY_POLICIES = "sync,tail_batching,sorted,sorted_partial,partial"
TASK_ARMS = "sync,tail_batching,tail_batching+spec,partial+spec"
TASK_ARMS_HELP = (
    f"Comma list of arms, of {TASK_ARMS},sync+spec (sync and tail_batching always run; sync+spec: "
    "sync with drafts, paired with sync)."
)


@command(bench_app, "rollout-replay")
@with_shape(p0=16, r0=4, max_tokens=1024)
def rollout_replay(
    shape: Shape,
    preset: Preset = "paper-cpu",
    trace: TraceFile = None,
    out: Annotated[Path | None, shown("Write the full report as JSON here.", "not written")] = None,
    concurrency: EngineSlots = 128,
    kv_cache_gib: KvCacheGib = 2,
    periods: Periods = 4,
    model: ModelPreset = "bench",
    engine: Annotated[
        str, typer.Option(help="`vllm` (real engine) or `fake` (simulated, for dry runs).")
    ] = "vllm",
    seed: Seed = 0,
    policies: Annotated[
        str,
        typer.Option(
            help="Comma list of arms: sync, tail_batching, sorted, sorted_partial, partial "
            "(sync and tail_batching always run: they are the baseline)."
        ),
    ] = REPLAY_POLICIES,
    group_size: Annotated[int, typer.Option(help="SortedRL group size n (update batches buffered).")] = 4,
    scaledown_replicas: Annotated[
        int, typer.Option(help="DP replicas of the rollout for Algorithm 1's scale-down report (0 = off).")
    ] = 4,
    scaledown_kv_tokens: Annotated[
        int | None,
        shown(
            "KV capacity per replica in tokens, for the scale-down report.",
            "the engine's, estimated, / replicas",
        ),
    ] = None,
) -> Done:
    """Compare the rollout policies on the real engine, replaying a length trace.

    Every response is decoded at its traced length (ignore_eos, max_tokens = length), so the
    scheduling effect is measured on real decoding. Compares sync, tail batching, SortedRL
    (on-policy and partial modes) and async partial rollout on the same trace; reports rollout
    seconds per trained step, speedup vs sync, bubble ratio (SortedRL eq. 4, beside the SortedRL
    paper's figures), off-policy lag, rollout efficiency and token waste, plus the engine's
    batch-scaling curve measured in the same run.
    """
    from rollpacker.core.config import EngineConfig, SortedConfig
    from rollpacker.core.paths import writable_file
    from rollpacker.engines.gpus import check_engine_machine
    from rollpacker.lab.bench.replay import (
        BenchConfig,
        bench_policies,
        load_trace,
        make_engine,
        render_table,
        run_benchmark,
        write_report,
    )

    if engine == "vllm":  # the replay's engine (vLLM's device, TP 1) against this machine, first
        check_engine_machine(EngineConfig())
    out = writable_file(out) if out is not None else None
    cfg = BenchConfig(
        rollout=shape.rollout(sorted=SortedConfig(group_size=group_size)),
        periods=periods,
        seed=seed,
        policies=bench_policies(policies),
        scaledown_replicas=scaledown_replicas,
        scaledown_replica_kv_tokens=scaledown_kv_tokens,
    )
    records, source = load_trace(trace, preset, seed)
    longest_prompt = max(r.prompt_len for r in records)
    eng = make_engine(engine, model, concurrency, kv_cache_gib, longest_prompt + shape.max_tokens + 8, seed)
    try:
        report = run_benchmark(eng, records, cfg, source=source, progress=progress(), log=say("[bench] "))
    finally:
        eng.close()
    report["engine"] = {"kind": engine, "model": model}
    if out is not None:
        write_report(report, out)
    return Done(render_table(report) + ("\n" if out is not None else ""), wrote=[out] if out else [])


@command(bench_app, "rollout-task")
def rollout_task(
    config: Annotated[str, config_option("task, model, rollout, engine")] = "experiment",
    arms: Annotated[str, typer.Option(help=TASK_ARMS_HELP)] = TASK_ARMS,
    periods: Periods = 4,
    tail_batch: Annotated[
        int, typer.Option(help="Engine steps with at most this many requests running: the tail.")
    ] = 16,
    repeats: Annotated[
        int,
        typer.Option(
            help="Run every arm this many times, in ABBA order (A B | B A | A B ...), so that a drift in "
            "the machine's load weighs on both sides; the report gives per arm the median and range, "
            "and the ratios paired per repeat."
        ),
    ] = 1,
    set_: SetOption = [],  # noqa: B006 - typer needs a literal default
    out: Annotated[Path, typer.Option(help="JSON report path.")] = Path("build/bench-rollout-task.json"),
) -> Done:
    """Compare the rollout policies on the real engine and the config's task: its warmed-up model,
    sampled as RL samples, so that speculative drafts meet real content. Sync, tail batching, tail
    batching + speculation and partial rollout + speculation on the same prompts (`--periods`
    tail-batching periods, `--repeats` times in ABBA order); rollout seconds per trained step,
    tokens per second in the tail, draft acceptance per source and per draft position, the lossless
    check of the speculative arm's samples, the load average at each run (docs/speculation.md)."""
    from rollpacker.core.config import load_config
    from rollpacker.core.paths import writable_file
    from rollpacker.lab.bench.task_rollout import (
        TaskBenchOptions,
        render,
        run_task_rollout_bench,
        task_arms,
        write,
    )
    from rollpacker.lab.checks import check_engine_config
    from rollpacker.logs import library_output_to, log_path

    opts = TaskBenchOptions(task_arms(arms), periods=periods, tail_batch=tail_batch, repeats=repeats)
    cfg = load_config(config_path(config), parse_sets(set_))
    check_engine_config(cfg)
    out = writable_file(out)
    with library_output_to(log_path(cfg, "bench-rollout-task")):
        report = run_task_rollout_bench(cfg, opts, progress=progress(), log=say("[bench] "))
    write(report, out)
    return Done(render(report), wrote=[out])


@command(
    bench_app,
    "rollout",
    hidden=True,
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def rollout_split(ctx: typer.Context) -> None:
    """Split into `bench rollout-replay` and `bench rollout-task`."""
    args = list(ctx.args)
    mode = next((a.split("=", 1)[1] for a in args if a.startswith("--mode=")), None)
    if "--mode" in args and args.index("--mode") + 1 < len(args):
        mode = args[args.index("--mode") + 1]
    new = "rollout-task" if mode == "task" else "rollout-replay"
    rest = [a for i, a in enumerate(args) if a != "--mode" and (i == 0 or args[i - 1] != "--mode")]
    rest = [a for a in rest if not a.startswith("--mode=")]
    raise fail(
        "`bench rollout` is now two commands: `rollpacker lab bench rollout-replay` (was --mode "
        "replay, the default) and `rollpacker lab bench rollout-task` (was --mode task); run: "
        f"rollpacker lab bench {new} {' '.join(rest)}".rstrip()
    )


def progress() -> Callable[[str, Any], None]:
    """A progress bar per policy on stderr, one tick per step."""
    from tqdm import tqdm

    bars: dict[str, tqdm] = {}

    def on(policy: str, m: Any) -> None:
        bar = bars.get(policy)
        if bar is None:
            bar = bars[policy] = tqdm(desc=f"{policy:>14}", unit="step", file=sys.stderr, leave=True)
        bar.update(1)
        bar.set_postfix(kind=m.round_kind, s=f"{m.time_s:.1f}", max_len=m.response_len_max)

    return on
