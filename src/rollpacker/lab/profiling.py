"""``rollpacker lab profile`` and ``bench planner``: the engines they measure, the profile, the report."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rollpacker.core.config import ExperimentConfig
from rollpacker.core.errors import ConfigError, RollpackerError
from rollpacker.core.latency import Layout, ProfileTable, layouts_for
from rollpacker.core.trace import TraceRecord
from rollpacker.core.types import Prompt
from rollpacker.engines.layout import EnginePool, node_devices
from rollpacker.engines.profiler import ProfileSpec, profile_and_check, table_rows
from rollpacker.lab.bench.planner import PlannerBenchConfig, run_planner_bench
from rollpacker.lab.bench.tables import legend, wrap
from rollpacker.tasks.models import task_data
from rollpacker.tasks.prepare import prepare_model


def parse_layouts(text: str) -> tuple[Layout, ...]:
    """``tp1dp2,tp2dp1`` -> the layouts; a clear error otherwise."""
    try:
        return tuple(
            Layout(int(x.split("dp")[0].removeprefix("tp")), int(x.split("dp")[1])) for x in text.split(",")
        )
    except (ValueError, IndexError):
        raise ConfigError(f"--layouts {text!r}: use names like tp1dp2,tp2dp1") from None


def layout_pool(cfg: ExperimentConfig, layouts: str, progress: Callable[[str], None]) -> EnginePool:
    """The warm engines of the requested layouts (default: every TP of the node) for the config's
    model (cached warm-up)."""
    pc = cfg.planner
    devices = node_devices()
    n = pc.devices or min(len(devices), pc.max_tp)
    if layouts:
        lays = parse_layouts(layouts)
        n = max(lay.devices for lay in lays)
    else:
        lays = layouts_for(n, pc.max_tp)
    if n > len(devices):
        raise RollpackerError(f"the layouts need {n} devices; this machine offers {len(devices)}")
    model = prepare_model(cfg)
    ecfg = dataclasses.replace(cfg.engine, model_dir=str(model))
    progress(f"starting {', '.join(lay.name for lay in lays)} on devices {','.join(devices[:n])}")
    pool = EnginePool(
        ecfg, lays, devices[:n], on_start=lambda lay, s: progress(f"{lay.name} up in {s:.1f} s")
    )
    pool.warm()
    return pool


def held_out(cfg: ExperimentConfig, model_dir: str, n: int) -> tuple[Prompt, ...]:
    """The first ``n`` validation prompts of the config's task."""
    t = cfg.task
    return task_data(t.name, t.seed, t.num_examples, t.val_size, model_dir, t.shape.items()).val_prompts[:n]


def profile_layouts(
    cfg: ExperimentConfig, layouts: str, n_held_out: int, progress: Callable[[str], None]
) -> dict[str, Any]:
    """``rollpacker lab profile``: start the layouts' engines, profile them over the planner's grid,
    check the predictor on real decoding of ``n_held_out`` held-out prompts; the profile document
    (``table``, ``validation``, ``seconds``, ``total_seconds`` with engine start-up)."""
    t0 = time.perf_counter()
    pool = layout_pool(cfg, layouts, progress)
    try:
        doc = profile_and_check(
            pool,
            ProfileSpec.for_planner(cfg.planner, pool.layouts, cfg.engine.max_num_seqs, cfg.seed),
            held_out(cfg, pool.cfg.model_dir, n_held_out),
            cfg.rollout.max_tokens,
            cfg.validation.temperature,
            progress=progress,
        )
    finally:
        pool.close()
    doc["total_seconds"] = time.perf_counter() - t0
    return doc


_PROFILE_LEGEND = (
    ("batch", "requests per replica (B)"),
    ("context", "tokens of the random prefix each request starts from (L)"),
    ("tokens", "mean context tokens per replica over the decode window (T)"),
    ("prefill ms", "milliseconds to prefill the batch's prefixes"),
    ("decode ms", "mean milliseconds of one decode step"),
)


def render_profile(doc: dict[str, Any], where: str) -> str:
    """The profile table and the predictor's error on held-out trajectories, as text."""
    table = ProfileTable.from_dict(doc["table"], where)
    hdr = f"{'layout':<8}  {'batch':>5}  {'context':>7}  {'tokens':>8}  {'prefill ms':>10}  {'decode ms':>9}"
    lines = [hdr, "-" * len(hdr)]
    for r in table_rows(table):
        lines.append(
            f"{r['layout']:<8}  {r['batch']:>5}  {r['context']:>7}  {r['tokens']:>8.0f}  "
            f"{r['prefill_ms']:>10.1f}  {r['decode_ms']:>9.2f}"
        )
    lines += legend(_PROFILE_LEGEND)
    for lay, e in doc["validation"].items():
        lines += wrap(
            f"{lay}: predicted vs measured decode on held-out trajectories: {e['window_mape']:.1%} "
            f"mean error per window ({e['steps']} steps), {e['total_error']:.1%} over the whole run"
        )
    lines.append(f"profiled in {doc['seconds']:.0f} s ({doc['total_seconds']:.0f} s with engine start-up)")
    return "\n".join(lines)


def planner_benchmark(
    cfg: ExperimentConfig,
    records: Sequence[TraceRecord],
    source: str,
    bench: PlannerBenchConfig,
    profile: Path | None,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    """``rollpacker lab bench planner``: the profile (``profile``'s table, or measured now on the
    layouts' engines), then fixed layouts vs the per-step plan vs PAT switching on the trace."""
    if profile is not None and not profile.is_file():
        raise ConfigError(f"--profile {profile}: no such file; write one with `rollpacker lab profile`")
    pool = layout_pool(cfg, "", progress) if profile is None or bench.real_steps > 0 else None
    try:
        if profile is None:
            if pool is None:
                raise RollpackerError("no engines to profile")
            spec = ProfileSpec.for_planner(cfg.planner, pool.layouts, cfg.engine.max_num_seqs, cfg.seed)
            doc = profile_and_check(
                pool, spec, held_out(cfg, pool.cfg.model_dir, 64), cfg.rollout.max_tokens, progress=progress
            )
            table = ProfileTable.from_dict(doc["table"], "profile")
        else:
            doc = json.loads(profile.read_text())
            table = ProfileTable.from_dict(doc.get("table", doc), str(profile))
        return run_planner_bench(table, records, bench, source, real_pool=pool, progress=progress)
    finally:
        if pool is not None:
            pool.close()
