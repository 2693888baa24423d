"""Datasets through the store (tasks/dataset_store.py): the controller publishes, a service on
another pod (here: a path that does not exist for it) reads only the store."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from rollpacker.core.config import TaskConfig
from rollpacker.core.errors import ConfigError
from rollpacker.services.base import Service
from rollpacker.store.local import FileStore
from rollpacker.tasks import dataset_store as ds
from rollpacker.tasks import synthetic_math as sm
from rollpacker.tasks.jsonl import dump_jsonl, load_jsonl
from rollpacker.tasks.registry import load_task

EX = sm.generate(sm.SyntheticMathSpec(num_examples=6), seed=1)


@pytest.fixture()
def store(tmp_path: Path) -> FileStore:
    (tmp_path / "store").mkdir()
    return FileStore(tmp_path / "store")


def _dataset(tmp_path: Path, name: str = "train.jsonl") -> Path:
    p = tmp_path / "models" / "data" / name
    p.parent.mkdir(parents=True, exist_ok=True)
    dump_jsonl(EX, p)
    return p


def test_a_service_without_the_controllers_volume_reads_the_published_dataset(
    tmp_path: Path, store: FileStore
) -> None:
    path = _dataset(tmp_path)
    record = ds.publish(store, str(path), "exp", "sync")
    assert record is not None and record.source == str(path)
    [obj] = store.list("exp/data/")
    assert obj == f"exp/data/sha256-{record.sha256[:16]}/train.jsonl"
    path.rename(path.with_suffix(".moved"))  # the service's pod: /models is not mounted there
    local = ds.local_dataset(store, str(path), "exp", "sync", tmp_path / "cache")
    assert Path(local).is_file() and not local.startswith(str(path.parent))
    assert load_jsonl(local) == EX
    assert ds.local_dataset(store, str(path), "exp", "sync", tmp_path / "cache") == local  # cached


def test_the_services_task_name_goes_through_the_store(
    tmp_path: Path, store: FileStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Service.dataset (what the rollout, reward and judge services load) on a pod without the file."""
    monkeypatch.setenv("ROLLPACKER_CACHE", str(tmp_path / "cache"))
    path = _dataset(tmp_path)
    text = f"experiment: exp\nstore: {{endpoint: 'file://{store.root}'}}\ntask: {{name: '{path}'}}\n"
    ds.publish(store, str(path), "exp", "sync")
    path.unlink()
    got = Service(text, "sync", "reward").dataset()
    assert got.startswith(str(tmp_path / "cache" / "datasets")) and load_task(got) == EX


def test_arms_share_one_object_and_a_second_publish_reads_the_record(
    tmp_path: Path, store: FileStore
) -> None:
    path = _dataset(tmp_path)
    a = ds.publish(store, str(path), "exp", "sync")
    b = ds.publish(store, str(path), "exp", "tail")
    assert a == b and len(store.list("exp/data/")) == 1
    path.unlink()  # the record is read, the file is not needed again
    assert ds.publish(store, str(path), "exp", "sync") == a


def test_a_changed_task_name_for_a_started_arm_is_refused(tmp_path: Path, store: FileStore) -> None:
    ds.publish(store, str(_dataset(tmp_path)), "exp", "sync")
    other = _dataset(tmp_path, "other.jsonl")
    with pytest.raises(ConfigError, match=r"this arm started on .*train.jsonl.*new experiment"):
        ds.publish(store, str(other), "exp", "sync")


def test_a_store_uri_is_published_content_addressed(tmp_path: Path, store: FileStore) -> None:
    store.put_bytes("datasets/train.jsonl.gz", gzip.compress(_dataset(tmp_path).read_bytes()))
    uri = store.uri("datasets/train.jsonl.gz")
    record = ds.publish(store, uri, "exp", "sync")
    assert record is not None and record.source == uri and "/exp/data/sha256-" in record.uri
    store.put_bytes("datasets/train.jsonl.gz", b"overwritten later\n")  # the arm keeps its bytes
    assert load_task(ds.local_dataset(store, uri, "exp", "sync", tmp_path / "cache")) == EX


def test_missing_file_missing_object_other_bucket_and_bad_lines_name_the_problem(
    tmp_path: Path, store: FileStore
) -> None:
    with pytest.raises(ConfigError, match=r"no such file on the controller's pod.*models volume"):
        ds.publish(store, str(tmp_path / "nope.jsonl"), "exp", "a")
    with pytest.raises(ConfigError, match=r"no such object in the store"):
        ds.publish(store, store.uri("data/nope.jsonl"), "exp", "a")
    with pytest.raises(ConfigError, match=r"task.name = 's3://b/x.jsonl': .*not a file URI"):
        ds.publish(store, "s3://b/x.jsonl", "exp", "a")
    store.put_bytes("data/bad.jsonl", b'{"id": "q1", "prompt": "1+1?", "reward": "math"}\n')
    with pytest.raises(ConfigError, match=r"data/bad.jsonl:1: missing key 'answer'"):
        ds.publish(store, store.uri("data/bad.jsonl"), "exp", "a")
    assert not store.exists(ds.record_key("exp", "a"))  # nothing recorded for a refused dataset


def test_a_service_with_neither_file_nor_record_says_to_run_the_plan(
    tmp_path: Path, store: FileStore
) -> None:
    with pytest.raises(ConfigError, match=r"no dataset in the store yet .* run the step from its plan stage"):
        ds.local_dataset(store, "/models/data/train.jsonl", "exp", "sync", tmp_path / "cache")


def test_builtin_tasks_need_no_store(tmp_path: Path, store: FileStore) -> None:
    assert ds.publish(store, "synthetic_math", "exp", "sync") is None
    assert ds.local_dataset(store, "mixed", "exp", "sync", tmp_path) == "mixed"
    assert store.list() == []


@pytest.mark.parametrize("name", ["http://host/x.jsonl", "s3://rollpacker/data/train.csv", "gs://b/x.jsonl"])
def test_task_config_refuses_uris_that_are_not_store_datasets(name: str) -> None:
    with pytest.raises(ConfigError, match=r"a dataset URI is s3://<store.bucket>/<key>.jsonl"):
        TaskConfig(name=name)


def test_task_config_refuses_a_name_that_is_no_task_and_no_dataset_file() -> None:
    """At load time (every command that reads a config), not when the plan stage loads the task."""
    with pytest.raises(
        ConfigError, match=r"task.name = 'synthetic-code': not a task \(did you mean 'synthetic_code'\?\)"
    ):
        TaskConfig(name="synthetic-code")
    with pytest.raises(ConfigError, match=r"ending in \.jsonl or \.jsonl\.gz"):
        TaskConfig(name="data/train.json")
    for ok in ("humaneval", "mixed", "data/train.jsonl", "/abs/d.jsonl.gz", "file:///d/x.jsonl"):
        assert TaskConfig(name=ok).name == ok


def test_load_task_refuses_a_uri_and_says_it_goes_through_the_store() -> None:
    assert TaskConfig(name="s3://rollpacker/data/train.jsonl").name.startswith("s3://")
    with pytest.raises(ConfigError, match=r"read through the store"):
        load_task("s3://rollpacker/data/train.jsonl")
