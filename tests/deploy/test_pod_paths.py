"""Nothing but the object store is shared: every local path a stage or a service reads (core/pod_paths)
is mounted from a volume claim on that pod, in the cluster config against the gpu overlay and the
compiled pipeline's platform settings; everything else is an s3:// URI."""

from __future__ import annotations

import copy
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from rollpacker.core.config import arm_config, load_config
from rollpacker.core.pod_paths import CONTROLLER, KFP, PREPARE, RAY, PathRead, Pod, local_paths, path_reads
from tests.pipelines.test_compile import EXECUTOR_COMPONENT, _base

CONFIGS = ("configs/cluster.yaml", "manifests/experiment.yaml", "src/rollpacker/configs/cluster.yaml")


def _claims(docs: list[dict[str, Any]]) -> set[str]:
    return {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}


def ray_mounts(docs: list[dict[str, Any]], group: str) -> list[tuple[str, str]]:
    """(mount path, claim) of each volume claim the group's Ray container mounts."""
    [rc] = [d for d in docs if d["kind"] == "RayCluster"]
    [g] = [g for g in rc["spec"]["workerGroupSpecs"] if g["groupName"] == group]
    spec = g["template"]["spec"]
    claims = {
        v["name"]: v["persistentVolumeClaim"]["claimName"]
        for v in spec.get("volumes", [])
        if "persistentVolumeClaim" in v
    }
    return [
        (m["mountPath"], claims[m["name"]])
        for m in spec["containers"][0].get("volumeMounts", [])
        if m["name"] in claims
    ]


def kfp_mounts(platform: dict[str, Any], component: str) -> list[tuple[str, str]]:
    """(mount path, claim) of each volume claim every task of ``component`` mounts (the ones all of
    its executors share: a path must be there whichever task of it runs)."""
    execs = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    per_exec = [
        {(p["mountPath"], p["constant"]) for p in cfg.get("pvcMount", [])}
        for label, cfg in execs.items()
        if EXECUTOR_COMPONENT[_base(label)] == component
    ]
    assert per_exec, f"no executor of component {component!r}"
    return sorted(set.intersection(*per_exec))


def problems(reads: tuple[PathRead, ...], docs: list[dict[str, Any]], platform: dict[str, Any]) -> list[str]:
    out = []
    claims = _claims(docs)
    for r in reads:
        mounts = kfp_mounts(platform, r.pod.name) if r.pod.kind == KFP else ray_mounts(docs, r.pod.name)
        path = PurePosixPath(r.path)
        under = [(m, c) for m, c in mounts if path == PurePosixPath(m) or PurePosixPath(m) in path.parents]
        if not under:
            out.append(f"{r.setting} = {r.path}: {r.pod} mounts no volume claim there (mounts: {mounts})")
        elif not all(c in claims for _, c in under):
            out.append(f"{r.setting} = {r.path}: {r.pod} mounts claim(s) the overlay does not define")
    return out


@pytest.fixture(scope="module")
def gpu(rendered: dict[str, list[dict[str, Any]]], pipeline_docs: dict[str, list[Any]]) -> tuple[Any, Any]:
    return rendered["gpu"], pipeline_docs["rl_experiment"][1]


def _arms(root: Path, rel: str) -> list[Any]:
    text = (root / rel).read_text()
    return [arm_config(text, name) for name in load_config(root / rel).arm_names]


@pytest.mark.parametrize("rel", CONFIGS)
def test_every_local_path_of_the_cluster_config_is_mounted_where_it_is_read(
    root: Path, gpu: tuple[Any, Any], rel: str
) -> None:
    docs, platform = gpu
    for cfg in _arms(root, rel):
        reads = path_reads(cfg)
        assert {r.setting for r in reads} == {"model.model_dir", "task.name"}  # the config names both
        assert problems(reads, docs, platform) == []


@pytest.mark.parametrize("rel", CONFIGS)
def test_every_path_setting_is_declared_with_its_readers(root: Path, rel: str) -> None:
    """A new setting holding a path (a judge model, a cache dir) fails here until path_reads says
    which pods read it, and then the test above checks they mount it."""
    for cfg in _arms(root, rel):
        assert {k for k, _ in local_paths(cfg)} <= {r.setting for r in path_reads(cfg)}


def test_the_services_reading_the_dataset_path_as_before_fails(root: Path, gpu: tuple[Any, Any]) -> None:
    """Today's reads before the store: the rollout, reward and judge services opened task.name."""
    docs, platform = gpu
    [cfg, *_] = _arms(root, "configs/cluster.yaml")
    before = tuple(PathRead(Pod(RAY, g), "task.name", cfg.task.name) for g in ("rollout", "sandbox", "judge"))
    found = problems(before, docs, platform)
    assert len(found) == 3 and all("/models/data/train.jsonl" in p and "Ray worker group" in p for p in found)


def test_a_controller_without_the_models_volume_fails(root: Path, gpu: tuple[Any, Any]) -> None:
    docs, platform = gpu
    broken = copy.deepcopy(platform)
    for cfg in broken["platforms"]["kubernetes"]["deploymentSpec"]["executors"].values():
        cfg.pop("pvcMount", None)
    reads = path_reads(_arms(root, "configs/cluster.yaml")[0])
    assert [p.split(":")[0] for p in problems(reads, docs, broken)] == [
        "model.model_dir = /models/Qwen2.5-7B",  # the prepare-model task's upload
        "model.model_dir = /models/Qwen2.5-7B",  # the plan's key
        "task.name = /models/data/train.jsonl",
    ]
    no_claim = [d for d in docs if d["kind"] != "PersistentVolumeClaim"]
    assert all("does not define" in p for p in problems(reads, no_claim, platform))


def test_a_path_outside_the_mounts_fails_and_a_store_uri_is_read_by_nobody(
    root: Path, gpu: tuple[Any, Any]
) -> None:
    docs, platform = gpu
    text = (root / "configs/cluster.yaml").read_text()
    moved = text.replace("/models/Qwen2.5-7B", "/data/Qwen2.5-7B")
    cfg = arm_config(moved, "sync")
    assert problems(path_reads(cfg), docs, platform) == [
        f"model.model_dir = /data/Qwen2.5-7B: {pod} mounts no volume claim there "
        "(mounts: [('/models', 'rollpacker-models')])"
        for pod in (PREPARE, CONTROLLER)
    ]
    s3 = arm_config(text.replace("/models/data/train.jsonl", "s3://rollpacker/data/train.jsonl"), "sync")
    assert [r.setting for r in path_reads(s3)] == ["model.model_dir", "model.model_dir"]
