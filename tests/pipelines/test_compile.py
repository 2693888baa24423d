"""The compiled pipelines: strict KFP schema, the RL-step DAG, the chained experiment, images."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from google.protobuf import json_format
from typer.testing import CliRunner

from rollpacker.cli import app
from rollpacker.core.errors import ConfigError
from rollpacker.pipeline_compile import compile_pipelines, load_pipeline_modules, repo_root, steps_from_config
from tests.pipelines.conftest import STEPS
from tests.pipelines.spec import (
    GATED_TASKS,
    SKIP_CONDITION,
    STEP_TASKS,
    all_dag_tasks,
    ancestors,
    containers,
    dag_of,
    executor_of,
    gated,
    load_docs,
    load_spec,
    parse_strict,
)

# executor label -> component folder (components/<folder>/component.py)
EXECUTOR_COMPONENT = {
    "exec-controller-plan": "controller",
    "exec-controller-commit": "controller",
    "exec-profiling": "profiling",
    "exec-rollout": "rollout",
    "exec-sandbox-reward": "sandbox_reward",
    "exec-judge": "judge",
    "exec-training": "training",
    "exec-prepare-model": "prepare_model",  # rl_experiment only: before the first step
}
# the executors of one step (rl_step)
STEP_EXECUTORS = set(EXECUTOR_COMPONENT) - {"exec-prepare-model"}


def _base(label: str) -> str:
    """exec-rollout-3 -> exec-rollout (the experiment repeats each executor once per step)."""
    return re.sub(r"-\d+$", "", label)


# --- strict schema -------------------------------------------------------------------------------


def test_both_files_written_and_parse_strictly(compiled: dict[str, Path]) -> None:
    assert set(compiled) == {"rl_step", "rl_experiment"}
    for path in compiled.values():
        docs = load_docs(path)
        spec, _platform = parse_strict(docs)
        assert spec.schema_version == "2.1.0"
        assert spec.sdk_version == "kfp-2.17.0"
    assert load_spec(compiled["rl_step"]).pipeline_info.name == "rl-step"
    assert load_spec(compiled["rl_experiment"]).pipeline_info.name == "rl-experiment"


def test_planted_unknown_field_fails_the_strict_parse(compiled: dict[str, Path], tmp_path: Path) -> None:
    docs = load_docs(compiled["rl_step"])
    docs[0]["root"]["dag"]["tasks"]["controller-plan"]["retryPolicyy"] = {"maxRetryCount": 1}
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump_all(docs))
    with pytest.raises(json_format.ParseError, match="retryPolicyy"):
        load_spec(bad)


def test_planted_unknown_field_in_platform_doc_fails(compiled: dict[str, Path]) -> None:
    docs = [*load_docs(compiled["rl_step"])[:1], {"platforms": {"kubernetes": {"bogus": 1}}}]
    with pytest.raises(json_format.ParseError):
        parse_strict(docs)


# --- rl_step -------------------------------------------------------------------------------------


def test_rl_step_has_every_stage_in_order(compiled: dict[str, Path]) -> None:
    spec = load_spec(compiled["rl_step"])
    root = spec.root.dag.tasks
    assert set(root) == STEP_TASKS
    assert ancestors(root, "step-unless-done") == {"controller-plan"}
    _cond, tasks = gated(spec, root["step-unless-done"])
    assert set(tasks) == GATED_TASKS
    before = {name: ancestors(tasks, name) for name in tasks}
    assert before["profile-if-needed"] == set()
    assert "profile-if-needed" in before["rollout"]
    assert "rollout" in before["sandbox-reward"] and "rollout" in before["judge"]
    assert {"sandbox-reward", "judge"} <= before["training"]
    assert before["controller-commit"] == GATED_TASKS - {"controller-commit"}
    assert not any("controller-commit" in b for b in before.values()), "commit must be last"
    # the two reward stages do not wait for each other
    assert "judge" not in before["sandbox-reward"] and "sandbox-reward" not in before["judge"]


def test_every_stage_after_the_plan_runs_only_when_the_arm_is_not_done(compiled: dict[str, Path]) -> None:
    spec = load_spec(compiled["rl_step"])
    root = spec.root.dag.tasks
    assert all(not t.trigger_policy.condition for t in root.values())
    cond, tasks = gated(spec, root["step-unless-done"])
    assert cond.trigger_policy.condition == SKIP_CONDITION and set(tasks) == GATED_TASKS
    skip = root["step-unless-done"].inputs.parameters["skip"].task_output_parameter
    assert (skip.producer_task, skip.output_parameter_key) == ("controller-plan", "skip")
    # no stage after the plan sits outside the gate
    outside = [(d, n) for d, n, t in all_dag_tasks(spec) if n in GATED_TASKS and d != cond.component_ref.name]
    assert outside == []


def test_rl_step_data_flows_between_stages(compiled: dict[str, Path]) -> None:
    spec = load_spec(compiled["rl_step"])
    root = spec.root.dag.tasks
    _cond, tasks = gated(spec, root["step-unless-done"])

    def producer(task: str, param: str) -> tuple[str, str]:
        p = tasks[task].inputs.parameters[param].task_output_parameter
        return p.producer_task, p.output_parameter_key

    for param in ("plan", "need_profile", "skip"):  # the plan's outputs go in through the gate
        p = root["step-unless-done"].inputs.parameters[param].task_output_parameter
        assert (p.producer_task, p.output_parameter_key) == ("controller-plan", param)
    for task in GATED_TASKS:
        assert tasks[task].inputs.parameters["plan"].component_input_parameter == "pipelinechannel--plan"
        assert tasks[task].inputs.parameters["config"].component_input_parameter == "pipelinechannel--config"
    assert tasks["profile-if-needed"].inputs.parameters["need_profile"].component_input_parameter == (
        "pipelinechannel--need_profile"
    )
    assert producer("training", "reward") == ("sandbox-reward", "Output")
    assert producer("training", "judge") == ("judge", "Output")
    assert producer("controller-commit", "train") == ("training", "Output")
    assert root["step-unless-done"].inputs.parameters["config"].component_input_parameter == "config"
    assert root["controller-plan"].inputs.parameters["arm"].component_input_parameter == "arm"


def test_profiling_runs_only_under_the_need_profile_condition(compiled: dict[str, Path]) -> None:
    spec = load_spec(compiled["rl_step"])
    _gate, tasks = gated(spec, spec.root.dag.tasks["step-unless-done"])
    # no stage under the gate is conditional itself
    assert all(not t.trigger_policy.condition for t in tasks.values())
    sub = dag_of(spec, tasks["profile-if-needed"].component_ref.name).tasks
    assert len(sub) == 1
    (cond,) = sub.values()
    assert cond.trigger_policy.condition == "inputs.parameter_values['pipelinechannel--need_profile'] == true"
    inner = dag_of(spec, cond.component_ref.name).tasks
    assert list(inner) == ["profiling"]
    assert executor_of(spec, inner["profiling"]) == "exec-profiling"
    # profiling appears nowhere else
    places = [(d, n) for d, n, t in all_dag_tasks(spec) if t.component_ref.name == "comp-profiling"]
    assert places == [(cond.component_ref.name, "profiling")]


def test_caching_off_and_no_retries_on_every_task(compiled: dict[str, Path]) -> None:
    for path in compiled.values():
        spec = load_spec(path)
        tasks = all_dag_tasks(spec)
        assert len(tasks) >= len(STEP_TASKS | GATED_TASKS)
        for dag, name, task in tasks:
            assert not task.caching_options.enable_cache, f"{path.name}: {dag}/{name} caches"
            assert task.retry_policy.max_retry_count == 0, f"{path.name}: {dag}/{name} retries"


# --- rl_experiment -------------------------------------------------------------------------------


def test_rl_experiment_chains_n_step_subdags_in_order(compiled: dict[str, Path]) -> None:
    spec = load_spec(compiled["rl_experiment"])
    tasks = spec.root.dag.tasks
    assert len(tasks) == STEPS + 1
    firsts = [n for n, t in tasks.items() if not t.dependent_tasks]
    assert firsts == ["prepare-model"]  # the start model in the store before the first step
    assert set(tasks["prepare-model"].inputs.parameters) == {"config", "arm"}
    chain = firsts
    while len(chain) < STEPS + 1:
        nxt = [n for n, t in tasks.items() if list(t.dependent_tasks) == [chain[-1]]]
        assert len(nxt) == 1, f"step after {chain[-1]}: {nxt}"
        chain += nxt
    assert [tasks[n].task_info.name for n in chain[1:]] == [f"step-{i + 1}" for i in range(STEPS)]
    for name in chain[1:]:
        sub = dag_of(spec, tasks[name].component_ref.name).tasks
        assert {re.sub(r"-\d+$", "", n) for n in sub} == STEP_TASKS
        gate = next(t for n, t in sub.items() if n.startswith("step-unless-done"))
        assert {re.sub(r"-\d+$", "", n) for n in gated(spec, gate)[1]} == GATED_TASKS
        assert tasks[name].inputs.parameters["config"].component_input_parameter == "config"
        assert tasks[name].inputs.parameters["arm"].component_input_parameter == "arm"
    assert set(spec.root.input_definitions.parameters) == {"config", "arm"}


def test_rl_experiment_rejects_zero_steps() -> None:
    _rl_step, rl_experiment = load_pipeline_modules()
    with pytest.raises(ConfigError, match="num_steps"):
        rl_experiment.build_rl_experiment(0)


# --- images --------------------------------------------------------------------------------------


def _clear_image_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("controller", "rollout", "sandbox", "judge", "training"):
        monkeypatch.delenv(f"ROLLPACKER_IMAGE_{name.upper()}", raising=False)


def test_default_images_come_from_images_py(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _clear_image_env(monkeypatch)
    for path in compile_pipelines(tmp_path, 2):
        execs = containers(load_spec(path))
        want_execs = STEP_EXECUTORS if path.name == "rl_step.yaml" else set(EXECUTOR_COMPONENT)
        assert {_base(label) for label in execs} == want_execs
        from components import images  # freshly imported by compile_pipelines

        for label, container in execs.items():
            want = images.DEFAULT_IMAGES[images.COMPONENT_IMAGES[EXECUTOR_COMPONENT[_base(label)]]]
            assert container["image"] == want, label
    assert containers(load_spec(tmp_path / "rl_step.yaml"))["exec-profiling"]["image"] == (
        "ghcr.io/rollpacker/rollout:0.1.0"
    )
    # the model preparation runs where torch is (a warm-up trains): not the controller image
    assert containers(load_spec(tmp_path / "rl_experiment.yaml"))["exec-prepare-model"]["image"] == (
        "ghcr.io/rollpacker/training:0.1.0"
    )


def test_image_env_override_applies_at_compile_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _clear_image_env(monkeypatch)
    compile_pipelines(tmp_path / "before", 1)  # imports the modules with the defaults first
    overrides = {
        name: f"registry.local/{name}-x:dev"
        for name in ("controller", "rollout", "sandbox", "judge", "training")
    }
    for name, ref in overrides.items():
        monkeypatch.setenv(f"ROLLPACKER_IMAGE_{name.upper()}", ref)
    from components import images

    for path in compile_pipelines(tmp_path / "after", 2):
        for label, container in containers(load_spec(path)).items():
            image_name = images.COMPONENT_IMAGES[EXECUTOR_COMPONENT[_base(label)]]
            assert container["image"] == overrides[image_name], f"{path.name}: {label}"


def test_unknown_image_name_is_refused() -> None:
    load_pipeline_modules()
    from components import images

    with pytest.raises(KeyError, match="unknown image"):
        images.image("trainer")


def test_components_install_nothing_at_run_time(compiled: dict[str, Path]) -> None:
    for label, container in containers(load_spec(compiled["rl_step"])).items():
        command = " ".join(container["command"])
        assert "pip install" not in command, label
        assert container["args"][-1] == label.removeprefix("exec-").replace("-", "_")


# --- CLI -----------------------------------------------------------------------------------------


def test_cli_compile_takes_steps_from_config_and_flag(tmp_path: Path) -> None:
    cfg = tmp_path / "exp.yaml"
    cfg.write_text("experiment: pipe-test\nsteps: 2\n")
    runner = CliRunner()
    res = runner.invoke(app, ["compile", "--out", str(tmp_path / "a"), "--config", str(cfg)])
    assert res.exit_code == 0, res.output
    assert "rl_experiment.yaml" in res.output
    assert len(load_spec(tmp_path / "a" / "rl_experiment.yaml").root.dag.tasks) == 1 + 2  # prepare-model
    res = runner.invoke(app, ["compile", "--out", str(tmp_path / "b"), "--config", str(cfg), "--steps", "4"])
    assert res.exit_code == 0, res.output
    assert len(load_spec(tmp_path / "b" / "rl_experiment.yaml").root.dag.tasks) == 1 + 4


def test_cli_compile_refuses_bad_input(tmp_path: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(app, ["compile", "--out", str(tmp_path), "--steps", "0"])
    assert res.exit_code == 2 and "num_steps" in res.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("stepz: 3\n")
    res = runner.invoke(app, ["compile", "--out", str(tmp_path), "--config", str(bad)])
    assert res.exit_code == 2 and "stepz" in res.output
    assert not (tmp_path / "rl_step.yaml").exists()


def test_steps_from_config(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("steps: 7\n")
    assert steps_from_config(cfg) == 7
    with pytest.raises(ConfigError, match="does not exist"):
        steps_from_config(tmp_path / "missing.yaml")


def test_repo_root_holds_the_pipeline_sources() -> None:
    root = repo_root()
    assert (root / "pipelines" / "rl_step.py").is_file()
    assert (root / "components" / "controller" / "component.py").is_file()
