"""The stores the tests run against: a real SeaweedFS S3 server (one per test session, on free ports,
in a tmp dir, started and stopped by the same code as `rollpacker up` / `rollpacker down`) and a
file store in a tmp dir. ``store`` is parametrised over both adapters ("s3", "file"): a test that
takes it is a contract test every adapter must pass."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator

import pytest

from rollpacker import devservices
from rollpacker.core.config import StoreConfig
from rollpacker.store.base import ObjectStore
from rollpacker.store.local import FileStore
from rollpacker.store.s3 import S3Store

BUCKET = "rollpacker-test"


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[devservices.Services]:
    root = tmp_path_factory.mktemp("services")
    svc = devservices.up(
        root,
        bucket=BUCKET,
        mlflow=False,
        ray=False,
        seaweed_ports=devservices.SeaweedPorts.free(),
        timeout_s=30.0,
    )
    try:
        yield svc
    finally:
        devservices.down(root, grace_s=5.0)


@pytest.fixture(scope="session")
def store_cfg(seaweed: devservices.Services) -> StoreConfig:
    return StoreConfig(endpoint=seaweed.s3_endpoint, bucket=seaweed.bucket)


@pytest.fixture(scope="session")
def store_env(seaweed: devservices.Services) -> dict[str, str]:
    return {"ROLLPACKER_S3_ACCESS_KEY": seaweed.access_key, "ROLLPACKER_S3_SECRET_KEY": seaweed.secret_key}


@pytest.fixture(scope="session")
def objstore(store_cfg: StoreConfig, store_env: dict[str, str]) -> S3Store:
    """The S3 adapter on the session's SeaweedFS server."""
    return S3Store.from_config(store_cfg, env=store_env)


@pytest.fixture
def filestore(tmp_path_factory: pytest.TempPathFactory) -> FileStore:
    """The file adapter on a fresh directory (outside ``tmp_path``, which tests use for local files)."""
    return FileStore(tmp_path_factory.mktemp("filestore"))


ADAPTERS = ("s3", "file")


@pytest.fixture(params=ADAPTERS)
def store(request: pytest.FixtureRequest) -> ObjectStore:
    """Each adapter in turn: the S3 store on SeaweedFS, the file store in a fresh directory."""
    name = "objstore" if request.param == "s3" else "filestore"
    found: ObjectStore = request.getfixturevalue(name)
    return found


@pytest.fixture
def broken_store(
    request: pytest.FixtureRequest, store: ObjectStore, tmp_path_factory: pytest.TempPathFactory
) -> tuple[ObjectStore, str]:
    """The same adapter as ``store`` pointed at a place that does not exist (an S3 bucket never
    created; a directory whose parent does not exist), and the pattern its errors must match
    (the setting to fix)."""
    if isinstance(store, S3Store):
        cfg = StoreConfig(endpoint=store.endpoint, bucket="no-such-bucket-here")
        env: dict[str, str] = request.getfixturevalue("store_env")
        return S3Store.from_config(cfg, env=env), (
            r"store\.bucket = 'no-such-bucket-here' does not exist at .*; create it or fix store\.bucket"
        )
    missing = tmp_path_factory.mktemp("gone") / "no" / "store"
    path = re.escape(str(missing))
    return FileStore(missing), rf"store\.endpoint = .*: {path} does not exist; create it \(mkdir -p {path}\)"


@pytest.fixture
def prefix() -> str:
    """A key prefix no other test uses (the server lives for the whole session)."""
    return f"t-{uuid.uuid4().hex[:10]}"
