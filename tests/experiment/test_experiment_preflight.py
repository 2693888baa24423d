"""`rollpacker run` refuses to start a step when a store, MLflow or Ray setting is wrong, and says
which setting to fix (a real SeaweedFS server; closed ports for the unreachable ones)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollpacker import devservices
from rollpacker.core.errors import RollpackerError


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[devservices.Services]:
    root = tmp_path_factory.mktemp("preflight")
    svc = devservices.up(
        root, bucket="present", mlflow=False, ray=False, seaweed_ports=devservices.SeaweedPorts.free()
    )
    try:
        yield svc
    finally:
        devservices.down(root, grace_s=3.0)


def _write(tmp: Path, endpoint: str, bucket: str, tracking: str, ray: str) -> Path:
    p = tmp / "exp.yaml"
    p.write_text(
        f"""
experiment: preflight
steps: 1
tracking_uri: {tracking}
store: {{endpoint: "{endpoint}", bucket: {bucket}}}
services: {{ray_address: "{ray}"}}
"""
    )
    return p


def _run(cfg: Path, tmp: Path) -> RollpackerError:
    from rollpacker.experiment import run_experiment

    t0 = time.monotonic()
    with pytest.raises(RollpackerError) as e:
        run_experiment(
            cfg, runner="kfp", pipeline_root=tmp / "kfp", start_services=False, echo=lambda s: None
        )
    assert time.monotonic() - t0 < 30, "a wrong setting must fail fast"
    assert not (tmp / "kfp").exists(), "no step may start"
    return e.value


@pytest.fixture
def creds(s3: devservices.Services, monkeypatch: pytest.MonkeyPatch) -> devservices.Services:
    monkeypatch.setenv("ROLLPACKER_S3_ACCESS_KEY", s3.access_key)
    monkeypatch.setenv("ROLLPACKER_S3_SECRET_KEY", s3.secret_key)
    return s3


def test_wrong_store_endpoint_names_store_endpoint(creds: devservices.Services, tmp_path: Path) -> None:
    (port,) = devservices.free_ports(1)
    err = _run(_write(tmp_path, f"127.0.0.1:{port}", "present", "sqlite:///x.db", ""), tmp_path)
    assert "store.endpoint" in str(err)


def test_bad_credentials_name_the_env_vars(
    creds: devservices.Services, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROLLPACKER_S3_SECRET_KEY", "not-the-secret")
    err = _run(_write(tmp_path, creds.s3_endpoint, "present", "sqlite:///x.db", ""), tmp_path)
    assert "ROLLPACKER_S3_SECRET_KEY" in str(err)


def test_missing_bucket_names_store_bucket(creds: devservices.Services, tmp_path: Path) -> None:
    err = _run(_write(tmp_path, creds.s3_endpoint, "absent-bucket", "sqlite:///x.db", ""), tmp_path)
    assert "store.bucket" in str(err) and "absent-bucket" in str(err)


def test_unreachable_mlflow_names_tracking_uri(creds: devservices.Services, tmp_path: Path) -> None:
    (port,) = devservices.free_ports(1)
    err = _run(_write(tmp_path, creds.s3_endpoint, "present", f"http://127.0.0.1:{port}", ""), tmp_path)
    assert "tracking_uri" in str(err)


def test_unreachable_ray_names_ray_address(creds: devservices.Services, tmp_path: Path) -> None:
    (port,) = devservices.free_ports(1)
    db = tmp_path / "m.db"
    err = _run(
        _write(tmp_path, creds.s3_endpoint, "present", f"sqlite:///{db}", f"127.0.0.2:{port}"), tmp_path
    )
    assert "services.ray_address" in str(err)
