"""Every config shipped in configs/ parses and validates (a typo there breaks a user's first run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollpacker.loop.runner import load_config

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))


def test_there_are_configs() -> None:
    assert {p.name for p in CONFIGS} >= {"experiment.yaml", "planner.yaml", "default.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_loads(path: Path) -> None:
    cfg = load_config(path)
    if cfg.planner.devices:
        assert cfg.planner.max_tp <= cfg.planner.devices


def test_the_planner_config_runs_layouts_with_switching() -> None:
    cfg = load_config(Path(__file__).parents[2] / "configs" / "planner.yaml")
    assert cfg.planner.devices == 2 and cfg.planner.switching
    assert cfg.experiment != load_config(Path(__file__).parents[2] / "configs" / "experiment.yaml").experiment
