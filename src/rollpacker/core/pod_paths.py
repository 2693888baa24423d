"""Which pod reads which local path of the config: the cluster path's "nothing but the store is shared".

On a cluster the stages run as KFP tasks (the pipeline's ``controller``, ``rollout``, ...
components, pipelines/platform.py) and the services on the RayCluster's worker groups (``rollout``,
``training``, ``judge``, ``sandbox``; manifests/base/ray). A setting that names a local path is
read on the pods listed here, so each of them must mount it; everything else moves through the
object store (``s3://`` URIs: the start model, checkpoints, profiles and the dataset, which the plan
stage publishes, tasks/dataset_store.py).

Invariants:
- ``path_reads`` lists every local path setting of the config with each pod that opens it;
  ``local_paths`` lists every string setting that holds an absolute path, so a new path setting
  that ``path_reads`` forgets is found (tests/deploy/test_pod_paths.py);
- a store URI (``s3://``) or an empty setting is read by nobody's file system.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rollpacker.core.config import ExperimentConfig

KFP = "kfp"  # a pipeline task: the pod of components/<name>
RAY = "ray"  # a RayCluster worker group: the pods of group <name>


@dataclass(frozen=True)
class Pod:
    kind: str  # KFP | RAY
    name: str  # the component folder (KFP) or the worker group (RAY)

    def __str__(self) -> str:
        return f"{'KFP task' if self.kind == KFP else 'Ray worker group'} {self.name!r}"


CONTROLLER = Pod(KFP, "controller")  # controller.plan / controller.commit
PREPARE = Pod(KFP, "prepare_model")  # the model preparation before an arm's first step


@dataclass(frozen=True)
class PathRead:
    pod: Pod
    setting: str  # dotted config key
    path: str


def is_local_path(value: str) -> bool:
    return bool(value) and "://" not in value and value.startswith(("/", "./", "../", "~"))


def path_reads(cfg: ExperimentConfig) -> tuple[PathRead, ...]:
    """Every (pod, setting, path) where a pod opens a local path the config names.

    - ``model.model_dir``: the prepare-model task uploads it as the start model
      (``tasks.prepare``) and the plan stage keys it by its files (``tasks.models.model_identity``);
      the services get it from the store;
    - ``task.name`` (a file): the plan stage publishes it to the store
      (``tasks.dataset_store.publish``); the services read the store's copy.
    """
    reads = []
    if is_local_path(cfg.model.model_dir):
        reads.append(PathRead(PREPARE, "model.model_dir", cfg.model.model_dir))
        reads.append(PathRead(CONTROLLER, "model.model_dir", cfg.model.model_dir))
    if "://" not in cfg.task.name and cfg.task.name.endswith((".jsonl", ".jsonl.gz")):
        reads.append(PathRead(CONTROLLER, "task.name", cfg.task.name))
    return tuple(reads)


def local_paths(obj: Any, prefix: str = "") -> Iterator[tuple[str, str]]:
    """Every ``(dotted setting, value)`` of a config tree whose string value is a local path."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            yield from local_paths(value, key + ".")
        elif isinstance(value, str) and is_local_path(value):
            yield key, value
        elif isinstance(value, tuple | list):
            for i, item in enumerate(value):
                if isinstance(item, str) and is_local_path(item):
                    yield f"{key}[{i}]", item
                elif dataclasses.is_dataclass(item) and not isinstance(item, type):
                    yield from local_paths(item, f"{key}[{i}].")
