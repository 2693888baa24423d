"""An arm's first plan takes its start model from the store, where the model preparation put it
before the step (tasks/prepare.py); it never builds or trains one, and without one it says what
puts it there before it reaches MLflow's run or the services."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollpacker.core.config import arm_config
from rollpacker.core.errors import RollpackerError
from rollpacker.stages.context import StageContext
from rollpacker.stages.plan import plan
from rollpacker.store.local import FileStore
from rollpacker.store.state_store import StateStore
from rollpacker.tasks.models import PREPARED_MARKER


class Reached(Exception):
    """The plan went past the start model to the arm's MLflow run."""


class _Tracking:
    def check(self) -> str:
        return "ok"

    def arm_run(self, arm: str, params: dict[str, str]) -> str:
        raise Reached(arm)


class _Services:
    def tracking(self) -> _Tracking:
        return _Tracking()


def _ctx(tmp_path: Path) -> StageContext:
    (tmp_path / "store").mkdir(exist_ok=True)
    store = FileStore(tmp_path / "store")
    cfg = arm_config("experiment: x\nmodel: {preset: micro, warmup_steps: 7}\n", "sync")
    return StageContext("", "sync", cfg, store, StateStore(store, "x", "sync"), _Services())  # type: ignore[arg-type]


def test_a_first_plan_without_a_prepared_start_model_names_what_prepares_it(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    def trained(*_a, **_k):  # type: ignore[no-untyped-def]
        raise AssertionError("the plan stage trained a model")

    monkeypatch.setattr("rollpacker.tasks.warmup.warm_up", trained)
    monkeypatch.setenv("ROLLPACKER_CACHE", str(tmp_path / "cache"))
    ctx = _ctx(tmp_path)
    with pytest.raises(RollpackerError, match=r"the start model is not in the store .*prepare-model task"):
        plan(ctx)
    assert ctx.states.latest() is None  # nothing half-done
    assert not (tmp_path / "cache").exists()  # nothing built


def test_a_first_plan_takes_the_prepared_start_model_from_the_store(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("ROLLPACKER_CACHE", str(tmp_path / "cache"))
    ctx = _ctx(tmp_path)
    ctx.store.put_bytes(ctx.base_key() + "config.json", b"{}")
    with pytest.raises(RollpackerError, match="not in the store"):  # an interrupted upload: no marker
        plan(ctx)
    ctx.store.put_bytes(ctx.base_key() + PREPARED_MARKER, b"{}")
    with pytest.raises(Reached):
        plan(ctx)
    assert not (tmp_path / "cache").exists()
