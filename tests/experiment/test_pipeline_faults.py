"""The RL-step pipeline survives a SIGKILL of the process running a stage, at each of rollout,
reward, training and commit, and of each service's Ray actor while a stage waits on it, all in one
run through kfp.local with the services in a real Ray cluster, the state in a real S3 server
(SeaweedFS) and the metrics in a real MLflow server.

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

# the process running a stage SIGKILLed, at each of rollout, reward, training and commit; then a
# service's Ray actor process killed while a stage waits on it: the rollout service mid-round, the
# reward services as the stage drains them, the trainer mid-round (its stream of gradients). Two
# faults share a step where their points differ: the earlier point's fault fails the first attempt,
# the later one's the re-run, and the third attempt commits (each fault still costs one re-run).
STAGE_FAULTS = ("reward@1", "train@2", "commit@3", "rollout@4")
SERVICE_FAULTS = ("rollout:RolloutService@1", "reward:RewardService@2", "rollout:TrainerService@3")
FAULTS = (*STAGE_FAULTS, *SERVICE_FAULTS)
STEPS = 5
POINTS = ("plan", "rollout", "reward", "judge", "train", "commit")  # a step's hook points, in order


def _firing_order(fault: str) -> tuple[int, int]:
    """(step, point): the order the faults fire in over the run."""
    where, _, step = fault.rpartition("@")
    return int(step), POINTS.index(where.partition(":")[0])


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


def _config(svc: devservices.Services, tmp: Path) -> Path:
    cfg = tmp / "faults.yaml"
    cfg.write_text(
        f"""
experiment: faults
steps: {STEPS}
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


def test_sigkills_of_stages_and_services_are_recovered_within_the_run_and_every_invariant_holds(
    services: devservices.Services, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One run, seven faults over steps 1..4: each costs exactly one re-run inside the same run
    (no second command). A killed service fails its step within seconds with the service named;
    the run's retries rebuild it from the committed state, and live services find the rebuilt peer
    (no handle to the dead one survives an attempt). Then the chain's invariants, MLflow holding
    each step once (the commit fault's step included), and a resume with fresh services."""
    import time

    from rollpacker.experiment import run_experiment
    from rollpacker.stages.hooks import HOOK_ENV
    from rollpacker.testing.faults import HOOK, mark_name
    from rollpacker.tracking import ExperimentTracker

    for k, v in services.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv(SERVICES_ENV, str(services.root))  # kill only this Ray cluster's actors
    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setenv(HOOK_ENV, HOOK)
    monkeypatch.setenv("ROLLPACKER_FAULT", ",".join(FAULTS))
    monkeypatch.setenv("ROLLPACKER_FAULT_MARK", str(marks))
    cfg_path = _config(services, tmp_path)
    lines: list[str] = []
    stamped: list[tuple[float, str]] = []

    def echo(line: str) -> None:
        lines.append(line)
        stamped.append((time.time(), line))

    out = run_experiment(
        cfg_path,
        runner="kfp",
        retries=len(FAULTS) + len(SERVICE_FAULTS),  # room to spare: each fault should cost one re-run
        pipeline_root=tmp_path / "kfp",
        start_services=False,
        echo=echo,
    )

    # every fault fired once, and each one failed a pipeline run that was then re-run
    fired = sorted(p.name for p in marks.iterdir())
    assert fired == sorted(mark_name(f) for f in FAULTS), lines
    (arm,) = out.arms
    assert arm.committed_step == STEPS - 1, lines
    assert arm.failures == len(FAULTS), lines  # one failed attempt per fault, no more
    failed = [t for t, line in stamped if "a step failed" in line]
    assert len(failed) == len(FAULTS), lines
    logs = sorted((tmp_path / "kfp" / "logs").glob("*.log"))
    assert len(logs) == len(FAULTS) + 1, logs  # one pipeline run per failure, then the last
    # each service kill failed its step within seconds (the mark file was written as it fired), and
    # the failed pipeline run's log names the death (or says the service it waited on was rebuilt)
    by_step = sorted(FAULTS, key=_firing_order)
    for f, noticed, log in zip(by_step, failed, logs[:-1], strict=True):
        if f not in SERVICE_FAULTS:
            continue
        text = log.read_text(errors="replace")
        assert "died" in text or "rebuilt since" in text, f"{f}: {log} names no dead or rebuilt service"
        fired_at = (marks / mark_name(f)).stat().st_mtime
        assert 0 <= noticed - fired_at < 30, f"{f}: noticed {noticed - fired_at:.1f} s after the kill"

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
