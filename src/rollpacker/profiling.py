"""The engines that ``rollpacker profile`` and ``bench planner`` measure, and their held-out prompts."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from rollpacker.core.config import ExperimentConfig
from rollpacker.core.errors import ConfigError, RollpackerError
from rollpacker.core.latency import Layout, layouts_for
from rollpacker.core.types import Prompt
from rollpacker.engines.layout import EnginePool, node_devices
from rollpacker.tasks.models import prepare_model, task_data


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
    return task_data(t.name, t.seed, t.num_examples, t.val_size, model_dir).val_prompts[:n]
