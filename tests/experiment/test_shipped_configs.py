"""Every config shipped in configs/ parses and validates (a typo there breaks a user's first run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollpacker.core.config import load_config

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


def test_the_policies_config_has_every_policy_and_variant() -> None:
    from rollpacker.core.config import PolicyName, SortedMode

    cfg = load_config(Path(__file__).parents[2] / "configs" / "policies.yaml")
    assert {a.policy for a in cfg.arms} == set(PolicyName)
    sorted_modes = {
        cfg.for_arm(a.name).rollout.sorted.mode for a in cfg.arms if a.policy is PolicyName.SORTED
    }
    assert sorted_modes == set(SortedMode)
    assert any(cfg.for_arm(a.name).rollout.one_off for a in cfg.arms)
    assert cfg.for_arm("partial").train.objective == "decoupled_ppo"
    assert cfg.for_arm("sorted").train.objective == "ppo"
