"""controller.plan publishes the arm's dataset before anything else needs it (MLflow, the services):
a missing dataset fails the plan before any service is reached."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollpacker.core.config import arm_config
from rollpacker.core.errors import ConfigError
from rollpacker.stages.context import StageContext
from rollpacker.stages.plan import plan
from rollpacker.store.local import FileStore
from rollpacker.store.state_store import StateStore
from rollpacker.tasks import dataset_store as ds
from rollpacker.tasks import synthetic_math as sm
from rollpacker.tasks.jsonl import dump_jsonl


class Reached(Exception):
    """The plan went past the dataset to MLflow or the services."""


class _Services:
    def tracking(self):
        raise Reached("tracking")

    def rollout(self):
        raise Reached("rollout")


def _ctx(tmp_path: Path, task: str) -> StageContext:
    (tmp_path / "store").mkdir(exist_ok=True)
    store = FileStore(tmp_path / "store")
    cfg = arm_config(f"experiment: x\ntask: {{name: '{task}'}}\n", "sync")
    return StageContext("", "sync", cfg, store, StateStore(store, "x", "sync"), _Services())  # type: ignore[arg-type]


def test_the_plan_publishes_the_dataset_before_it_reaches_mlflow_or_the_services(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    dump_jsonl(sm.generate(sm.SyntheticMathSpec(num_examples=5), seed=0), path)
    ctx = _ctx(tmp_path, str(path))
    with pytest.raises(Reached):
        plan(ctx)
    assert ctx.store.get_json(ds.record_key("x", "sync"))["source"] == str(path)


def test_a_missing_dataset_fails_the_plan_before_any_service(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path, str(tmp_path / "missing.jsonl"))
    with pytest.raises(ConfigError, match="no such file on the controller's pod"):
        plan(ctx)
