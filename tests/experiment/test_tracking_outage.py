"""MLflow going away for a while does not stop a run: the steps commit (the state is the source of
truth), each says what it skipped, and once MLflow answers again the next commit logs every step
it missed, in order, from the commit records. A real MLflow server, stopped and restarted from the
stage hooks in the middle of one `run_experiment` (inline runner)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollpacker import devservices

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

STEPS = 5
DOWN_AT, UP_AT = ("commit", 1), ("rollout", 3)  # MLflow misses steps 1 and 2
ROOT_ENV = "ROLLPACKER_TEST_OUTAGE_ROOT"
PORT_ENV = "ROLLPACKER_TEST_OUTAGE_MLFLOW_PORT"


def outage_hook(point: str, step: int, _delay_s: float) -> None:
    """The stage hook: stop the MLflow server after step 1's commit, start it before step 3's round."""
    root = Path(os.environ[ROOT_ENV])
    if (point, step) == DOWN_AT:
        devservices.down(root, names=["mlflow"], grace_s=2)
    elif (point, step) == UP_AT:
        devservices.up(root, s3=True, mlflow=True, ray=False, mlflow_port=int(os.environ[PORT_ENV]))


@pytest.fixture()
def services(tmp_path: Path) -> Iterator[devservices.Services]:
    root = tmp_path / "svc"
    svc = devservices.up(
        root,
        bucket="outage",
        ray=False,
        seaweed_ports=devservices.SeaweedPorts.free(),
        mlflow_port=devservices.free_ports(1)[0],
        timeout_s=120,
    )
    try:
        yield svc
    finally:
        devservices.down(root, grace_s=3.0)


def test_steps_commit_while_mlflow_is_down_and_are_logged_when_it_is_back(
    services: devservices.Services,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from rollpacker.core.config import load_config
    from rollpacker.experiment import run_experiment
    from rollpacker.stages.hooks import HOOK_ENV
    from rollpacker.store import open_store
    from rollpacker.store.state_store import StateStore
    from rollpacker.tracking import ExperimentTracker

    for k, v in services.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv(HOOK_ENV, f"{__name__}:outage_hook")
    monkeypatch.setenv(ROOT_ENV, str(tmp_path / "svc"))
    monkeypatch.setenv(PORT_ENV, services.tracking_uri.rsplit(":", 1)[1])
    cfg_path = tmp_path / "outage.yaml"
    cfg_path.write_text(
        f"""
experiment: outage
steps: {STEPS}
arms: [tail_batching]
tracking_uri: {services.tracking_uri}
store: {{endpoint: "{services.s3_endpoint}", bucket: {services.bucket}}}
task: {{name: synthetic_math, num_examples: 200, val_size: 8}}
model: {{preset: tiny, warmup_steps: 200}}
rollout: {{prompts_per_step: 4, responses_per_prompt: 2, max_tokens: 64}}
engine: {{max_num_seqs: 32, max_model_len: 200, kv_cache_gib: 1}}
planner: {{profile_batches: [1, 8], profile_contexts: [16, 64], profile_window: 4}}
validation: {{every: 100, max_tokens: 32}}
"""
    )
    lines: list[str] = []
    out = run_experiment(cfg_path, runner="inline", retries=0, start_services=False, echo=lines.append)
    (arm,) = out.arms
    assert arm.failures == 0 and arm.committed_step == STEPS - 1, lines  # no step failed for MLflow
    err = capsys.readouterr().err
    assert "warning: logging step 1 to MLflow skipped" in err and "warning: logging step 2" in err

    cfg = load_config(cfg_path)
    states = StateStore(open_store(cfg.store), cfg.experiment, "tail_batching")
    last = states.latest()
    assert last is not None and last.step == STEPS - 1
    tracker = ExperimentTracker(cfg.tracking_uri, cfg.experiment)
    # every step in MLflow once, the missed ones logged when it came back, and the pointer at the end
    logged = [s for s, _ in tracker.metric_history(last.mlflow_run_id, "train/loss")]
    assert logged == list(range(1, STEPS + 1)), "\n".join([*lines, err])
    assert tracker.state_pointer(last.mlflow_run_id) == (
        states.store.uri(states.state_key(STEPS - 1)),
        STEPS - 1,
    )
