"""`rollpacker train`: one arm through the one step path (the stages, services in this process), on
real vLLM, torch, math-verify, a filesystem store and MLflow on SQLite; no S3, MLflow or Ray server."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from rollpacker.core.config import load_config
from rollpacker.core.errors import ConfigError

SMOKE = """
experiment: smoke
steps: 3
task: {num_examples: 200, val_size: 16}
model: {preset: micro, warmup_steps: 0}
rollout: {policy: tail_batching, prompts_per_step: 4, responses_per_prompt: 2, max_tokens: 48}
engine: {max_num_seqs: 32, max_model_len: 256, kv_cache_gib: 1}
train: {tokens_per_micro_batch: 2048}
validation: {every: 2, max_tokens: 48}
"""


def _config(tmp_path, text=SMOKE, **over):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    base = {"out_dir": str(tmp_path / "runs"), "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db", **over}
    return f, base


def test_config_errors_name_the_key_and_the_file(tmp_path):
    f, base = _config(tmp_path, SMOKE + "rollout: {etap: 2}\n")
    with pytest.raises(ConfigError, match=r"c\.yaml.*'rollout\.etap'"):
        load_config(f, base)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("steps: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "bad.yaml")


def test_a_training_arm_is_the_policy_with_a_local_store(tmp_path):
    from rollpacker.experiment import train_config

    f, base = _config(tmp_path)
    _, cfg = train_config(f, {**base, "rollout.policy": "partial", "seed": 3})
    assert cfg.arm_names == ["partial-seed3"]
    assert cfg.for_arm("partial-seed3").train.objective == "decoupled_ppo"
    assert cfg.store.endpoint == f"file://{tmp_path / 'runs' / 'store'}"
    _, one_off = train_config(f, {**base, "rollout.one_off": True})
    assert one_off.arm_names == ["tail_batching-one-off-seed0"] and one_off.rollout.one_off
    f.write_text(SMOKE + 'store: {endpoint: "127.0.0.1:9", bucket: bkt}\n')
    _, s3 = train_config(f, base)
    assert s3.store.endpoint == "127.0.0.1:9"  # a store the config names is kept


class _Started(Exception):
    """Raised where a training start would build the model: the re-run checks are behind it."""


def test_a_rerun_without_resume_never_logs_into_an_earlier_run_silently(tmp_path, monkeypatch):
    """One MLflow run per arm: a start without --resume goes on in the arm's run only when that run
    committed no step (and says so); otherwise it says what is there and what to pass."""
    from mlflow.entities import ViewType

    from rollpacker.core.state import ControllerState
    from rollpacker.experiment import train_arm, train_config
    from rollpacker.store import open_store
    from rollpacker.store.state_store import StateStore
    from rollpacker.tracking import ExperimentTracker

    def started(*_a, **_k):
        raise _Started

    monkeypatch.setattr("rollpacker.experiment.prepare_models", started)
    f, base = _config(tmp_path)
    text, cfg = train_config(f, base)
    (arm,) = cfg.arm_names
    tr = ExperimentTracker(cfg.tracking_uri, cfg.experiment)
    said: list[str] = []

    # an earlier start made the arm's MLflow run and died before committing anything: reused, said
    run = tr.arm_run(arm, {"rollout.policy": "tail_batching"})
    with pytest.raises(_Started):
        train_arm(text, progress=False, say=said.append)
    assert said == [
        f"[{arm}] reusing MLflow run {run}: an earlier start of this arm made it and committed no step"
    ]

    # ... and committed its initial state (step -1) first, then failed in its first step (a refused
    # setting, an engine that did not start): --resume goes on from it; a corrected re-run without
    # flags just starts over (nothing was committed), deleting the initial state and the run
    states = StateStore(open_store(cfg.store), cfg.experiment, arm)
    states.init(ControllerState(cfg.experiment, arm, -1, 0, 0, 0, mlflow_run_id=run))
    with pytest.raises(_Started):
        train_arm(text, progress=False, resume=True)
    assert states.latest() is not None
    said.clear()
    with pytest.raises(_Started):
        train_arm(text, progress=False, say=said.append)
    assert len(said) == 1 and said[0].startswith(f"[{arm}] an earlier start committed no step: starting over")
    assert states.latest() is None and tr.find_arm_run(arm) is None
    first_run, run = run, tr.arm_run(arm, {"rollout.policy": "tail_batching"})

    # the run committed steps whose state is not in this store (another out_dir, a deleted store)
    tr.set_state_pointer(run, "file:///elsewhere/state/step-000004.json", 4)
    with pytest.raises(ConfigError, match=rf"{run}.*5 committed step\(s\).*elsewhere.*--resume.*--fresh"):
        train_arm(text, progress=False)
    with pytest.raises(ConfigError, match="not in this store"):
        train_arm(text, progress=False, resume=True)
    said.clear()
    with pytest.raises(_Started):
        train_arm(text, progress=False, fresh=True, say=said.append)
    assert said == [f"[{arm}] --fresh: deleted 0 objects and MLflow run {run}"]
    runs = tr.client.search_runs([tr.experiment_id], run_view_type=ViewType.ALL)
    # no further run: the new one is made by the first step
    assert sorted(r.info.run_id for r in runs) == sorted([first_run, run])


@pytest.mark.slow
def test_train_logs_to_mlflow_commits_state_and_resumes(tmp_path):
    from mlflow.tracking import MlflowClient

    from rollpacker.cli import app
    from rollpacker.core.state import ControllerState
    from rollpacker.experiment import train_arm, train_config

    f, base = _config(tmp_path)
    text, cfg = train_config(f, base)
    s = train_arm(text, progress=False)
    assert (s.steps, s.steps_run, s.trained_samples) == (3, 3, 3 * 4 * 2)
    assert s.exactly_once.ok and s.exactly_once.prompts_trained == 3 * 4
    assert [st for st, _ in s.val_accuracy] == [0, 2, 3]
    client = MlflowClient(tracking_uri=cfg.tracking_uri)
    assert [m.step for m in client.get_metric_history(s.run_id, "reward/mean")] == [1, 2, 3]
    keys = set(client.get_run(s.run_id).data.metrics)
    for k in ("rollout/time_s", "rollout/bubble_ratio", "train/time_s", "reward/tail_s", "step/time_s"):
        assert k in keys, k
    for k in ("val/accuracy", "rollout/long_queue_size", "rollout/round_kind", "weights/sync_s"):
        assert k in keys, k
    state_doc = tmp_path / "runs" / "store" / "smoke" / "tail_batching-seed0" / "state" / "step-000002.json"
    assert ControllerState.from_json(state_doc.read_text()).policy_version == 3

    # a second run without --resume refuses to overwrite; with it, the same chain and MLflow run go on
    with pytest.raises(ConfigError, match="--resume"):
        train_arm(text, progress=False)
    res = CliRunner().invoke(
        app,
        [
            "train",
            "--config",
            str(f),
            "--resume",
            *[f"--set={k}={v}" for k, v in {**base, "steps": 5}.items()],
        ],
    )
    assert res.exit_code == 0, res.output
    assert "done: 5 steps (2 now)" in res.output and "0 twice, 0 lost" in res.output
    assert [m.step for m in client.get_metric_history(s.run_id, "reward/mean")] == [1, 2, 3, 4, 5]
    logs = sorted((state_doc.parents[1] / "steps").iterdir())
    assert len(logs) == 5 and json.loads((logs[-1] / "groups.json").read_text())["step"] == 4


@pytest.mark.slow
def test_mixed_task_routes_each_kind_and_keeps_anchors_in_the_state(tmp_path):
    """math, code and judge prompts in one run: each response scored by its kind's reward, per-kind
    means and the synchronous-stage comparison logged, each state's timeout anchors the sandbox's
    (only a correct program sets an anchor, so they may be empty this early;
    tests/stages/test_successor.py checks that a drain's anchors reach the state)."""
    from mlflow.tracking import MlflowClient

    from rollpacker.experiment import train_arm, train_config
    from rollpacker.store import open_store
    from rollpacker.store.state_store import StateStore

    text = SMOKE.replace(
        "task: {num_examples: 200, val_size: 16}", "task: {name: mixed, num_examples: 60, val_size: 6}"
    )
    text += "reward: {measure_sync_stage: true, sandbox: {t_min_s: 0.5, t_max_s: 2.0}, "
    text += "judge: {warmup_steps: 3}}\n"
    f, base = _config(tmp_path, text, steps=2)
    text, cfg = train_config(f, base)
    s = train_arm(text, progress=False)
    keys = set(MlflowClient(tracking_uri=cfg.tracking_uri).get_run(s.run_id).data.metrics)
    for k in ("reward/math_mean", "reward/code_mean", "reward/judge_mean", "reward/sync_stage_s"):
        assert k in keys, (k, sorted(keys))
    states = StateStore(open_store(cfg.store), cfg.experiment, cfg.arm_names[0])
    last = states.latest()
    assert last is not None and last.step == 1
    assert all(t > 0 for _, t in last.timeout_anchors)
    kinds = {k for k in keys if k.startswith("reward/") and k.endswith("_mean")}
    assert {"reward/math_mean", "reward/code_mean", "reward/judge_mean"} <= kinds


def test_a_run_with_committed_steps_names_the_exact_commands_and_both_work(tmp_path, monkeypatch):
    """`rollpacker train` on a run with committed steps prints the command that continues it and
    the one that starts it over; each of them gets past the check (to where training would start)."""
    import dataclasses
    import shlex

    from rollpacker.cli import app
    from rollpacker.core.state import ControllerState
    from rollpacker.experiment import train_config
    from rollpacker.store import open_store
    from rollpacker.store.state_store import StateStore

    f, base = _config(tmp_path)
    sets = [a for k, v in base.items() for a in ("--set", f"{k}={v}")]
    _, cfg = train_config(f, base)
    (arm,) = cfg.arm_names
    states = StateStore(open_store(cfg.store), cfg.experiment, arm)
    first = ControllerState(cfg.experiment, arm, -1, 0, 0, 0, mlflow_run_id="r0")
    states.init(first)
    states.commit(dataclasses.replace(first, step=0, policy_version=1))

    def started(*_a, **_k):
        raise _Started

    monkeypatch.setattr("rollpacker.experiment.prepare_models", started)
    monkeypatch.setattr("rollpacker.experiment.StageContext.create", started)
    res = CliRunner().invoke(app, ["train", "--config", str(f), *sets])
    assert res.exit_code == 2 and "already committed 1 step(s)" in res.output, res.output
    commands = dict(line.strip().split(":", 1) for line in res.output.splitlines() if line.startswith("  "))
    assert set(commands) == {"continue it", "start it over"}, res.output
    for what, flag in (("continue it", "--resume"), ("start it over", "--fresh")):
        argv = shlex.split(commands[what])
        assert argv[:2] == ["rollpacker", "train"] and argv[-1] == flag
        assert isinstance(CliRunner().invoke(app, argv[1:]).exception, _Started), what  # past the check
    assert states.latest() is None  # --fresh deleted the run's state
