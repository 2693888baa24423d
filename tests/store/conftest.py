"""A real SeaweedFS S3 server for the store tests: one per test session, on free ports, in a tmp dir,
started and stopped by the same code as `rollpacker up` / `rollpacker down`."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from rollpacker import devservices
from rollpacker.core.config import StoreConfig
from rollpacker.store.objstore import ObjectStore

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
def objstore(store_cfg: StoreConfig, store_env: dict[str, str]) -> ObjectStore:
    return ObjectStore.from_config(store_cfg, env=store_env)


@pytest.fixture
def prefix() -> str:
    """A key prefix no other test uses (the server lives for the whole session)."""
    return f"t-{uuid.uuid4().hex[:10]}"
