"""``rollpacker model`` (tiny local models, their warm-up) and ``rollpacker trace`` (length traces)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from rollpacker.core.errors import RollpackerError

from .common import ConfigOption, Done, SetOption, command, config_path, parse_sets, shown

model_app = typer.Typer(help="Tiny local models (no downloads).", no_args_is_help=True)
trace_app = typer.Typer(help="Length traces for the replay benchmark.", no_args_is_help=True)


@command(trace_app, "generate")
def trace_generate(
    out: Annotated[Path, typer.Option(help="Where to write the JSON Lines trace.")],
    preset: Annotated[str, typer.Option(help="Generator preset.")] = "paper-cpu",
    seed: Annotated[int, typer.Option(help="Generator seed.")] = 0,
) -> Done:
    """Write a preset's seeded trace as JSON Lines (one prompt per line)."""
    from rollpacker.core.paths import writable_file
    from rollpacker.core.trace import PRESETS, generate

    if preset not in PRESETS:
        raise RollpackerError(f"unknown preset {preset!r}; use one of {sorted(PRESETS)}")
    out = writable_file(out)
    recs = generate(PRESETS[preset], seed=seed)
    out.write_text("".join(r.to_json() + "\n" for r in recs))
    return Done(wrote=[f"{len(recs)} prompts to {out}"])


@command(trace_app, "presets")
def trace_presets() -> Done:
    """List the trace presets and their length statistics."""
    from rollpacker.core.trace import PRESETS, generate, length_stats

    rows = []
    width = max(map(len, PRESETS))
    for name, p in PRESETS.items():
        st = length_stats(generate(p))
        rows.append(
            f"{name:<{width}} {p.num_prompts:>4} prompts x {p.responses_per_prompt} lengths; "
            f"max {st['max']:.0f} P75 {st['p75']:.0f} median {st['p50']:.0f}  {p.description}"
        )
    return Done("\n".join(rows))


@command(model_app, "build")
def model_build(
    preset: Annotated[str, typer.Option(help="Tiny-model preset.")] = "tiny",
    force: Annotated[bool, typer.Option(help="Rebuild even if cached.")] = False,
) -> Done:
    """Build a tiny Qwen2-architecture model + tokenizer locally (cached) and print its path."""
    from rollpacker.tasks.tiny_model import build_tiny_model, count_parameters

    path = build_tiny_model(preset, force=force)
    return Done(json.dumps({"path": str(path), "parameters": count_parameters(path)}))


@command(model_app, "warmup")
def model_warmup(
    config: ConfigOption = "default",
    set_: SetOption = [],  # noqa: B006 - typer needs a literal default
    steps: Annotated[int | None, shown("Supervised steps.", "the config's model.warmup_steps")] = None,
    preset: Annotated[str | None, shown("Tiny-model preset.", "the config's model.preset")] = None,
    force: Annotated[bool, typer.Option(help="Retrain even if cached.")] = False,
) -> Done:
    """Warm up the model `train` and `run` start from with this config (the same cache entry: run it
    once ahead, e.g. on a fresh machine) and print its path. The task's shape comes from the config."""
    from tqdm import tqdm

    from rollpacker.core.config import load_config
    from rollpacker.tasks.models import warmup_spec
    from rollpacker.tasks.warmup import warm_up

    overrides = parse_sets(set_)
    if steps is not None:
        overrides["model.warmup_steps"] = steps
    if preset is not None:
        overrides["model.preset"] = preset
    cfg = load_config(config_path(config), overrides)
    if cfg.model.model_dir or cfg.model.warmup_steps == 0:
        raise RollpackerError(
            f"{config}: model.model_dir is set or model.warmup_steps is 0: nothing to warm up "
            "(pass --steps N or a config whose model is warmed up)"
        )
    spec = warmup_spec(cfg)
    with tqdm(total=spec.steps, desc="warm-up", unit="step") as bar:

        def tick(_step: int, loss: float) -> None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}")

        path = warm_up(spec, force=force, progress=tick)
    return Done(json.dumps({"path": str(path), **json.loads((path / "warmup.json").read_text())}))


@command(model_app, "ship")
def model_ship(
    config: Annotated[
        list[str] | None,
        shown("A config whose warm-ups to ship (repeatable).", "experiment: the embedded default"),
    ] = None,
    out: Annotated[
        Path | None, shown("Where to write them.", "the package's rollpacker/models/shipped")
    ] = None,
    cache_dir: Annotated[
        Path | None,
        shown("Train in this cache directory (a warm-up already cached there is reused).", "a new empty one"),
    ] = None,
) -> Done:
    """Build the shipped models: run the config's warm-up recipes (the start model, the toy judge)
    with the project's own warm-ups, measure each on its validation set, and write them with their
    manifest (sha256 of each file, key, recipe, shapes, tokenizer, validation figure) as package data.
    A first run on a fresh machine then installs them into the model cache instead of training."""
    from tqdm import tqdm

    from rollpacker.tasks.ship import SHIPPED_CONFIGS, Recipe, ship
    from rollpacker.tasks.shipped import SHIPPED_ROOT

    bars: list[tqdm] = []

    def progress(r: Recipe):  # type: ignore[no-untyped-def]
        bars.append(tqdm(total=r.spec.steps, desc=r.name, unit="step"))
        return lambda _step, loss: (bars[-1].update(1), bars[-1].set_postfix(loss=f"{loss:.3f}"))

    dest = out or SHIPPED_ROOT
    try:
        entries = ship(tuple(config or SHIPPED_CONFIGS), dest, cache_dir, say=typer.echo, progress=progress)
    finally:
        for b in bars:
            b.close()
    size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    return Done(
        wrote=[
            f"{len(entries)} models ({', '.join(e.name for e in entries)}), {size / 1e6:.1f} MB, to {dest}"
        ]
    )
