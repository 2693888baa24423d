"""The embedded default experiment (shrunk to 3 cheap steps) through kfp.local on two Ray nodes of
this machine (``two_nodes.py``: a head and a worker node, each in its own mount namespace with a
private ``/tmp`` and ``$HOME``, resources named like the manifests' worker groups): rollout on the
head (only it offers ``rollpacker_rollout``), the megatron gang (DP=2, gloo, one CPU per rank and
one CPU per node) across both, rewards on either. Nothing passes between the nodes but the store,
Ray and the gang's collectives: a path one node wrote is not there on the other.

Mid-step (step 1's rollout) the worker node's raylet is SIGKILLed, taking the gang's rank there
with it; the node is brought back at once, as a cluster's operator (KubeRay) would. The step fails
naming the dead rank and its node, the run's own retry rebuilds the gang from the last committed
checkpoint once the node is back, and every invariant of the fault test holds (one commit per
step, one update per committed step, every prompt trained once or still queued)."""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from rollpacker import devservices
from rollpacker.testing.chain import check_chain

from .two_nodes import WORKER_IP, TwoNodes

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

STEPS = 3
FAULT = "rollout:node-down@1"


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[devservices.Services]:
    """The store and MLflow on the host (network services both nodes reach)."""
    ports = {"seaweed_ports": devservices.SeaweedPorts.free(), "mlflow_port": devservices.free_ports(1)[0]}
    with devservices.running(tmp_path_factory.mktemp("svc"), bucket="twonodes", ray=False, **ports) as svc:
        yield svc


@pytest.fixture(scope="module")
def cluster(services: devservices.Services, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoNodes]:
    # the store's keys reach the nodes as a cluster pod's Secret does: in their environment
    env = {k: v for k, v in services.env().items() if k.startswith("ROLLPACKER_S3_")}
    env["PYTHONPATH"] = os.environ.get("PYTHONPATH", "")
    nodes = TwoNodes(tmp_path_factory.mktemp("nodes"), env)
    try:
        nodes.start()
        yield nodes
    finally:
        nodes.stop()


def _config(svc: devservices.Services, nodes: TwoNodes, tmp: Path) -> Path:
    """The embedded default (``src/rollpacker/configs/experiment.yaml``) on the two nodes, with
    the fault test's small workload."""
    from rollpacker.core.config import apply_overrides

    embedded = Path(devservices.__file__).parent / "configs" / "experiment.yaml"
    data = yaml.safe_load(embedded.read_text())
    apply_overrides(
        data,
        {
            "experiment": "two-nodes",
            "steps": STEPS,
            "arms": ["tail_batching"],
            "tracking_uri": svc.tracking_uri,
            "store": {"endpoint": svc.s3_endpoint, "bucket": svc.bucket},
            "services": {
                "ray_address": nodes.client_address,
                "namespace": "two-nodes",
                "role_resources": True,
            },
            "task": {"name": "synthetic_math", "num_examples": 200, "val_size": 8},
            "model": {"preset": "tiny", "warmup_steps": 200},
            "rollout": {"prompts_per_step": 4, "responses_per_prompt": 2, "max_tokens": 48},
            "engine": {"max_num_seqs": 16, "max_model_len": 200, "kv_cache_gib": 1},
            "planner": {"profile_batches": [1, 8], "profile_contexts": [16, 64], "profile_window": 4},
            "validation": {"every": 100, "max_tokens": 32},
            "train.backend": "megatron",
            "train.megatron": {"dp": 2, "resource": "rollpacker_training"},
            "train.weight_sync": "collective",  # the gang's sending rank to the engine, across nodes
            "reward": {},
        },
    )
    cfg = tmp / "two-nodes.yaml"
    cfg.write_text(yaml.safe_dump(data))
    return cfg


class NodeDown:
    """The fault controller of ``node-down``: the hook's request kills the worker node's raylet
    (its workers go with it), acknowledges, and brings the node back."""

    def __init__(self, nodes: TwoNodes, marks: Path) -> None:
        self.nodes, self.requests = nodes, marks / "requests"
        self.killed: list[int] = []
        self.back_at = 0.0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.wait(0.1):
            for req in sorted(self.requests.glob("*.json")) if self.requests.is_dir() else []:
                ack = req.with_suffix(".ack")
                if ack.exists() or json.loads(req.read_text())["action"] != "node-down":
                    continue
                try:
                    self.killed = self.nodes.kill_worker_raylet()
                    ack.write_text("down")
                    self.nodes.restart_worker()
                    self.back_at = time.time()
                except BaseException as e:  # reported by the test
                    self.error = e
                    ack.write_text("error")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def test_two_nodes_run_survives_the_worker_node_lost_mid_step(
    services: devservices.Services, cluster: TwoNodes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rollpacker.experiment import run_experiment
    from rollpacker.stages.hooks import HOOK_ENV
    from rollpacker.testing.faults import HOOK, mark_name
    from rollpacker.tracking import ExperimentTracker

    for k, v in services.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("RAY_ADDRESS", cluster.client_address)
    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setenv(HOOK_ENV, HOOK)
    monkeypatch.setenv("ROLLPACKER_FAULT", FAULT)
    monkeypatch.setenv("ROLLPACKER_FAULT_MARK", str(marks))
    cfg_path = _config(services, cluster, tmp_path)
    lines: list[str] = []
    controller = NodeDown(cluster, marks)
    try:
        run = functools.partial(run_experiment, runner="kfp", start_services=False, echo=lines.append)
        out = run(cfg_path, retries=2, pipeline_root=tmp_path / "kfp")
    finally:
        controller.close()
    assert controller.error is None, controller.error
    assert (marks / mark_name(FAULT)).exists() and controller.killed, lines
    (arm,) = out.arms
    assert arm.committed_step == STEPS - 1, lines
    assert arm.failures == 1, lines  # the lost node cost one re-run, no more
    logs = sorted((tmp_path / "kfp" / "logs").glob("*.log"))
    failed = logs[0].read_text(errors="replace")
    assert "died" in failed and WORKER_IP in failed, f"{logs[0]} names no lost node"

    # every invariant of the fault test: one commit per step, one update per committed step, the
    # queue and cursor follow, every prompt trained once or still queued; MLflow has each step once
    cfg, _, _, chain = check_chain(cfg_path, STEPS)
    tracker = ExperimentTracker(cfg.tracking_uri, cfg.experiment)
    run_id = chain[-1].mlflow_run_id
    assert [s for s, _ in tracker.metric_history(run_id, "train/loss")] == list(range(1, STEPS + 1))
    # the weights went by the collective push (the object store only as the fallback of a step
    # whose push could not run, which the lost node's step may be)
    pushed = [v for _, v in tracker.metric_history(run_id, "sync/collective")]
    assert len(pushed) == STEPS and sum(pushed) >= STEPS - 1, pushed

    # where things ran: a rank fetched its weights on each node (its own /tmp); the rollout engine
    # got every update by the push, so no node holds a checkpoint copy of the rollout's (with the
    # object-store push the head held them, and the worker never)
    for name in ("head", "worker"):
        assert (cluster.nodes[name].private / "tmp" / "rollpacker-fetch").is_dir(), name
    assert not _cached(cluster, "worker")


def _cached(nodes: TwoNodes, name: str) -> list[Any]:
    return list((nodes.nodes[name].private / "home" / ".cache" / "rollpacker" / "checkpoints").glob("*"))
