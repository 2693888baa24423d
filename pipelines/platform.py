"""The Kubernetes side of every RL-step task, through kfp-kubernetes (ignored by ``kfp.local``).

Each task gets: CPU/memory requests (the stages drive Ray services; the heavy work runs in the
RayCluster, not in the task's pod), the node pool ``rollpacker.io/pool=<pool>`` and a toleration for
a pool tainted ``rollpacker.io/dedicated``, the S3 keys and the Ray token from the Secrets that
``make secrets`` generates (``manifests/secrets``), the Ray address / auth mode from the ConfigMap
``rollpacker-endpoints``, and a non-root security context. The controller and prepare-model tasks
also mount the models volume at ``/models`` (``model.model_dir`` in the cluster config; the
prepare-model task uploads the start checkpoint from it, the plan stage keys it by its files). The
names here are the manifests' (``manifests/base``); tests/deploy checks that the rendered overlays
define every one of them.

``ROLLPACKER_NODE_POOL`` (read at compile time like the images) picks the pool; empty: no selector.
``ROLLPACKER_IMAGE_PULL_POLICY`` (default ``IfNotPresent``) is every task's image pull policy: a
task's pod then starts from the node's cached image instead of asking the registry each step (with
the images pre-pulled on the pool's nodes, docs/pipeline.md "Overhead"); ``Always`` for mutable tags.
"""

from __future__ import annotations

import os

from kfp import kubernetes

POOL_LABEL = "rollpacker.io/pool"
TAINT_KEY = "rollpacker.io/dedicated"
DEFAULT_POOL = "cpu"
RUN_AS_USER = 10001  # the images' user

SECRET_ENV: dict[str, dict[str, str]] = {
    "rollpacker-s3": {
        "ROLLPACKER_S3_ACCESS_KEY": "ROLLPACKER_S3_ACCESS_KEY",
        "ROLLPACKER_S3_SECRET_KEY": "ROLLPACKER_S3_SECRET_KEY",
    },
    "rollpacker-ray-token": {"auth_token": "RAY_AUTH_TOKEN"},
}
CONFIG_MAP = "rollpacker-endpoints"
CONFIG_MAP_ENV = {"RAY_ADDRESS": "RAY_ADDRESS", "RAY_AUTH_MODE": "RAY_AUTH_MODE"}
MODELS_PVC = "rollpacker-models"
MODELS_PATH = "/models"
# the tasks that read ``model.model_dir`` there (core/pod_paths.py): the model preparation uploads it
# to the store, the plan stage hashes it into the start model's key
MODELS_MOUNTED = ("controller", "prepare_model")

# component folder -> (cpu request, memory request, memory limit)
RESOURCES: dict[str, tuple[str, str, str]] = {
    "controller": ("1", "2Gi", "8Gi"),  # plan publishes the dataset, commit logs plots
    "profiling": ("500m", "1Gi", "2Gi"),
    "rollout": ("500m", "1Gi", "2Gi"),
    "sandbox_reward": ("500m", "1Gi", "2Gi"),
    "judge": ("500m", "1Gi", "2Gi"),
    "training": ("500m", "1Gi", "2Gi"),
    "prepare_model": ("1", "2Gi", "8Gi"),  # a warm-up trains in the pod; model.model_dir is uploaded
}


PULL_POLICIES = ("IfNotPresent", "Always", "Never")


def pull_policy() -> str:
    """Every task's image pull policy ($ROLLPACKER_IMAGE_PULL_POLICY, default ``IfNotPresent``)."""
    got = os.environ.get("ROLLPACKER_IMAGE_PULL_POLICY", "IfNotPresent")
    if got not in PULL_POLICIES:
        raise ValueError(f"ROLLPACKER_IMAGE_PULL_POLICY = {got!r}: use one of {', '.join(PULL_POLICIES)}")
    return got


def node_pool() -> str:
    """The node pool every task runs in ($ROLLPACKER_NODE_POOL, default ``cpu``; empty: any node)."""
    return os.environ.get("ROLLPACKER_NODE_POOL", DEFAULT_POOL)


def on_cluster(task, component: str):  # type: ignore[no-untyped-def]
    """``task`` (of components/``component``) with its Kubernetes settings; returns the task."""
    if component not in RESOURCES:
        raise KeyError(f"unknown component {component!r}; use one of {sorted(RESOURCES)}")
    cpu, memory, memory_limit = RESOURCES[component]
    task.set_cpu_request(cpu).set_memory_request(memory).set_memory_limit(memory_limit)
    pool = node_pool()
    if pool:
        kubernetes.add_node_selector(task, label_key=POOL_LABEL, label_value=pool)
    kubernetes.add_toleration(task, key=TAINT_KEY, operator="Exists", effect="NoSchedule")
    kubernetes.set_image_pull_policy(task, pull_policy())
    for secret, keys in SECRET_ENV.items():
        kubernetes.use_secret_as_env(task, secret_name=secret, secret_key_to_env=keys)
    kubernetes.use_config_map_as_env(task, config_map_name=CONFIG_MAP, config_map_key_to_env=CONFIG_MAP_ENV)
    kubernetes.set_security_context(
        task, run_as_user=RUN_AS_USER, run_as_group=RUN_AS_USER, run_as_non_root=True
    )
    if component in MODELS_MOUNTED:
        kubernetes.mount_pvc(task, pvc_name=MODELS_PVC, mount_path=MODELS_PATH)
    return task
