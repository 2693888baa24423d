"""The local training loop end to end on real vLLM, torch, math-verify and MLflow (sqlite)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from rollpacker.core.errors import ConfigError
from rollpacker.loop.runner import load_config

SMOKE = """
experiment: smoke
steps: 3
checkpoint_every: 2
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
    return load_config(f, base)


def test_config_errors_name_the_key_and_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"c\.yaml.*'rollout\.etap'"):
        _config(tmp_path, SMOKE + "rollout: {etap: 2}\n".replace("rollout", "rollout", 1))
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("steps: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "bad.yaml")


@pytest.mark.slow
def test_train_logs_to_mlflow_checkpoints_and_resumes(tmp_path):
    from mlflow.tracking import MlflowClient

    from rollpacker.bench.learning import exactly_once
    from rollpacker.loop.runner import RLRun

    cfg = _config(tmp_path)
    run = RLRun(cfg, quiet=True)
    try:
        s = run.run(progress=False)
    finally:
        run.close()
    assert s.steps == 3 and s.trained_samples == 3 * 4 * 2
    client = MlflowClient(tracking_uri=cfg.tracking_uri)
    hist = client.get_metric_history(s.run_id, "reward/mean")
    assert [m.step for m in hist] == [1, 2, 3]
    keys = set(client.get_run(s.run_id).data.metrics)
    for k in (
        "rollout/time_s",
        "rollout/bubble_ratio",
        "train/time_s",
        "reward/tail_s",
        "step/time_s",
        "val/accuracy",
        "rollout/long_queue_size",
        "rollout/round_kind",
        "weights/sync_s",
    ):
        assert k in keys, k
    groups = tmp_path / "runs" / "smoke" / "tail_batching-seed0" / "groups.jsonl"
    assert len(groups.read_text().splitlines()) == 3
    assert exactly_once(groups, s.leftover_queue)["ok"]
    state = json.loads((groups.parent / "state.json").read_text())
    assert state["step"] == 2 and state["policy_version"] == 3

    # a restart continues the same MLflow run from the checkpoint
    more = dataclasses.replace(cfg, steps=5)
    run = RLRun(more, resume=True, quiet=True)
    try:
        assert run.start_step == 3 and run.trainer.policy_version == 3
        s2 = run.run(progress=False)
    finally:
        run.close()
    assert s2.run_id == s.run_id and s2.trained_samples == 5 * 4 * 2
    assert [m.step for m in client.get_metric_history(s.run_id, "reward/mean")] == [1, 2, 3, 4, 5]
    assert len(groups.read_text().splitlines()) == 5
    assert exactly_once(groups, s2.leftover_queue)["ok"]


@pytest.mark.slow
def test_mixed_task_routes_each_kind_and_keeps_anchors_in_the_state(tmp_path):
    """math, code and judge prompts in one run: each response scored by its kind's reward, per-kind
    means and the synchronous-stage comparison logged, sandbox anchors checkpointed."""
    from mlflow.tracking import MlflowClient

    from rollpacker.core.timeout import AdaptiveTimeout
    from rollpacker.loop.runner import RLRun

    text = SMOKE.replace(
        "task: {num_examples: 200, val_size: 16}", "task: {name: mixed, num_examples: 60, val_size: 6}"
    )
    text += "reward: {measure_sync_stage: true, sandbox: {t_min_s: 0.5, t_max_s: 2.0}, "
    text += "judge: {warmup_steps: 3}}\n"
    cfg = _config(tmp_path, text, steps=2)
    run = RLRun(cfg, quiet=True)
    try:
        s = run.run(progress=False)
        run.timeouts.observe("code-0-0/0", 0.25, passed=True)  # as a correct run would
        run.checkpoint(1)
    finally:
        run.close()
    client = MlflowClient(tracking_uri=cfg.tracking_uri)
    keys = set(client.get_run(s.run_id).data.metrics)
    for k in ("reward/math_mean", "reward/code_mean", "reward/judge_mean", "reward/sync_stage_s"):
        assert k in keys, (k, sorted(keys))
    state = json.loads((tmp_path / "runs" / "smoke" / "tail_batching-seed0" / "state.json").read_text())
    anchors = AdaptiveTimeout.from_json(state["timeout_anchors"])
    assert (
        anchors.anchor_s("code-0-0/0") == pytest.approx(0.25, abs=1e-9)
        or anchors.anchor_s("code-0-0/0") > 0.25
    )
