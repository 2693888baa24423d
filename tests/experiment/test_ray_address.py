"""The runner hands the Ray address to the registry and to its KFP tasks: ``services.ray_address``,
else $RAY_ADDRESS, else the local head ``rollpacker up`` recorded; a broken local head is refused
before any client hangs on it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from rollpacker import experiment
from rollpacker.core.config import config_from_text
from rollpacker.core.types import Runner
from rollpacker.services.base import ServiceError


@pytest.fixture
def local_head(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """devservices' record of the local head (the outer edge: processes started by `make up`)."""
    head: dict[str, Any] = {"address": "127.0.0.2:6380", "broken": False}
    monkeypatch.setattr(experiment.devservices, "local_ray_address", lambda: head["address"])
    monkeypatch.setattr(
        experiment.devservices, "local_ray_head_broken", lambda a: head["broken"] and a == head["address"]
    )
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return head


def test_the_address_comes_from_the_config_then_the_environment_then_the_local_head(
    local_head, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    plain = config_from_text("experiment: e\n")
    assert experiment.ray_address(plain) == "127.0.0.2:6380"
    monkeypatch.setenv("RAY_ADDRESS", "ray://10.0.0.1:10001")
    assert experiment.ray_address(plain) == "ray://10.0.0.1:10001"
    named = config_from_text("experiment: e\nservices: {ray_address: '10.0.0.2:6379'}\n")
    assert experiment.ray_address(named) == "10.0.0.2:6379"
    local_head["address"] = ""
    monkeypatch.delenv("RAY_ADDRESS")
    assert experiment.ray_address(plain) == ""  # connect_ray then names what to set


def test_a_local_head_that_lost_its_raylet_is_refused(local_head) -> None:  # type: ignore[no-untyped-def]
    local_head["broken"] = True
    with pytest.raises(ServiceError, match=r"lost its raylet or GCS server.*`make up`"):
        experiment.ray_address(config_from_text("experiment: e\n"))


def test_the_arm_prepares_its_model_then_hands_the_address_to_the_registry_and_its_tasks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = config_from_text("experiment: e\nsteps: 2\n")
    seen: list[Any] = []
    steps = iter([(-1, 2), (1, 0)])
    monkeypatch.setattr(experiment, "remaining_steps", lambda c, a: next(steps))
    monkeypatch.setattr(experiment, "open_store", lambda s: "store")
    monkeypatch.setattr(
        experiment, "prepare_models", lambda c, store, arm, **k: seen.append(("prepare", arm))
    )

    class Registry:
        def __init__(self, spec: Any) -> None:
            seen.append(("registry", spec.ray_address))

        def kill_all(self) -> None:
            pass

    def run_kfp(text: str, arm: str, left: int, root: Path, echo: Any) -> None:
        seen.append(("kfp", arm, left, os.environ.get("RAY_ADDRESS")))

    monkeypatch.setattr(experiment, "ServiceRegistry", Registry)
    monkeypatch.setattr(experiment, "run_arm_kfp", run_kfp)
    out = experiment._run_arm(
        cfg, "experiment: e\nsteps: 2\n", "sync", Runner.KFP, 0, tmp_path, print, "127.0.0.9:6380"
    )
    assert out.steps_run == 2
    assert seen == [("registry", "127.0.0.9:6380"), ("prepare", "sync"), ("kfp", "sync", 2, "127.0.0.9:6380")]
    assert "RAY_ADDRESS" not in os.environ  # only the tasks of that run got it
