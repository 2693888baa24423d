"""What only the S3 adapter has: its endpoint, credential and URI errors, against a real S3 server
(SeaweedFS). The behaviour every adapter shares is in test_store_contract.py."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollpacker import devservices
from rollpacker.core.config import StoreConfig
from rollpacker.store.base import StoreError
from rollpacker.store.s3 import S3Store, local_credentials_path

# -- S3 URIs ----------------------------------------------------------------------------------------


def test_s3_uri_is_bucket_and_key(objstore: S3Store, prefix: str) -> None:
    assert objstore.put_bytes(f"{prefix}/blob.bin", b"x") == f"s3://{objstore.bucket}/{prefix}/blob.bin"
    assert objstore.key_of(f"s3://{objstore.bucket}") == ""


@pytest.mark.parametrize(
    "uri", ["", "exp/arm/x", "http://rollpacker-test/x", "s3:/rollpacker-test/x", "s3://", "S3://x/y"]
)
def test_key_of_malformed_uri(objstore: S3Store, uri: str) -> None:
    with pytest.raises(StoreError, match="is not an S3 URI"):
        objstore.key_of(uri)


# -- bad inputs: each error names the setting to fix -----------------------------------------------


def test_closed_port_fails_fast_naming_store_endpoint(store_env: dict[str, str]) -> None:
    (port,) = devservices.free_ports(1)
    store = S3Store.from_config(StoreConfig(endpoint=f"127.0.0.1:{port}", bucket="abc"), env=store_env)
    t0 = time.monotonic()
    with pytest.raises(
        StoreError, match=r"store\.endpoint = '127\.0\.0\.1:\d+': no S3 server answers.*make up"
    ):
        store.check()
    with pytest.raises(StoreError, match=r"store\.endpoint"):
        store.get_bytes("some/key")
    assert time.monotonic() - t0 < 5.0


def test_bad_secret_names_the_env_vars(store_cfg: StoreConfig, store_env: dict[str, str]) -> None:
    env = {**store_env, "ROLLPACKER_S3_SECRET_KEY": "wrong-secret"}
    with pytest.raises(
        StoreError,
        match=r"refused the credentials in \$ROLLPACKER_S3_ACCESS_KEY / \$ROLLPACKER_S3_SECRET_KEY",
    ):
        S3Store.from_config(store_cfg, env=env).check()


def test_unknown_access_key_names_the_env_vars(store_cfg: StoreConfig) -> None:
    env = {"ROLLPACKER_S3_ACCESS_KEY": "NOBODY", "ROLLPACKER_S3_SECRET_KEY": "nothing"}
    store = S3Store.from_config(store_cfg, env=env)
    with pytest.raises(StoreError, match=r"refused the credentials in \$ROLLPACKER_S3_ACCESS_KEY"):
        store.put_bytes("x/y", b"1")


@pytest.fixture(params=[(404, b"<html><body>Not Found</body></html>"), (200, b"hello, not XML")])
def http_not_s3(request: pytest.FixtureRequest) -> Iterator[str]:
    code, body = request.param

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(code)
            self.end_headers()
            self.wfile.write(body)

        do_HEAD = do_GET

        def log_message(self, *args: object) -> None:
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def test_endpoint_that_is_not_s3(http_not_s3: str, store_env: dict[str, str]) -> None:
    store = S3Store.from_config(StoreConfig(endpoint=http_not_s3, bucket="abc"), env=store_env)
    with pytest.raises(StoreError, match=r"store\.endpoint = .*does not answer like S3"):
        store.check()


# -- credentials -----------------------------------------------------------------------------------


def test_no_credentials_names_both_env_vars(store_cfg: StoreConfig, tmp_path: Path) -> None:
    with pytest.raises(StoreError, match=r"\$ROLLPACKER_S3_ACCESS_KEY / \$ROLLPACKER_S3_SECRET_KEY"):
        S3Store.from_config(store_cfg, env={}, credentials_file=tmp_path / "none.json")


def test_half_set_credentials_name_the_missing_one(store_cfg: StoreConfig) -> None:
    with pytest.raises(StoreError, match=r"\$ROLLPACKER_S3_SECRET_KEY is not set"):
        S3Store.from_config(store_cfg, env={"ROLLPACKER_S3_ACCESS_KEY": "x"})


def test_falls_back_to_the_local_credentials_file(
    store_cfg: StoreConfig, seaweed: devservices.Services
) -> None:
    store = S3Store.from_config(store_cfg, env={"ROLLPACKER_SERVICES_DIR": str(seaweed.root)})
    store.check()
    assert store.credentials_source == str(seaweed.credentials_file)
    assert local_credentials_path({"ROLLPACKER_SERVICES_DIR": str(seaweed.root)}) == seaweed.credentials_file
    assert seaweed.credentials_file.stat().st_mode & 0o777 == 0o600


def test_env_credentials_win_over_the_file(store_cfg: StoreConfig, seaweed: devservices.Services) -> None:
    env = {
        "ROLLPACKER_SERVICES_DIR": str(seaweed.root),
        "ROLLPACKER_S3_ACCESS_KEY": "NOBODY",
        "ROLLPACKER_S3_SECRET_KEY": "nothing",
    }
    with pytest.raises(StoreError, match="refused the credentials"):
        S3Store.from_config(store_cfg, env=env).check()


def test_credentials_file_of_another_endpoint_is_not_used(
    seaweed: devservices.Services, store_env: dict[str, str]
) -> None:
    cfg = StoreConfig(endpoint="127.0.0.1:1", bucket=seaweed.bucket)
    with pytest.raises(StoreError, match=r"holds the keys of 127\.0\.0\.1:\d+, not of store\.endpoint"):
        S3Store.from_config(cfg, env={}, credentials_file=seaweed.credentials_file)


def test_corrupt_credentials_file(store_cfg: StoreConfig, tmp_path: Path) -> None:
    path = tmp_path / "credentials.json"
    path.write_text('{"endpoint": "x"}')
    with pytest.raises(StoreError, match="not a credentials file"):
        S3Store.from_config(store_cfg, env={}, credentials_file=path)
