"""The checks a lab command that starts engines runs when its config loads, before any warm-up,
engine, log or output (tests/test_refusals.py walks them): the model against the config
(``tasks.models.check_model``, which the warm-up would run anyway) and the engines against this
machine (``engines.gpus``)."""

from __future__ import annotations

from rollpacker.core.config import ExperimentConfig
from rollpacker.engines.gpus import check_engine_machine
from rollpacker.tasks.models import check_model


def check_engine_config(cfg: ExperimentConfig, layouts: bool = False) -> None:
    """``ConfigError`` for a config whose model or engines this machine cannot take. ``layouts``: the
    command starts the planner's layouts (``planner.devices``), else the one engine of ``engine.*``."""
    check_model(cfg)
    check_engine_machine(cfg.engine, cfg.planner.devices if layouts else 0)
