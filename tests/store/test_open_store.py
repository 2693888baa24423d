"""``open_store``: ``store.endpoint`` picks the adapter (``file://<path>`` the file store, anything
else S3), and ``StoreConfig`` accepts a ``file://`` endpoint while keeping every S3 endpoint check."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from rollpacker.core.config import StoreConfig, from_mapping
from rollpacker.core.errors import ConfigError
from rollpacker.store import FileStore, ObjectStore, PatientStore, S3Store, StoreError, open_store
from rollpacker.store.state_store import StateStore
from tests.store.chain import chain


def test_file_endpoint_gives_a_file_store_at_that_path(tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    store = open_store(StoreConfig(endpoint=f"file://{tmp_path}/store"))
    assert isinstance(store, FileStore) and isinstance(store, ObjectStore)
    assert store.root == tmp_path / "store"
    store.check()
    assert store.put_bytes("a/b", b"1") == f"file://{tmp_path}/store/a/b"
    assert (tmp_path / "store" / "a" / "b").read_bytes() == b"1"


def test_relative_file_endpoint_resolves_against_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    store = open_store(StoreConfig(endpoint="file://build/store"))
    assert isinstance(store, FileStore)
    assert store.root == tmp_path / "build" / "store"
    assert store.uri("k") == f"file://{tmp_path}/build/store/k"  # URIs are absolute: valid from anywhere


def test_open_store_creates_the_root_when_its_parent_exists(tmp_path: Path) -> None:
    store = open_store(StoreConfig(endpoint=f"file://{tmp_path}/new"))
    assert (tmp_path / "new").is_dir()
    store.check()


def test_open_store_leaves_a_missing_parent_and_check_names_the_path(tmp_path: Path) -> None:
    root = tmp_path / "no" / "such" / "store"
    store = open_store(StoreConfig(endpoint=f"file://{root}"))
    assert not (tmp_path / "no").exists()
    path = re.escape(str(root))
    expected = rf"store\.endpoint = 'file://{path}': {path} does not exist; create it"
    with pytest.raises(StoreError, match=expected):
        store.check()
    with pytest.raises(StoreError, match="does not exist"):
        store.put_bytes("k", b"1")
    assert not (tmp_path / "no").exists()  # a write never creates the root


def test_state_store_on_a_file_endpoint(tmp_path: Path) -> None:
    ss = StateStore(open_store(StoreConfig(endpoint=f"file://{tmp_path}/s")), "exp", "sync")
    s = chain(ss, 2)
    again = StateStore(open_store(StoreConfig(endpoint=f"file://{tmp_path}/s")), "exp", "sync")
    assert again.latest() == s[-1]


def test_host_port_endpoint_gives_the_s3_store() -> None:
    env = {"ROLLPACKER_S3_ACCESS_KEY": "a", "ROLLPACKER_S3_SECRET_KEY": "b"}
    store = open_store(StoreConfig(endpoint="127.0.0.1:1", bucket="bkt"), env=env)
    # the S3 store, inside the one that rides out an outage of store.outage_s
    assert isinstance(store, PatientStore) and isinstance(store.inner, S3Store) and store.outage_s == 60
    assert isinstance(store, ObjectStore) and store.uri("k") == "s3://bkt/k"
    assert isinstance(open_store(StoreConfig(), env=env).inner, S3Store)  # S3 is the default
    assert isinstance(open_store(StoreConfig(outage_s=0), env=env), S3Store)  # 0: no retries at all


def test_s3_endpoint_without_credentials_names_the_variables(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match=r"\$ROLLPACKER_S3_ACCESS_KEY / \$ROLLPACKER_S3_SECRET_KEY"):
        open_store(StoreConfig(endpoint="127.0.0.1:1"), env={"ROLLPACKER_SERVICES_DIR": str(tmp_path)})


# -- StoreConfig ---------------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["file:///data/store", "file://build/store", "file:///"])
def test_store_config_accepts_file_endpoints(endpoint: str) -> None:
    cfg = from_mapping(StoreConfig, {"endpoint": endpoint})
    assert cfg.file_root == endpoint.removeprefix("file://")


def test_store_config_file_root_is_none_for_s3() -> None:
    assert StoreConfig(endpoint="minio.svc:9000").file_root is None


@pytest.mark.parametrize("endpoint", ["file://", "file://  "])
def test_store_config_refuses_a_file_endpoint_without_a_path(endpoint: str) -> None:
    with pytest.raises(ConfigError, match=r"store\.endpoint = .*give the store's directory after file://"):
        StoreConfig(endpoint=endpoint)


@pytest.mark.parametrize("endpoint", ["", "http://minio:9000", "s3://bucket", "host:9000/path", "file:/x"])
def test_store_config_keeps_the_s3_endpoint_checks(endpoint: str) -> None:
    with pytest.raises(ConfigError, match=r"use host:port without a scheme or path \(e\.g\. 127\.0\.0\.1:"):
        StoreConfig(endpoint=endpoint)


def test_root_directory_itself_is_refused() -> None:
    with pytest.raises(StoreError, match="choose a directory, not the root"):
        open_store(StoreConfig(endpoint="file:///"))
    assert os.path.isdir("/")
