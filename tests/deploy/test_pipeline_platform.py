"""The compiled pipelines' Kubernetes platform config (pipelines/platform.py through kfp-kubernetes):
parsed strictly (tests/pipelines/spec.py's parser), every task placed, resourced and given its
Secrets; the images it names are checked against images/ in test_manifests.py."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import json_format

from rollpacker import deploy
from rollpacker.pipeline_compile import compile_pipelines
from tests.pipelines.spec import containers, load_docs, parse_strict
from tests.pipelines.test_compile import EXECUTOR_COMPONENT, STEP_EXECUTORS

COMPONENT = EXECUTOR_COMPONENT  # executor (less its -N suffix) -> components/<folder>


def _executors(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return docs[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]


@pytest.mark.parametrize("name", ["rl_step", "rl_experiment"])
def test_platform_config_parses_strictly_and_covers_every_executor(
    pipeline_docs: dict[str, list[Any]], name: str
) -> None:
    docs = pipeline_docs[name]
    spec, platform = parse_strict(docs)
    assert platform is not None, "no Kubernetes platform document"
    execs = _executors(docs)
    assert set(execs) == set(containers(spec))  # every executor, nothing else
    want = set(COMPONENT) if name == "rl_experiment" else STEP_EXECUTORS
    assert {re.sub(r"-\d+$", "", e) for e in execs} == want


@pytest.mark.parametrize("name", ["rl_step", "rl_experiment"])
def test_every_task_is_placed_resourced_and_given_its_secrets(
    pipeline_docs: dict[str, list[Any]], name: str
) -> None:
    from pipelines import platform as plat

    docs = pipeline_docs[name]
    spec = parse_strict(docs)[0]
    resources = {label: c["resources"] for label, c in containers(spec).items()}
    for label, cfg in _executors(docs).items():
        component = COMPONENT[re.sub(r"-\d+$", "", label)]
        cpu, memory, limit = plat.RESOURCES[component]
        assert resources[label]["resourceCpuRequest"] == cpu, label
        assert resources[label]["resourceMemoryRequest"] == memory, label
        assert resources[label]["resourceMemoryLimit"] == limit, label
        assert cfg["nodeSelector"]["labels"] == {"rollpacker.io/pool": "cpu"}, label
        assert cfg["tolerations"] == [
            {"key": "rollpacker.io/dedicated", "operator": "Exists", "effect": "NoSchedule"}
        ]
        envs = {
            k["envVar"]: (s["secretName"], k["secretKey"]) for s in cfg["secretAsEnv"] for k in s["keyToEnv"]
        }
        assert envs == {
            "ROLLPACKER_S3_ACCESS_KEY": ("rollpacker-s3", "ROLLPACKER_S3_ACCESS_KEY"),
            "ROLLPACKER_S3_SECRET_KEY": ("rollpacker-s3", "ROLLPACKER_S3_SECRET_KEY"),
            "RAY_AUTH_TOKEN": ("rollpacker-ray-token", "auth_token"),
        }, label
        cm = {k["envVar"] for m in cfg["configMapAsEnv"] for k in m["keyToEnv"]}
        assert cm == {"RAY_ADDRESS", "RAY_AUTH_MODE"}
        assert cfg["securityContext"]["runAsNonRoot"] is True
        assert cfg["imagePullPolicy"] == "IfNotPresent", label  # pods start from the node's image
        mounts = [(p["constant"], p["mountPath"]) for p in cfg.get("pvcMount", [])]
        # model.model_dir is read by the controller (its key) and the model preparation (its upload)
        models = component in ("controller", "prepare_model")
        assert mounts == ([("rollpacker-models", "/models")] if models else []), label


def test_node_pool_is_chosen_at_compile_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLPACKER_NODE_POOL", "")
    execs = _executors(load_docs(compile_pipelines(tmp_path / "any", 1)[0]))
    assert all("nodeSelector" not in cfg for cfg in execs.values())
    monkeypatch.setenv("ROLLPACKER_NODE_POOL", "system")
    execs = _executors(load_docs(compile_pipelines(tmp_path / "sys", 1)[0]))
    assert {cfg["nodeSelector"]["labels"]["rollpacker.io/pool"] for cfg in execs.values()} == {"system"}


def test_image_pull_policy_is_chosen_at_compile_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLPACKER_IMAGE_PULL_POLICY", "Always")
    execs = _executors(load_docs(compile_pipelines(tmp_path / "always", 1)[0]))
    assert {cfg["imagePullPolicy"] for cfg in execs.values()} == {"Always"}
    monkeypatch.setenv("ROLLPACKER_IMAGE_PULL_POLICY", "sometimes")
    with pytest.raises(ValueError, match="ROLLPACKER_IMAGE_PULL_POLICY = 'sometimes'"):
        compile_pipelines(tmp_path / "bad", 1)


def test_unknown_component_is_refused() -> None:
    from pipelines.platform import on_cluster

    with pytest.raises(KeyError, match="unknown component 'trainer'"):
        on_cluster(object(), "trainer")


def test_planted_unknown_field_in_an_executor_config_fails(pipeline_docs: dict[str, list[Any]]) -> None:
    from kfp.kubernetes import kubernetes_executor_config_pb2 as k8s

    raw = copy.deepcopy(_executors(pipeline_docs["rl_step"])["exec-rollout"])
    raw["nodeSelectorr"] = raw.pop("nodeSelector")
    platform = {"platforms": {"kubernetes": {"deploymentSpec": {"executors": {"exec-rollout": raw}}}}}
    # the PlatformSpec holds executor configs as Structs, so its strict parse lets the typo through ...
    parse_strict([pipeline_docs["rl_step"][0], platform])
    # ... which is why each executor config is also parsed as a KubernetesExecutorConfig
    with pytest.raises(json_format.ParseError, match="nodeSelectorr"):
        json_format.ParseDict(raw, k8s.KubernetesExecutorConfig(), ignore_unknown_fields=False)


@pytest.mark.parametrize("name", ["rl_step", "rl_experiment"])
def test_every_executor_config_parses_as_kubernetes_executor_config(
    pipeline_docs: dict[str, list[Any]], name: str
) -> None:
    from kfp.kubernetes import kubernetes_executor_config_pb2 as k8s

    for label, raw in _executors(pipeline_docs[name]).items():
        cfg = json_format.ParseDict(raw, k8s.KubernetesExecutorConfig(), ignore_unknown_fields=False)
        assert cfg.node_selector.labels["rollpacker.io/pool"] == "cpu", label


def test_a_pipeline_image_images_does_not_build_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, root: Path
) -> None:
    monkeypatch.setenv("ROLLPACKER_IMAGE_JUDGE", "ghcr.io/rollpacker/judge:9.9.9")
    docs = load_docs(compile_pipelines(tmp_path, 1)[0])
    (problem,) = deploy.check_images(deploy.pipeline_images(docs[0]), root)
    assert "exec-judge" in problem and "judge:9.9.9" in problem
