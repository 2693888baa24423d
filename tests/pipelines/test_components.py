"""Each component is self-contained: the source KFP ships runs on its own and calls its stage."""

from __future__ import annotations

import ast
import functools
import inspect
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from kfp import dsl

from rollpacker.pipeline_compile import load_pipeline_modules
from tests.pipelines import fake_stages

# component -> (module, stage function it must call)
COMPONENTS = {
    "controller_plan": ("components.controller.component", "plan"),
    "controller_commit": ("components.controller.component", "commit"),
    "profiling": ("components.profiling.component", "profile"),
    "rollout": ("components.rollout.component", "rollout"),
    "sandbox_reward": ("components.sandbox_reward.component", "reward"),
    "judge": ("components.judge.component", "judge"),
    "training": ("components.training.component", "train"),
    "prepare_model": ("components.prepare_model.component", "prepare"),
}
# the module each component's function comes from: the stages' edge, or the model preparation's
# (which the stages never import: tests/test_layers.py)
EDGE = {name: "rollpacker.stages.edge" for name in COMPONENTS} | {"prepare_model": "rollpacker.tasks.prepare"}
KFP_PREAMBLE = {"kfp", "kfp.dsl", "typing"}
# what each fake stage returns (tests/pipelines/fake_stages.py)
STAGE_RESULTS = {
    "profile": {"profile": "p"},
    "rollout": {"rollout": "r"},
    "reward": {"reward": "w"},
    "judge": {"judge": "j"},
    "train": {"train": "t"},
}


@functools.cache
def _shipped_sources() -> dict[str, str]:
    """The program KFP writes into each component's container (the last element of the executor's
    command), from one fresh import of the pipelines: importing them takes ~1.5 s, and nothing in
    this module changes what they are built from (images come from the environment: unchanged)."""
    load_pipeline_modules()
    components = {name: getattr(sys.modules[module], name) for name, (module, _) in COMPONENTS.items()}
    return {name: c.component_spec.implementation.container.command[-1] for name, c in components.items()}


def _shipped_source(name: str) -> str:
    return _shipped_sources()[name]


@pytest.mark.parametrize("name", sorted(COMPONENTS))
def test_shipped_source_imports_its_stage_inside_the_function(name: str) -> None:
    source = _shipped_source(name)
    tree = ast.parse(source)
    module_imports = {
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in tree.body
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert module_imports <= KFP_PREAMBLE, f"module-level imports outside the KFP preamble: {module_imports}"
    (func,) = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    assert func.name == name
    inner = [n for n in ast.walk(func) if isinstance(n, ast.ImportFrom) and n.module == EDGE[name]]
    assert [a.name for n in inner for a in n.names] == [COMPONENTS[name][1]]
    assert f"from {EDGE[name]} import {COMPONENTS[name][1]}" in source


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setitem(sys.modules, "rollpacker.stages.edge", fake_stages)
    monkeypatch.setitem(sys.modules, "rollpacker.tasks.prepare", fake_stages)
    monkeypatch.delenv("FAKE_STAGES_STATE", raising=False)
    fake_stages.calls.clear()
    return fake_stages


def _run_shipped(name: str, **kwargs: Any) -> Any:
    """Execute the shipped source in a fresh namespace (as kfp's executor does) and call it."""
    namespace: dict[str, Any] = {"__name__": "ephemeral_component"}
    exec(compile(_shipped_source(name), f"<{name}>", "exec"), namespace)
    return namespace[name](**kwargs)


def test_prepare_model_returns_the_start_models_uri(fake: Any) -> None:
    assert _run_shipped("prepare_model", config="steps: 3", arm="sync") == "file:///store/sync/base/"
    assert fake.calls == [("prepare", {"config": "steps: 3", "arm": "sync"})]


def test_controller_plan_returns_the_named_outputs(fake: Any) -> None:
    out = _run_shipped("controller_plan", config="steps: 3", arm="sync")
    assert out._fields == ("plan", "step", "need_profile", "skip")
    assert json.loads(out.plan) == {"arm": "sync", "step": 0}
    assert (out.step, out.need_profile, out.skip) == (0, True, False)
    assert fake.calls == [("plan", {"config": "steps: 3", "arm": "sync"})]


@pytest.mark.parametrize(
    ("name", "stage", "args"),
    [
        ("profiling", "profile", {"plan": "P"}),
        ("rollout", "rollout", {"plan": "P"}),
        ("sandbox_reward", "reward", {"plan": "P", "rollout": "R"}),
        ("judge", "judge", {"plan": "P", "rollout": "R"}),
        ("training", "train", {"plan": "P", "rollout": "R", "reward": "W", "judge": "J"}),
    ],
)
def test_stage_components_pass_everything_through(
    fake: Any, name: str, stage: str, args: dict[str, str]
) -> None:
    out = _run_shipped(name, config="C", **args)
    assert json.loads(out) == STAGE_RESULTS[stage]
    assert fake.calls == [(stage, {"config": "C", **args})]


def test_controller_commit_logs_every_metric(fake: Any, tmp_path: Path) -> None:
    metrics = dsl.Metrics(name="metrics", uri=str(tmp_path / "metrics"), metadata={})
    plan = json.dumps({"arm": "sync", "step": 4})
    args = {"plan": plan, "rollout": "R", "reward": "W", "judge": "J", "train": "T"}
    summary = _run_shipped("controller_commit", config="C", metrics=metrics, **args)
    assert json.loads(summary) == {"committed": 4}
    assert metrics.metadata == {"rollout/time_s": 1.5, "train/loss": 0.25}
    assert fake.calls == [("commit", {"config": "C", **args})]


def test_a_failing_stage_fails_the_component(fake: Any) -> None:
    with pytest.raises(RuntimeError, match="planted failure in rollout"):
        _run_shipped("rollout", config="fail: rollout", plan="P")


@pytest.mark.parametrize("stage", ["plan", "profile", "rollout", "reward", "judge", "train", "commit"])
def test_real_stages_take_the_keywords_the_components_pass(stage: str) -> None:
    """The components call ``rollpacker.stages.edge`` by keyword, with the fake's parameter names."""
    real = pytest.importorskip("rollpacker.stages.edge")
    want = list(inspect.signature(getattr(fake_stages, stage)).parameters)
    assert list(inspect.signature(getattr(real, stage)).parameters) == want
