"""`rollpacker run --runner inline`: the same stages and services in one process (no Ray, no KFP),
against a real S3 server and a real MLflow store; a second run continues from the committed state."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from rollpacker import devservices

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[devservices.Services]:
    root = tmp_path_factory.mktemp("inline")
    svc = devservices.up(
        root, bucket="inline", mlflow=False, ray=False, seaweed_ports=devservices.SeaweedPorts.free()
    )
    try:
        yield svc
    finally:
        devservices.down(root, grace_s=3.0)


def test_inline_runner_runs_both_arms_and_resumes(
    s3: devservices.Services, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rollpacker.loop.experiment import run_experiment
    from rollpacker.loop.runner import load_config
    from rollpacker.store.objstore import ObjectStore
    from rollpacker.store.state_store import StateStore

    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    cfg_path = tmp_path / "inline.yaml"
    body = f"""
experiment: inline
steps: {{steps}}
tracking_uri: sqlite:///{tmp_path / "mlflow.db"}
store: {{{{endpoint: "{s3.s3_endpoint}", bucket: {s3.bucket}}}}}
task: {{{{name: synthetic_math, num_examples: 200, val_size: 8}}}}
model: {{{{preset: tiny, warmup_steps: 200}}}}
rollout: {{{{prompts_per_step: 4, responses_per_prompt: 2, max_tokens: 64}}}}
engine: {{{{max_num_seqs: 32, max_model_len: 200, kv_cache_gib: 1}}}}
planner: {{{{profile_batches: [1, 8], profile_contexts: [16, 64], profile_window: 4}}}}
validation: {{{{every: 100, max_tokens: 32}}}}
"""
    cfg_path.write_text(body.format(steps=2))
    out = run_experiment(cfg_path, runner="inline", start_services=False, echo=lambda s: None)
    assert [a.arm for a in out.arms] == ["sync", "tail_batching"]
    assert all(a.committed_step == 1 and a.failures == 0 for a in out.arms)
    assert "tail_batching" in out.compare_table and "speedup" in out.compare_table

    cfg_path.write_text(body.format(steps=3))
    again = run_experiment(
        cfg_path, runner="inline", arms=["sync"], start_services=False, echo=lambda s: None
    )
    assert again.arms[0].steps_run == 1
    cfg = load_config(cfg_path)
    states = StateStore(ObjectStore.from_config(cfg.store), cfg.experiment, "sync")
    assert states.history() == [-1, 0, 1, 2]
    assert states.latest().policy_version == 3  # type: ignore[union-attr]
