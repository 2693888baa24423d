"""manifests/: both overlays render with kubectl kustomize and pass every check (core schemas strict,
the RayCluster against the KubeRay CRD, images, references); each check fails on a planted error."""

from __future__ import annotations

import copy
import hashlib
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from rollpacker import deploy
from tests.deploy.conftest import OVERLAYS

SHARED_SCHEMA = Path(__file__).resolve().parents[3] / "shared" / "schemas" / "ray.io_rayclusters.yaml"
GROUPS = ["rollout", "training", "judge", "sandbox"]  # the overlays' JSON patches index them


def _one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return copy.deepcopy(found[0])


def _containers(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [
        (w, c) for w, s in deploy.pod_specs(docs) for c in [*s.get("initContainers", []), *s["containers"]]
    ]


# --- every check passes on both overlays -----------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_every_component(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    kinds = {deploy._kn(d) for d in rendered[overlay]}
    for want in (
        "Namespace/rollpacker",
        "StatefulSet/minio",
        "Service/minio",
        "Job/rollpacker-minio-init",
        "Deployment/mlflow",
        "StatefulSet/mlflow-db",
        "RayCluster/rollpacker",
        "NetworkPolicy/rollpacker-sandbox-deny-egress",
        "ServiceAccount/rollpacker-pipeline",
        "Role/rollpacker-pipeline-runner",
        "RoleBinding/rollpacker-pipeline-runner",
        "Secret/rollpacker-minio",
        "Secret/rollpacker-s3",
        "Secret/rollpacker-mlflow-db",
        "Secret/rollpacker-ray-token",
    ):
        assert want in kinds, f"{overlay}: {want} missing"
    assert all(
        d["metadata"].get("namespace") == "rollpacker" for d in rendered[overlay] if d["kind"] != "Namespace"
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_core_resources_pass_strict_schema_validation(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    docs = rendered[overlay]
    assert sum(deploy.is_core(d) for d in docs) >= 20
    assert deploy.validate_core(docs) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_raycluster_passes_the_kuberay_crd_schema(
    rendered: dict[str, list[dict[str, Any]]], overlay: str, root: Path
) -> None:
    assert deploy.validate_rayclusters(rendered[overlay], root / deploy.RAYCLUSTER_SCHEMA) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_image_is_built_by_images_or_pinned_upstream(
    rendered: dict[str, list[dict[str, Any]]], pipeline_docs: dict[str, list[Any]], overlay: str, root: Path
) -> None:
    refs = deploy.manifest_images(rendered[overlay])
    for docs in pipeline_docs.values():
        refs.update(deploy.pipeline_images(docs[0]))
    assert len(refs) >= 6
    assert deploy.check_images(refs, root) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_secret_configmap_and_volume_used_is_defined(
    rendered: dict[str, list[dict[str, Any]]], pipeline_docs: dict[str, list[Any]], overlay: str
) -> None:
    for docs in pipeline_docs.values():
        assert deploy.check_references(rendered[overlay], docs[1]) == []


def test_validate_overlay_runs_every_check(
    manifests: Path, root: Path, pipeline_docs: dict[str, Any]
) -> None:
    assert deploy.validate_overlay(manifests / "overlays" / "gpu", root, pipeline_docs["rl_step"]) == []


# --- planted errors: each check catches its kind -----------------------------------------------------


def test_planted_field_typo_in_a_core_resource_fails(rendered: dict[str, list[dict[str, Any]]]) -> None:
    dep = _one(rendered["dev"], "Deployment", "mlflow")
    dep["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    (problem,) = deploy.validate_core([dep])
    assert "Deployment/mlflow" in problem and "imagePullPolicyy" in problem


def test_planted_wrong_type_in_a_core_resource_fails(rendered: dict[str, list[dict[str, Any]]]) -> None:
    sts = _one(rendered["gpu"], "StatefulSet", "minio")
    sts["spec"]["replicas"] = "one"
    (problem,) = deploy.validate_core([sts])
    assert "spec/replicas" in problem and "'one'" in problem


def test_planted_unknown_raycluster_field_fails(
    rendered: dict[str, list[dict[str, Any]]], root: Path
) -> None:
    rc = _one(rendered["gpu"], "RayCluster")
    rc["spec"]["workerGroupSpecs"][0]["replicaz"] = 2
    rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    problems = deploy.validate_rayclusters([rc], root / deploy.RAYCLUSTER_SCHEMA)
    assert len(problems) == 2, problems
    assert any("workerGroupSpecs/0" in p and "'replicaz' was unexpected" in p for p in problems)
    assert any("containers/0" in p and "imagePullPolicyy" in p for p in problems)


def test_planted_wrong_type_in_raycluster_fails(
    rendered: dict[str, list[dict[str, Any]]], root: Path
) -> None:
    rc = _one(rendered["dev"], "RayCluster")
    rc["spec"]["workerGroupSpecs"][1]["minReplicas"] = "one"
    (problem,) = deploy.validate_rayclusters([rc], root / deploy.RAYCLUSTER_SCHEMA)
    assert "workerGroupSpecs/1/minReplicas" in problem


def test_raycluster_with_an_unknown_api_version_fails(
    rendered: dict[str, list[dict[str, Any]]], root: Path
) -> None:
    rc = _one(rendered["dev"], "RayCluster")
    rc["apiVersion"] = "ray.io/v2"
    (problem,) = deploy.validate_rayclusters([rc], root / deploy.RAYCLUSTER_SCHEMA)
    assert "ray.io/v2" in problem


def test_planted_missing_image_fails(rendered: dict[str, list[dict[str, Any]]], root: Path) -> None:
    docs = copy.deepcopy(rendered["gpu"])
    rc = next(d for d in docs if d["kind"] == "RayCluster")
    rc["spec"]["workerGroupSpecs"][2]["template"]["spec"]["containers"][0]["image"] = (
        "ghcr.io/rollpacker/evaluator:0.1.0"
    )
    (problem,) = deploy.check_images(deploy.manifest_images(docs), root)
    assert "evaluator:0.1.0" in problem and "images/evaluator/Dockerfile does not exist" in problem


@pytest.mark.parametrize(
    "ref",
    [
        "ghcr.io/rollpacker/controller:0.2.0",  # ours, a version images/ does not build
        "ghcr.io/rollpacker/sandbox:0.1.0-gpu",  # ours, a flavor images/ does not build
        "quay.io/minio/minio:latest",  # upstream, not the pinned one
        "docker.io/library/redis:7",  # upstream, not in versions.env at all
    ],
)
def test_images_not_built_or_pinned_fail(ref: str, root: Path) -> None:
    (problem,) = deploy.check_images({ref: "somewhere"}, root)
    assert ref in problem


def test_planted_missing_secret_key_fails(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = copy.deepcopy(rendered["dev"])
    dep = next(d for d in docs if d["kind"] == "Deployment")
    env = dep["spec"]["template"]["spec"]["containers"][0]["env"]
    next(e for e in env if e["name"] == "AWS_ACCESS_KEY_ID")["valueFrom"]["secretKeyRef"]["key"] = (
        "ACCESS_KEY"
    )
    (problem,) = deploy.check_references(docs)
    assert "Secret rollpacker-s3 has no key 'ACCESS_KEY'" in problem


def test_pipeline_secret_missing_from_the_overlay_fails(
    rendered: dict[str, list[dict[str, Any]]], pipeline_docs: dict[str, list[Any]]
) -> None:
    docs = [
        d for d in rendered["gpu"] if not (d["kind"] == "Secret" and d["metadata"]["name"] == "rollpacker-s3")
    ]
    problems = deploy.check_references(docs, pipeline_docs["rl_step"][1])
    assert problems and all("Secret rollpacker-s3 is not defined" in p for p in problems)
    assert any(p.startswith("pipeline exec-controller-plan") for p in problems)


def test_broken_overlay_fails_to_render(manifests: Path, tmp_path: Path) -> None:
    copy_ = tmp_path / "m"
    shutil.copytree(manifests, copy_)
    patch = copy_ / "overlays" / "dev" / "raycluster.yaml"
    patch.write_text(patch.read_text().replace("/workerGroupSpecs/3/", "/workerGroupSpecs/7/"))
    with pytest.raises(deploy.DeployError, match="kubectl kustomize"):
        deploy.render(copy_ / "overlays" / "dev")


def test_missing_secret_env_file_fails_to_render(manifests: Path, tmp_path: Path) -> None:
    copy_ = tmp_path / "m"
    shutil.copytree(manifests, copy_)
    (copy_ / "secrets" / "s3.env").unlink()
    with pytest.raises(deploy.DeployError, match=r"s3\.env"):
        deploy.render(copy_ / "overlays" / "gpu")


# --- what the overlays and the base promise ------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_requests_cpu_and_memory(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    containers = _containers(rendered[overlay])
    assert len(containers) >= 9
    for where, c in containers:
        requests = c.get("resources", {}).get("requests", {})
        assert {"cpu", "memory"} <= set(requests), f"{overlay}: {where} {c['name']} requests {requests}"
        assert "memory" in c["resources"].get("limits", {}), (
            f"{overlay}: {where} {c['name']}: no memory limit"
        )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_worker_groups_in_the_order_the_patches_assume(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    rc = _one(rendered[overlay], "RayCluster")
    assert [g["groupName"] for g in rc["spec"]["workerGroupSpecs"]] == GROUPS
    for g in rc["spec"]["workerGroupSpecs"]:
        assert g["template"]["metadata"]["labels"]["rollpacker.io/role"] == g["groupName"]
        image = g["template"]["spec"]["containers"][0]["image"]
        assert image.startswith(f"ghcr.io/rollpacker/{g['groupName']}:"), image
        assert g["rayStartParams"]["resources"] == f'"{{\\"rollpacker_{g["groupName"]}\\": 1000}}"'


def test_dev_overlay_is_cpu_only_and_small(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for where, c in _containers(rendered["dev"]):
        limits = c["resources"].get("limits", {})
        assert not any("nvidia.com" in k for k in limits), f"{where}: {limits}"
    rc = _one(rendered["dev"], "RayCluster")
    for g in rc["spec"]["workerGroupSpecs"]:
        assert g["replicas"] == 1
        assert g["template"]["spec"]["nodeSelector"] == {"rollpacker.io/pool": "cpu"}
    rollout = rc["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert rollout["image"] == "ghcr.io/rollpacker/rollout:0.1.0-cpu"  # vLLM's CPU build


def test_gpu_overlay_puts_gpu_roles_on_gpu_pools(rendered: dict[str, list[dict[str, Any]]]) -> None:
    rc = _one(rendered["gpu"], "RayCluster")
    groups = {g["groupName"]: g["template"]["spec"] for g in rc["spec"]["workerGroupSpecs"]}
    for role in ("rollout", "training"):
        assert groups[role]["nodeSelector"] == {"rollpacker.io/pool": "gpu"}
        assert groups[role]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in groups[role][
            "tolerations"
        ]
    judge = groups["judge"]
    assert judge["nodeSelector"] == {"rollpacker.io/pool": "gpu-mps"}
    assert judge["containers"][0]["resources"]["limits"]["nvidia.com/gpu.shared"] == 1
    env = {e["name"]: e.get("value") for e in judge["containers"][0]["env"]}
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert groups["sandbox"]["nodeSelector"] == {"rollpacker.io/pool": "cpu"}
    assert "nvidia.com/gpu" not in groups["sandbox"]["containers"][0]["resources"]["limits"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_sandbox_workers_are_locked_down(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    docs = rendered[overlay]
    rc = _one(docs, "RayCluster")
    spec = rc["spec"]["workerGroupSpecs"][3]["template"]
    pod, (c,) = spec["spec"], spec["spec"]["containers"]
    assert pod["serviceAccountName"] == "rollpacker-sandbox" and pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {
        "type": "Localhost",
        "localhostProfile": "profiles/rollpacker-sandbox.json",
    }
    assert c["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
    }
    # no credentials: only the Ray token reaches the sandbox workers
    secrets = {e["valueFrom"]["secretKeyRef"]["name"] for e in c["env"] if "valueFrom" in e}
    assert secrets == {"rollpacker-ray-token"} and "envFrom" not in c
    # the NetworkPolicy selects exactly these pods and limits their egress to Ray pods and DNS
    np = _one(docs, "NetworkPolicy")
    assert np["spec"]["podSelector"]["matchLabels"].items() <= spec["metadata"]["labels"].items()
    assert "Egress" in np["spec"]["policyTypes"]
    others = [g for g in rc["spec"]["workerGroupSpecs"][:3]]
    assert all(
        not np["spec"]["podSelector"]["matchLabels"].items() <= g["template"]["metadata"]["labels"].items()
        for g in others
    )
    peers = [p for rule in np["spec"]["egress"] for p in rule["to"]]
    assert peers[0] == {"podSelector": {"matchLabels": {"ray.io/cluster": "rollpacker"}}}
    assert peers[1]["podSelector"] == {"matchLabels": {"k8s-app": "kube-dns"}}
    assert len(peers) == 2


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_pods_take_the_store_keys_from_the_secret(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    """The services (head, rollout, training, judge pods) read the store's keys from the Secret in
    their own environment: the service registry forwards none through Ray's runtime env, which Ray
    keeps in its GCS and shows on its dashboard."""
    rc = _one(rendered[overlay], "RayCluster")
    pods = [rc["spec"]["headGroupSpec"]["template"]] + [
        g["template"] for g in rc["spec"]["workerGroupSpecs"][:3]
    ]
    for pod in pods:
        env = pod["spec"]["containers"][0]["env"]
        refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in env if "valueFrom" in e}
        for key in ("ROLLPACKER_S3_ACCESS_KEY", "ROLLPACKER_S3_SECRET_KEY"):
            assert refs.get(key) == {"name": "rollpacker-s3", "key": key}, (overlay, key)


def test_seccomp_profile_lets_nsjail_make_namespaces(root: Path) -> None:
    import json

    profile = json.loads((root / "manifests" / "seccomp" / "rollpacker-sandbox.json").read_text())
    denied = {n for rule in profile["syscalls"] for n in rule["names"] if rule["action"] == "SCMP_ACT_ERRNO"}
    assert profile["defaultAction"] == "SCMP_ACT_ALLOW"
    assert {"unshare", "clone", "clone3", "mount", "pivot_root", "umount2"}.isdisjoint(denied)
    assert {"bpf", "kexec_load", "init_module", "ptrace", "keyctl", "userfaultfd"} <= denied


def test_mlflow_server_has_allowed_hosts_postgres_and_minio_artifacts(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    c = _one(rendered["gpu"], "Deployment", "mlflow")["spec"]["template"]["spec"]["containers"][0]
    args = dict(a.removeprefix("--").split("=", 1) for a in c["args"] if "=" in a)
    assert "mlflow:5000" in args["allowed-hosts"].split(",")
    assert args["backend-store-uri"].startswith(
        "postgresql://$(POSTGRES_USER):$(POSTGRES_PASSWORD)@mlflow-db"
    )
    assert args["artifacts-destination"] == "s3://rollpacker/mlflow-artifacts"
    env = {e["name"]: e for e in c["env"]}
    assert env["MLFLOW_S3_ENDPOINT_URL"]["value"] == "http://minio:9000"


def test_pipeline_runner_role_is_namespaced_and_cannot_write_secrets(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = rendered["gpu"]
    role = _one(docs, "Role")
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    for rule in role["rules"]:
        if "secrets" in rule["resources"]:
            assert rule["verbs"] == ["get"]
    binding = _one(docs, "RoleBinding")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "rollpacker-pipeline", "namespace": "rollpacker"}
    ]


# --- secrets never in plain text, the schema's provenance -------------------------------------------------


def test_no_secret_values_in_the_repository(root: Path) -> None:
    committed = [p for p in (root / "manifests").rglob("*") if p.is_file() and p.suffix != ".env"]
    committed = [p for p in committed if p.parent.name != "schemas"]  # the CRD: no Secret, 0.9 MB
    for path in committed:
        text = path.read_text()
        docs = list(yaml.safe_load_all(text)) if path.suffix == ".yaml" else []
        assert not any(isinstance(d, dict) and d.get("kind") == "Secret" for d in docs), path
        assert not re.search(r"(PASSWORD|SECRET_KEY|auth_token)\s*[:=]\s*\S{8,}", text), path
    assert "manifests/secrets/*.env" in (root / ".gitignore").read_text().splitlines()


def test_generated_secrets_are_random_private_and_kept(tmp_path: Path) -> None:
    written = deploy.generate_secrets(tmp_path)
    assert sorted(p.name for p in written) == sorted(deploy.SECRET_FILES)
    values = {}
    for p in written:
        assert p.stat().st_mode & 0o777 == 0o600
        pairs = dict(line.split("=", 1) for line in p.read_text().splitlines())
        assert set(pairs) == set(deploy.SECRET_FILES[p.name])
        values.update(pairs)
    assert len(values["MINIO_ROOT_PASSWORD"]) >= 32 and values["MINIO_ROOT_PASSWORD"] != values["auth_token"]
    before = (tmp_path / "s3.env").read_text()
    assert deploy.generate_secrets(tmp_path) == []  # kept
    assert (tmp_path / "s3.env").read_text() == before
    assert len(deploy.generate_secrets(tmp_path, force=True)) == 4
    assert (tmp_path / "s3.env").read_text() != before


def test_vendored_raycluster_schema_matches_its_recorded_source(root: Path) -> None:
    vendored = root / deploy.RAYCLUSTER_SCHEMA
    digest = hashlib.sha256(vendored.read_bytes()).hexdigest()
    assert digest in (root / "manifests" / "schemas" / "README.md").read_text()
    if SHARED_SCHEMA.is_file():  # CI on a clean clone may not have ../shared
        assert SHARED_SCHEMA.read_bytes() == vendored.read_bytes()
    crd = yaml.load(vendored.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    strict = deploy._strict(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    worker = strict["properties"]["spec"]["properties"]["workerGroupSpecs"]["items"]
    assert worker["additionalProperties"] is False
    # maps the CRD leaves open stay open (labels, rayStartParams)
    assert worker["properties"]["rayStartParams"]["additionalProperties"] == {"type": "string"}


def test_cluster_experiment_config_loads_and_names_the_manifests_services(
    rendered: dict[str, list[dict[str, Any]]], root: Path
) -> None:
    from rollpacker.core.config import load_config

    cfg = load_config(root / "manifests" / "experiment.yaml")
    docs = rendered["gpu"]
    ports = {
        d["metadata"]["name"]: {p["port"] for p in d["spec"]["ports"]} for d in docs if d["kind"] == "Service"
    }
    host, port = cfg.store.endpoint.split(":")
    assert int(port) in ports[host]
    job = _one(docs, "Job")["spec"]["template"]["spec"]["containers"][0]
    assert {e["name"]: e.get("value") for e in job["env"]}["BUCKET"] == cfg.store.bucket
    mlflow = cfg.tracking_uri.removeprefix("http://").split(":")
    assert int(mlflow[1]) in ports[mlflow[0]]
    assert cfg.store.access_key_env == "ROLLPACKER_S3_ACCESS_KEY"  # the name pipelines/platform.py sets
    assert cfg.model.model_dir.startswith("/models/") and cfg.services.ray_address == ""


def test_every_service_role_asks_for_a_resource_a_worker_group_offers(
    rendered: dict[str, list[dict[str, Any]]], root: Path
) -> None:
    import json

    from rollpacker.core.config import load_config
    from rollpacker.services.registry import ROLE_RESOURCE, ROLES

    assert load_config(root / "manifests" / "experiment.yaml").services.role_resources
    for overlay, docs in rendered.items():
        rc = _one(docs, "RayCluster")
        offered = {
            k
            for g in rc["spec"]["workerGroupSpecs"]
            for k in json.loads(json.loads(g["rayStartParams"]["resources"]))
        }
        assert {ROLE_RESOURCE[r] for r in ROLES} <= offered, overlay
