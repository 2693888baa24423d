"""Contract tests of ObjectStore against a real S3 server (SeaweedFS), and its bad-input errors."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollpacker import devservices
from rollpacker.core.config import StoreConfig
from rollpacker.store.objstore import (
    DOWNLOAD_MARKER,
    ObjectStore,
    StoreError,
    cached_download,
    local_credentials_path,
)

# -- objects ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("data", [b"hello", b"", bytes(range(256)) * 40])
def test_put_get_round_trip(objstore: ObjectStore, prefix: str, data: bytes) -> None:
    uri = objstore.put_bytes(f"{prefix}/blob.bin", data)
    assert uri == f"s3://{objstore.bucket}/{prefix}/blob.bin"
    assert objstore.get_bytes(f"{prefix}/blob.bin") == data


def test_put_overwrites(objstore: ObjectStore, prefix: str) -> None:
    objstore.put_bytes(f"{prefix}/k", b"one")
    objstore.put_bytes(f"{prefix}/k", b"two")
    assert objstore.get_bytes(f"{prefix}/k") == b"two"


def test_get_missing_key_names_its_uri(objstore: ObjectStore, prefix: str) -> None:
    with pytest.raises(StoreError, match=rf"s3://{objstore.bucket}/{prefix}/nope\.json: no such object"):
        objstore.get_bytes(f"{prefix}/nope.json")


def test_exists(objstore: ObjectStore, prefix: str) -> None:
    assert not objstore.exists(f"{prefix}/a")
    objstore.put_bytes(f"{prefix}/a", b"x")
    assert objstore.exists(f"{prefix}/a")
    assert not objstore.exists(f"{prefix}/a2")


def test_json_round_trip(objstore: ObjectStore, prefix: str) -> None:
    obj = {"step": 3, "queue": ["p1", "p2"], "nested": {"x": 1.5, "ok": True, "none": None}}
    objstore.put_json(f"{prefix}/doc.json", obj)
    assert objstore.get_json(f"{prefix}/doc.json") == obj


def test_get_json_of_garbage_is_a_store_error(objstore: ObjectStore, prefix: str) -> None:
    objstore.put_bytes(f"{prefix}/bad.json", b"{not json")
    with pytest.raises(StoreError, match="not JSON"):
        objstore.get_json(f"{prefix}/bad.json")


def test_list_is_recursive_sorted_and_prefix_scoped(objstore: ObjectStore, prefix: str) -> None:
    for key in ("a/x", "a/b/y", "a/b/c/z", "ab/w", "b/v"):
        objstore.put_bytes(f"{prefix}/{key}", b"1")
    assert objstore.list(f"{prefix}/a/") == [f"{prefix}/a/b/c/z", f"{prefix}/a/b/y", f"{prefix}/a/x"]
    assert len(objstore.list(f"{prefix}/")) == 5
    assert objstore.list(f"{prefix}/none/") == []


def test_delete_prefix_deletes_only_under_the_prefix(objstore: ObjectStore, prefix: str) -> None:
    for key in ("arm/s1", "arm/sub/s2", "arm2/s3"):
        objstore.put_bytes(f"{prefix}/{key}", b"1")
    assert objstore.delete_prefix(f"{prefix}/arm/") == 2
    assert objstore.list(f"{prefix}/") == [f"{prefix}/arm2/s3"]
    assert objstore.delete_prefix(f"{prefix}/arm/") == 0


@pytest.mark.parametrize("bad", ["", "/", "x", "a/arm"])
def test_delete_prefix_needs_a_dir_prefix(objstore: ObjectStore, bad: str) -> None:
    with pytest.raises(StoreError, match="must be a non-empty 'dir/'"):
        objstore.delete_prefix(bad)


@pytest.mark.parametrize("bad", ["", "/abs", "dir/"])
def test_bad_keys_are_refused(objstore: ObjectStore, bad: str) -> None:
    with pytest.raises(StoreError, match="object key"):
        objstore.put_bytes(bad, b"x")


# -- URIs ------------------------------------------------------------------------------------------


def test_uri_and_key_of_round_trip(objstore: ObjectStore) -> None:
    key = "exp/arm/ckpt/step-000003/model.safetensors"
    assert objstore.key_of(objstore.uri(key)) == key
    assert objstore.key_of(f"s3://{objstore.bucket}") == ""


@pytest.mark.parametrize(
    "uri", ["", "exp/arm/x", "http://rollpacker-test/x", "s3:/rollpacker-test/x", "s3://", "S3://x/y"]
)
def test_key_of_malformed_uri(objstore: ObjectStore, uri: str) -> None:
    with pytest.raises(StoreError, match="is not an S3 URI"):
        objstore.key_of(uri)


def test_key_of_other_bucket_names_store_bucket(objstore: ObjectStore) -> None:
    with pytest.raises(StoreError, match=r"in bucket 'other'.*store\.bucket"):
        objstore.key_of("s3://other/exp/x")


# -- directories -----------------------------------------------------------------------------------


def _make_tree(root: Path) -> dict[str, bytes]:
    files = {
        "config.json": b'{"a": 1}',
        "model/weights.bin": bytes(range(256)) * 100,
        "model/tok/vocab.txt": b"a\nb\n",
        "deep/er/still/x": b"",
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


def _read_tree(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and p.name != DOWNLOAD_MARKER
    }


def test_upload_download_dir_round_trip(objstore: ObjectStore, prefix: str, tmp_path: Path) -> None:
    files = _make_tree(tmp_path / "src")
    uri = objstore.upload_dir(tmp_path / "src", f"{prefix}/ckpt/step-000001")
    assert uri == objstore.uri(f"{prefix}/ckpt/step-000001/")
    assert len(objstore.list(f"{prefix}/ckpt/")) == len(files)
    out = objstore.download_dir(uri, tmp_path / "dst")
    assert out == tmp_path / "dst"
    assert _read_tree(out) == files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]  # no temp sibling left


def test_download_dir_reuses_a_complete_download(objstore: ObjectStore, prefix: str, tmp_path: Path) -> None:
    files = _make_tree(tmp_path / "src")
    uri = objstore.upload_dir(tmp_path / "src", f"{prefix}/m")
    objstore.download_dir(uri, tmp_path / "dst")
    objstore.delete_prefix(f"{prefix}/")  # a second download would now find nothing
    assert _read_tree(objstore.download_dir(uri.rstrip("/"), tmp_path / "dst")) == files


def test_download_dir_refuses_a_foreign_directory(objstore: ObjectStore, prefix: str, tmp_path: Path) -> None:
    _make_tree(tmp_path / "src")
    uri = objstore.upload_dir(tmp_path / "src", f"{prefix}/m")
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "mine.txt").write_text("user data")
    with pytest.raises(StoreError, match="is not a complete download"):
        objstore.download_dir(uri, tmp_path / "dst")
    assert (tmp_path / "dst" / "mine.txt").read_text() == "user data"


def test_download_dir_is_atomic_on_failure(
    objstore: ObjectStore, prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _make_tree(tmp_path / "src")
    uri = objstore.upload_dir(tmp_path / "src", f"{prefix}/m")
    real = objstore._client.fget_object
    calls = []

    def flaky(*args: object, **kw: object) -> object:
        calls.append(args)
        if len(calls) == 3:
            raise ConnectionResetError("connection dropped mid-download")
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(objstore._client, "fget_object", flaky)
    (tmp_path / "cache").mkdir()
    with pytest.raises(ConnectionResetError):
        objstore.download_dir(uri, tmp_path / "cache" / "m")
    assert list((tmp_path / "cache").iterdir()) == []  # neither the target nor a temp dir


def test_download_of_an_empty_prefix_fails(objstore: ObjectStore, prefix: str, tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="nothing under"):
        objstore.download_dir(objstore.uri(f"{prefix}/never/"), tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


def test_upload_dir_of_missing_or_empty_dir(objstore: ObjectStore, prefix: str, tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="is not a directory"):
        objstore.upload_dir(tmp_path / "missing", f"{prefix}/x")
    (tmp_path / "empty").mkdir()
    with pytest.raises(StoreError, match="holds no files"):
        objstore.upload_dir(tmp_path / "empty", f"{prefix}/x")


def test_cached_download_is_keyed_by_uri_and_reused(
    objstore: ObjectStore, prefix: str, tmp_path: Path
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "w").write_bytes(b"A")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "w").write_bytes(b"B")
    ua = objstore.upload_dir(tmp_path / "a", f"{prefix}/ckpt/step-000001")
    ub = objstore.upload_dir(tmp_path / "b", f"{prefix}/ckpt/step-000002")
    cache = tmp_path / "cache"
    pa = objstore.cached_download(ua, cache)
    pb = cached_download(objstore, ub, cache)
    assert pa != pb and pa.parent == pb.parent == cache
    assert (pa / "w").read_bytes() == b"A" and (pb / "w").read_bytes() == b"B"
    objstore.delete_prefix(f"{prefix}/")
    # served from the cache: the objects are gone, the spelling of the URI does not matter
    assert cached_download(objstore, ua.rstrip("/"), cache) == pa
    assert (pa / "w").read_bytes() == b"A"


# -- bad inputs: each error names the setting to fix -----------------------------------------------


def test_closed_port_fails_fast_naming_store_endpoint(store_env: dict[str, str]) -> None:
    (port,) = devservices.free_ports(1)
    store = ObjectStore.from_config(StoreConfig(endpoint=f"127.0.0.1:{port}", bucket="abc"), env=store_env)
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
        ObjectStore.from_config(store_cfg, env=env).check()


def test_unknown_access_key_names_the_env_vars(store_cfg: StoreConfig) -> None:
    env = {"ROLLPACKER_S3_ACCESS_KEY": "NOBODY", "ROLLPACKER_S3_SECRET_KEY": "nothing"}
    store = ObjectStore.from_config(store_cfg, env=env)
    with pytest.raises(StoreError, match=r"refused the credentials in \$ROLLPACKER_S3_ACCESS_KEY"):
        store.put_bytes("x/y", b"1")


def test_missing_bucket_names_store_bucket(store_cfg: StoreConfig, store_env: dict[str, str]) -> None:
    cfg = StoreConfig(endpoint=store_cfg.endpoint, bucket="no-such-bucket-here")
    store = ObjectStore.from_config(cfg, env=store_env)
    with pytest.raises(
        StoreError, match=r"store\.bucket = 'no-such-bucket-here' does not exist at .*fix store\.bucket"
    ):
        store.check()


def test_check_passes_on_a_good_store(objstore: ObjectStore) -> None:
    objstore.check()


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
    store = ObjectStore.from_config(StoreConfig(endpoint=http_not_s3, bucket="abc"), env=store_env)
    with pytest.raises(StoreError, match=r"store\.endpoint = .*does not answer like S3"):
        store.check()


# -- credentials -----------------------------------------------------------------------------------


def test_no_credentials_names_both_env_vars(store_cfg: StoreConfig, tmp_path: Path) -> None:
    with pytest.raises(StoreError, match=r"\$ROLLPACKER_S3_ACCESS_KEY / \$ROLLPACKER_S3_SECRET_KEY"):
        ObjectStore.from_config(store_cfg, env={}, credentials_file=tmp_path / "none.json")


def test_half_set_credentials_name_the_missing_one(store_cfg: StoreConfig) -> None:
    with pytest.raises(StoreError, match=r"\$ROLLPACKER_S3_SECRET_KEY is not set"):
        ObjectStore.from_config(store_cfg, env={"ROLLPACKER_S3_ACCESS_KEY": "x"})


def test_falls_back_to_the_local_credentials_file(
    store_cfg: StoreConfig, seaweed: devservices.Services
) -> None:
    store = ObjectStore.from_config(store_cfg, env={"ROLLPACKER_SERVICES_DIR": str(seaweed.root)})
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
        ObjectStore.from_config(store_cfg, env=env).check()


def test_credentials_file_of_another_endpoint_is_not_used(
    seaweed: devservices.Services, store_env: dict[str, str]
) -> None:
    cfg = StoreConfig(endpoint="127.0.0.1:1", bucket=seaweed.bucket)
    with pytest.raises(StoreError, match=r"holds the keys of 127\.0\.0\.1:\d+, not of store\.endpoint"):
        ObjectStore.from_config(cfg, env={}, credentials_file=seaweed.credentials_file)


def test_corrupt_credentials_file(store_cfg: StoreConfig, tmp_path: Path) -> None:
    path = tmp_path / "credentials.json"
    path.write_text('{"endpoint": "x"}')
    with pytest.raises(StoreError, match="not a credentials file"):
        ObjectStore.from_config(store_cfg, env={}, credentials_file=path)
