"""The RL-step pipeline survives a SIGKILL of the process running a stage, at each of rollout,
reward, training and commit, through kfp.local with the services in a real Ray cluster, the state
in a real S3 server (SeaweedFS) and the metrics in a real MLflow server.

Which prompts tail batching defers is timing-dependent, so the run is checked against invariants
(from the committed states and the logged groups), never against a second run:
- every step is committed exactly once (state chain -1..N-1, one commit record and one MLflow
  value per step);
- each re-run step starts from exactly the last committed state: the trainer is one optimizer
  update per committed step (policy version == step + 1: the update of a killed training stage
  was rolled back), and the queue/cursor of each state follows from its predecessor and its groups;
- every prompt drawn is trained exactly once or still waits in the long-prompt queue.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollpacker import devservices
from rollpacker.testing.chain import check_chain as _check_chain
from rollpacker.testing.faults import SERVICES_ENV

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

FAULTS = ("rollout@1", "reward@2", "train@3", "commit@4")
STEPS = 6


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[devservices.Services]:
    root = tmp_path_factory.mktemp("svc")
    svc = devservices.up(
        root,
        bucket="faults",
        seaweed_ports=devservices.SeaweedPorts.free(),
        mlflow_port=devservices.free_ports(1)[0],
        ray_ports=devservices.RayPorts.free(),
        timeout_s=120.0,
    )
    try:
        yield svc
    finally:
        devservices.down(root, grace_s=3.0)


def _config(svc: devservices.Services, tmp: Path, experiment: str = "faults", steps: int = STEPS) -> Path:
    cfg = tmp / f"{experiment}.yaml"
    cfg.write_text(
        f"""
experiment: {experiment}
steps: {steps}
arms: [tail_batching]
tracking_uri: {svc.tracking_uri}
store: {{endpoint: "{svc.s3_endpoint}", bucket: {svc.bucket}}}
services: {{ray_address: "{svc.ray_address}", namespace: faults-test}}
task: {{name: synthetic_math, num_examples: 300, val_size: 8}}
model: {{preset: tiny, warmup_steps: 200}}
rollout: {{prompts_per_step: 4, responses_per_prompt: 2, max_tokens: 96}}
engine: {{max_num_seqs: 32, max_model_len: 256, kv_cache_gib: 1}}
planner: {{profile_batches: [1, 8], profile_contexts: [16, 64], profile_window: 4}}
validation: {{every: 100, max_tokens: 64}}
"""
    )
    return cfg


def test_sigkill_at_each_stage_then_rerun_keeps_every_invariant(
    services: devservices.Services, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rollpacker.experiment import run_experiment
    from rollpacker.tracking import ExperimentTracker

    for k, v in services.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv(SERVICES_ENV, str(services.root))  # kill only this Ray cluster's actors
    marks = tmp_path / "marks"
    marks.mkdir()
    from rollpacker.stages.hooks import HOOK_ENV
    from rollpacker.testing.faults import HOOK

    monkeypatch.setenv(HOOK_ENV, HOOK)
    monkeypatch.setenv("ROLLPACKER_FAULT", ",".join(FAULTS))
    monkeypatch.setenv("ROLLPACKER_FAULT_MARK", str(marks))
    cfg_path = _config(services, tmp_path)
    lines: list[str] = []
    out = run_experiment(
        cfg_path,
        runner="kfp",
        retries=len(FAULTS),
        pipeline_root=tmp_path / "kfp",
        start_services=False,
        echo=lines.append,
    )

    # every fault fired once, and each one failed a pipeline run that was then re-run
    fired = sorted(p.name for p in marks.iterdir())
    assert fired == sorted(f.replace("@", "-at-") for f in FAULTS), lines
    (arm,) = out.arms
    assert arm.failures == len(FAULTS)
    assert arm.committed_step == STEPS - 1

    cfg, store, states, chain = _check_chain(cfg_path, STEPS)

    # MLflow (served) holds each committed step exactly once, the commit fault's step included
    tracker = ExperimentTracker(cfg.tracking_uri, cfg.experiment)
    run_id = chain[-1].mlflow_run_id
    hist = tracker.metric_history(run_id, "train/loss")
    assert [s for s, _ in hist] == list(range(1, STEPS + 1))
    overhead = tracker.metric_history(run_id, "pipeline/overhead_s")
    assert len(overhead) == STEPS and all(v >= 0 for _, v in overhead)
    assert tracker.state_pointer(run_id) == (store.uri(states.state_key(STEPS - 1)), STEPS - 1)
    assert os.environ["ROLLPACKER_FAULT"]  # the faults were armed for the whole run

    # resume: the arm's services were stopped at its end; one more step rebuilds them from the
    # object store (weights, optimizer, cursor, queue) and continues the same chain and MLflow run
    monkeypatch.delenv("ROLLPACKER_FAULT")
    cfg_path.write_text(cfg_path.read_text().replace(f"steps: {STEPS}", f"steps: {STEPS + 1}"))
    more = run_experiment(
        cfg_path,
        runner="kfp",
        retries=0,
        pipeline_root=tmp_path / "kfp2",
        start_services=False,
        echo=lines.append,
    )
    assert more.arms[0].steps_run == 1 and more.arms[0].failures == 0
    last = states.latest()
    assert last is not None and last.step == STEPS and last.policy_version == STEPS + 1
    assert last.mlflow_run_id == run_id
    assert [s for s, _ in tracker.metric_history(run_id, "train/loss")] == list(range(1, STEPS + 2))


# a service's Ray actor process killed while a stage waits on it: the rollout service mid-round,
# the reward services as the stage drains them, the trainer mid-round (its stream of gradients)
SERVICE_FAULTS = ("rollout:RolloutService@1", "reward:RewardService@2", "rollout:TrainerService@3")
SERVICE_STEPS = 5


def test_a_killed_service_is_noticed_at_once_and_the_run_recovers_by_itself(
    services: devservices.Services, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each kill fails its step within seconds with the service named; the run's own retries
    rebuild the service from the committed state (no second command); live services find the
    rebuilt peer (no handle to the dead one survives an attempt), and the chain's invariants hold."""
    import time

    from rollpacker.experiment import run_experiment
    from rollpacker.stages.hooks import HOOK_ENV
    from rollpacker.testing.faults import HOOK, mark_name

    for k, v in services.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv(SERVICES_ENV, str(services.root))  # kill only this Ray cluster's actors
    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setenv(HOOK_ENV, HOOK)
    monkeypatch.setenv("ROLLPACKER_FAULT", ",".join(SERVICE_FAULTS))
    monkeypatch.setenv("ROLLPACKER_FAULT_MARK", str(marks))
    cfg_path = _config(services, tmp_path, experiment="faults-svc", steps=SERVICE_STEPS)
    lines: list[str] = []
    stamped: list[tuple[float, str]] = []

    def echo(line: str) -> None:
        lines.append(line)
        stamped.append((time.time(), line))

    out = run_experiment(
        cfg_path,
        runner="kfp",
        retries=2 * len(SERVICE_FAULTS),  # room to spare: each kill should cost one re-run
        pipeline_root=tmp_path / "kfp",
        start_services=False,
        echo=echo,
    )
    fired = sorted(p.name for p in marks.iterdir())
    assert fired == sorted(mark_name(f) for f in SERVICE_FAULTS), lines
    (arm,) = out.arms
    assert arm.committed_step == SERVICE_STEPS - 1, lines
    assert arm.failures == len(SERVICE_FAULTS), lines  # one failed attempt per kill, no more
    # each kill failed its step within seconds (the mark file was written as it fired), and the failed
    # pipeline run's log names the death (or says the service it waited on was rebuilt since)
    failed = [t for t, line in stamped if "a step failed" in line]
    assert len(failed) == len(SERVICE_FAULTS), lines
    logs = sorted((tmp_path / "kfp" / "logs").glob("*.log"))
    assert len(logs) == len(SERVICE_FAULTS) + 1, logs  # one pipeline run per failure, then the last
    for f, noticed, log in zip(
        sorted(SERVICE_FAULTS, key=lambda f: f.rsplit("@")[1]), failed, logs, strict=False
    ):
        text = log.read_text(errors="replace")
        assert "died" in text or "rebuilt since" in text, f"{f}: {log} names no dead or rebuilt service"
        fired_at = (marks / mark_name(f)).stat().st_mtime
        assert 0 <= noticed - fired_at < 30, f"{f}: noticed {noticed - fired_at:.1f} s after the kill"
    _check_chain(cfg_path, SERVICE_STEPS)
