"""manifests/base/minio/init_bucket.py (the bucket-init Job's script) against a real S3 server
(SeaweedFS, started like `rollpacker up`; it has no MinIO admin API, so the user part is covered by
its policy document only), and its clear errors."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

from rollpacker import devservices

SCRIPT = Path(__file__).resolve().parents[2] / "manifests" / "base" / "minio" / "init_bucket.py"


def _run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp")}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], env={**base, **env}, capture_output=True, text=True, timeout=60
    )


def test_creates_the_bucket_once(seaweed: devservices.Services) -> None:
    s3 = seaweed
    env = {
        "MINIO_ENDPOINT": s3.s3_endpoint,
        "BUCKET": "rollpacker-init",
        "MINIO_ROOT_USER": s3.access_key,
        "MINIO_ROOT_PASSWORD": s3.secret_key,
    }
    res = _run(env, "--bucket-only")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "bucket rollpacker-init: created"
    res = _run(env, "--bucket-only")
    assert res.returncode == 0 and res.stdout.strip() == "bucket rollpacker-init: present"
    from minio import Minio

    assert Minio(s3.s3_endpoint, s3.access_key, s3.secret_key, secure=False).bucket_exists("rollpacker-init")


def test_missing_settings_are_named() -> None:
    res = _run({"MINIO_ENDPOINT": "minio:9000", "BUCKET": "b"})
    assert res.returncode == 2
    assert (
        "MINIO_ROOT_USER, MINIO_ROOT_PASSWORD, ROLLPACKER_S3_ACCESS_KEY, ROLLPACKER_S3_SECRET_KEY"
        in res.stderr
    )


def test_unreachable_minio_fails_after_the_timeout() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        "MINIO_ENDPOINT": f"127.0.0.1:{port}",
        "BUCKET": "b-init",
        "MINIO_ROOT_USER": "u",
        "MINIO_ROOT_PASSWORD": "p",
        "INIT_TIMEOUT_S": "1",
    }
    res = _run(env, "--bucket-only")
    assert res.returncode == 1 and f"MinIO at 127.0.0.1:{port} did not answer" in res.stderr


def test_the_user_policy_is_limited_to_the_bucket() -> None:
    policy = runpy.run_path(str(SCRIPT))["bucket_policy"]("rollpacker")
    resources = [r for st in policy["Statement"] for r in st["Resource"]]
    assert resources == ["arn:aws:s3:::rollpacker", "arn:aws:s3:::rollpacker/*"]
    actions = {a for st in policy["Statement"] for a in st["Action"]}
    assert "s3:PutObject" in actions and not any(a.startswith("admin:") or a == "s3:*" for a in actions)
    json.dumps(policy)  # what MinioAdmin.policy_add sends
