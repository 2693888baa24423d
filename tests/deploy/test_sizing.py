"""Checkpoints that fit (core/sizing.py) on the real manifests: the gpu overlay's store, training
and rollout volumes against the shipped 7B config; the 14B / 32B figures in docs/operations.md;
the collective push's kept copy against the rollout group's /dev/shm, refused at load when short."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest

from rollpacker.core.config import arm_config, load_config
from rollpacker.core.errors import ConfigError
from rollpacker.core.sizing import (
    HEADROOM,
    SHIPPED,
    CheckpointPlan,
    Volumes,
    check,
    gib,
    kept_copy_bytes,
    parse_quantity,
    required,
    shm_refusal,
)
from rollpacker.tasks.models import check_model

CACHE_ENV = "ROLLPACKER_CACHE"


def _group(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    [rc] = [d for d in docs if d["kind"] == "RayCluster"]
    [g] = [g for g in rc["spec"]["workerGroupSpecs"] if g["groupName"] == name]
    return g["template"]["spec"]


def scratch(docs: list[dict[str, Any]], group: str) -> tuple[int, str]:
    """The emptyDir mounted at /tmp in the group's Ray container: its sizeLimit."""
    spec = _group(docs, group)
    [m] = [m for m in spec["containers"][0]["volumeMounts"] if m["mountPath"] == "/tmp"]
    [v] = [v for v in spec["volumes"] if v["name"] == m["name"]]
    assert "medium" not in v["emptyDir"], f"{group}: /tmp is memory-backed"
    return parse_quantity(v["emptyDir"]["sizeLimit"]), f"the {group} group's /tmp (emptyDir {v['name']})"


def shm(docs: list[dict[str, Any]], group: str) -> int:
    """The memory-backed emptyDir mounted at /dev/shm in the group's Ray container: its sizeLimit."""
    spec = _group(docs, group)
    [m] = [m for m in spec["containers"][0]["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    [v] = [v for v in spec["volumes"] if v["name"] == m["name"]]
    assert v["emptyDir"]["medium"] == "Memory", f"{group}: /dev/shm is not memory-backed"
    return parse_quantity(v["emptyDir"]["sizeLimit"])


def store(docs: list[dict[str, Any]]) -> tuple[int, str]:
    [ss] = [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "minio"]
    [t] = [t for t in ss["spec"]["volumeClaimTemplates"] if t["metadata"]["name"] == "data"]
    return parse_quantity(t["spec"]["resources"]["requests"]["storage"]), "MinIO's volume (minio data)"


def volumes(docs: list[dict[str, Any]]) -> Volumes:
    return Volumes(store(docs), scratch(docs, "training"), scratch(docs, "rollout"))


@pytest.fixture(scope="module")
def cluster(root: Path) -> tuple[Any, CheckpointPlan]:
    cfg = load_config(root / "manifests" / "experiment.yaml")
    [spec] = [s for s in SHIPPED if s.name == Path(cfg.model.model_dir).name]
    return spec, CheckpointPlan(arms=len(cfg.arms), keep=cfg.checkpoint.keep, staged=True)


def test_the_gpu_overlay_holds_the_7b_checkpoints(
    rendered: dict[str, Any], cluster: tuple[Any, CheckpointPlan]
) -> None:
    spec, layout = cluster
    assert spec.name == "Qwen2.5-7B" and layout.arms == 2
    assert check(spec, layout, volumes(rendered["gpu"])) == []


def test_the_overlay_as_it_was_fails_naming_each_volume(
    rendered: dict[str, Any], cluster: tuple[Any, CheckpointPlan]
) -> None:
    """The sizes before this check: /tmp 20Gi on the training and rollout groups, MinIO 500Gi."""
    docs = copy.deepcopy(rendered["gpu"])
    for group in ("training", "rollout"):
        for v in _group(docs, group)["volumes"]:
            if v["name"] == "tmp":
                v["emptyDir"]["sizeLimit"] = "20Gi"
    [ss] = [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "minio"]
    ss["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] = "500Gi"
    found = check(*cluster, volumes(docs))
    assert [f.split(" is ")[0] for f in found] == [
        "Qwen2.5-7B: MinIO's volume (minio data)",
        "Qwen2.5-7B: the training group's /tmp (emptyDir tmp)",
        "Qwen2.5-7B: the rollout group's /tmp (emptyDir tmp)",
    ]
    assert "is 500 GiB, needs 1030 GiB" in found[0] and "set it to at least 1030Gi" in found[0]


@pytest.mark.parametrize("overlay", ["dev", "gpu"])
def test_every_service_caches_downloads_on_its_sized_tmp(rendered: dict[str, Any], overlay: str) -> None:
    """Checkpoint and dataset downloads land on /tmp (counted above; the sandbox's root is read-only)."""
    for group in ("rollout", "training", "judge", "sandbox"):
        env = {e["name"]: e.get("value") for e in _group(rendered[overlay], group)["containers"][0]["env"]}
        assert env.get(CACHE_ENV, "").startswith("/tmp/"), (overlay, group)


def _docs_rows(root: Path) -> dict[str, list[str]]:
    text = (root / "docs" / "operations.md").read_text()
    section = text.split("## Volumes and sizes per model", 1)[1].split("\n## ", 1)[0]
    rows = [r.strip("|").split("|") for r in section.splitlines() if r.startswith("| Qwen2.5-")]
    return {r[0].strip(): [c.strip() for c in r[1:]] for r in rows}


def test_the_operations_doc_gives_the_sizes_the_check_computes(root: Path) -> None:
    rows = _docs_rows(root)
    assert set(rows) == {s.name for s in SHIPPED}
    for spec in SHIPPED:
        for keep, col in ((2, 1), (1, 2)):
            need = required(spec, CheckpointPlan(arms=2, keep=keep, staged=True))
            assert rows[spec.name][col] == gib(need.store), (spec.name, keep)
        need = required(spec, CheckpointPlan(arms=2, keep=2, staged=True))
        assert rows[spec.name][3] == gib(need.training_scratch), spec.name
        assert rows[spec.name][4] == gib(need.rollout_scratch), spec.name
        assert re.fullmatch(r"\d+ GiB", rows[spec.name][0]), spec.name


def test_the_cluster_config_declares_the_gpu_overlays_rollout_shm(
    rendered: dict[str, Any], root: Path
) -> None:
    cfg = load_config(root / "manifests" / "experiment.yaml")
    assert cfg.services.rollout_shm_gib * 2**30 == shm(rendered["gpu"], "rollout")


@pytest.mark.parametrize("spec", SHIPPED, ids=lambda s: s.name)
def test_the_shipped_sizes_kept_copy_against_the_gpu_overlays_shm(
    rendered: dict[str, Any], root: Path, spec: Any
) -> None:
    """bf16 copies of 15.2 / 29.5 / 65.5 GB (+10 %) against 64Gi: 7B and 14B fit, 32B is refused."""
    have = shm(rendered["gpu"], "rollout")
    cfg = load_config(root / "manifests" / "experiment.yaml", {"services.rollout_shm_gib": have // 2**30})
    fits = kept_copy_bytes(spec.params, cfg.engine.dtype) * HEADROOM <= have
    assert fits == (spec.name != "Qwen2.5-32B")
    why = shm_refusal(cfg, spec.params, spec.name)
    assert (why == "") == fits, why
    if not fits:
        assert why.startswith(
            f"{spec.name}: the rollout pods' /dev/shm (services.rollout_shm_gib = 64) is 64 GiB"
        )


def test_a_pair_whose_shm_cannot_hold_the_kept_copy_is_refused_at_load(root: Path) -> None:
    """``submit``'s model check (the model on the cluster's volume, sized by its name): the shipped
    pair passes, the same config with a planted 8Gi /dev/shm is refused naming the model."""
    text = (root / "manifests" / "experiment.yaml").read_text()
    said: list[str] = []
    check_model(arm_config(text, "sync"), local=False, log=said.append)
    assert said and "not readable here" in said[0]
    planted = text.replace("rollout_shm_gib: 64", "rollout_shm_gib: 8")
    assert planted != text
    with pytest.raises(
        ConfigError, match=r"Qwen2.5-7B: the rollout pods' /dev/shm .* is 8 GiB, needs 16 GiB"
    ):
        check_model(arm_config(planted, "sync"), local=False)
