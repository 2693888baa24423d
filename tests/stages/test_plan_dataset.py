"""controller.plan publishes the arm's dataset before anything else needs it (MLflow, the services):
a missing dataset fails the plan before any service is reached."""

from __future__ import annotations

import dataclasses
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


class _NoServices:
    """MLflow is down (a plan goes on without it) and the engine must not be reached."""

    def tracking(self):
        from rollpacker.services.base import ServiceError

        raise ServiceError("planted: no tracking service")

    def rollout(self):
        raise Reached("rollout")

    def trainer(self):
        raise Reached("trainer")


def test_an_arm_that_is_done_plans_arm_done_and_its_step_returns_at_once(tmp_path: Path) -> None:
    from rollpacker.stages.messages import ArmDone
    from rollpacker.stages.run import run_step
    from tests.services.test_scaledown_runtime import start_state

    (tmp_path / "store").mkdir()
    store = FileStore(tmp_path / "store")
    cfg = arm_config("experiment: x\nsteps: 1\n", "sync")
    states = StateStore(store, "x", "sync")
    first = start_state("x", "sync", store.uri("x/sync/base/"))
    states.init(first)
    states.commit(dataclasses.replace(first, step=0, policy_version=1))
    ctx = StageContext("", "sync", cfg, store, states, _NoServices())  # type: ignore[arg-type]
    done = plan(ctx)
    assert isinstance(done, ArmDone) and (done.step, done.state_step, done.run_id) == (1, 0, "run")
    out = run_step(ctx)  # no service reached: nothing after the plan runs
    assert out.skipped and out.step == 1 and out.metrics == {}
