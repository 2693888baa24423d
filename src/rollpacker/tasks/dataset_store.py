"""Datasets through the object store: the store is the only thing the pods share.

``task.name`` names a built-in task, a JSON Lines file on the controller's pod (``/models/data/
train.jsonl``) or an object of the experiment's store (``s3://<store.bucket>/<key>.jsonl[.gz]``).
The controller (the plan stage, every step) ``publish``-es a file dataset: it reads and checks the
file, writes its bytes once under a content-addressed key, and records it for the arm::

    <experiment>/data/sha256-<16 hex>/<file name>   the dataset's bytes (shared by the arms)
    <experiment>/<arm>/dataset.json                  {"source": task.name, "uri": ..., "sha256": ...}

The services (rollout, reward, judge, on their own pods) call ``local_dataset``: a file their pod
has is read as it is (one machine: the controller's own file); otherwise the recorded object,
downloaded once per pod into a cache directory (``store.cached_download``).

Invariants:
- on a cluster an arm reads the same bytes in every service and at every step: its record is
  written once, the object it names is content-addressed and never rewritten; a task.name that
  differs from the arm's record is refused (the cursor and the queue index the recorded dataset);
- a service reads only a file its own pod has or the store; anything else is a ``ConfigError``
  saying what to do;
- a missing file, a missing object, a URI of another scheme or bucket and a bad dataset line are
  ``ConfigError``-s naming ``task.name``, raised by ``publish`` before any service starts.
"""

from __future__ import annotations

import hashlib
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from rollpacker.core.errors import ConfigError
from rollpacker.store.base import ObjectStore, StoreError, cached_download
from rollpacker.tasks.jsonl import load_jsonl
from rollpacker.tasks.registry import FILE_SUFFIXES

RECORD = "dataset.json"


def is_dataset_file(task_name: str) -> bool:
    """A JSON Lines dataset (a path or a URI), not a built-in task."""
    return task_name.endswith(FILE_SUFFIXES)


def is_uri(task_name: str) -> bool:
    return "://" in task_name


def readable_here(task_name: str) -> bool:
    """A built-in task, or a file this pod has (one machine: the controller's own): no store."""
    return not is_dataset_file(task_name) or (not is_uri(task_name) and Path(task_name).is_file())


def record_key(experiment: str, arm: str) -> str:
    return f"{experiment}/{arm}/{RECORD}"


@dataclass(frozen=True)
class DatasetRecord:
    """The dataset an arm trains on: ``source`` as task.name gave it, ``uri`` of its bytes."""

    source: str
    uri: str
    sha256: str

    def to_json(self) -> dict[str, str]:
        return {"source": self.source, "uri": self.uri, "sha256": self.sha256}

    @classmethod
    def from_json(cls, obj: Any, where: str) -> DatasetRecord:
        keys = {"source", "uri", "sha256"}
        if not isinstance(obj, dict) or set(obj) != keys or not all(isinstance(obj[k], str) for k in keys):
            raise ConfigError(
                f"{where}: not a dataset record (want string keys {sorted(keys)}); delete it and re-run "
                "the step from its plan stage, which writes it again"
            )
        return cls(obj["source"], obj["uri"], obj["sha256"])


def publish(store: ObjectStore, task_name: str, experiment: str, arm: str) -> DatasetRecord | None:
    """The controller's part: the arm's dataset in the store (None for a built-in task)."""
    if not is_dataset_file(task_name):
        if is_uri(task_name):
            want = " or ".join(FILE_SUFFIXES)
            raise ConfigError(f"task.name = {task_name!r}: a dataset URI must end in {want}")
        return None
    key = record_key(experiment, arm)
    if store.exists(key):
        return _read_record(store, key, task_name)
    name = PurePosixPath(task_name.split("://", 1)[-1]).name
    if is_uri(task_name):
        data = _fetch(store, task_name)
        _check_lines(data, name, task_name)
    else:
        data = _read_local(task_name)
    digest = hashlib.sha256(data).hexdigest()
    obj = f"{experiment}/data/sha256-{digest[:16]}/{name}"
    if not store.exists(obj):
        store.put_bytes(obj, data)
    record = DatasetRecord(task_name, store.uri(obj), digest)
    store.put_json(key, record.to_json())
    return record


def local_dataset(store: ObjectStore, task_name: str, experiment: str, arm: str, cache_root: Path) -> str:
    """The service's part: what to give ``load_task`` on this pod (a built-in name as it is; a
    dataset: the arm's recorded object, downloaded once into ``cache_root``)."""
    if readable_here(task_name):
        return task_name
    key = record_key(experiment, arm)
    if store.exists(key):
        record = _read_record(store, key, task_name)
        folder, _, name = record.uri.rpartition("/")
        return str(cached_download(store, folder, cache_root) / name)
    raise ConfigError(
        f"task.name = {task_name!r}: arm {arm!r} has no dataset in the store yet ({store.uri(key)}) and "
        "this pod has no such file; the plan stage publishes the dataset: run the step from its plan stage"
    )


def _read_record(store: ObjectStore, key: str, task_name: str) -> DatasetRecord:
    record = DatasetRecord.from_json(store.get_json(key), store.uri(key))
    if record.source != task_name:
        raise ConfigError(
            f"task.name = {task_name!r}, but this arm started on {record.source!r} ({store.uri(key)}): its "
            "cursor and queue index that dataset; restore task.name, or start a new experiment name"
        )
    return record


def _read_local(path: str) -> bytes:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(
            f"task.name = {path!r}: no such file on the controller's pod; put the dataset on the models "
            "volume (mounted at /models on the controller tasks) or give an s3:// URI of the store"
        )
    load_jsonl(p)  # every line checked here: a bad line fails the plan, not every service
    return p.read_bytes()


def _fetch(store: ObjectStore, uri: str) -> bytes:
    try:
        key = store.key_of(uri)
    except StoreError as e:
        raise ConfigError(f"task.name = {uri!r}: {e}") from None
    if not key or not store.exists(key):
        raise ConfigError(
            f"task.name = {uri!r}: no such object in the store; upload the dataset there first "
            "(e.g. `mc cp train.jsonl <alias>/<bucket>/data/`) or fix the URI"
        )
    return store.get_bytes(key)


def _check_lines(data: bytes, name: str, task_name: str) -> None:
    """Every line of a fetched dataset parses (``load_jsonl``'s checks, the errors naming the URI)."""
    with tempfile.TemporaryDirectory(prefix="rollpacker-dataset-") as tmp:
        f = Path(tmp) / name
        f.write_bytes(data)
        try:
            load_jsonl(f)
        except ConfigError as e:
            raise ConfigError(str(e).replace(str(f), task_name)) from None
