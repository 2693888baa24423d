"""The object store contract (the "Contract:" of rollpacker/store/base.py), one test module that
every adapter passes: each test taking ``store`` runs on S3Store against a real SeaweedFS server
and on FileStore in a fresh directory (tests/store/conftest.py). The tests at the end check what
only the file store has to get right itself (paths, temporary files, permissions)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from rollpacker.core.state import StateError
from rollpacker.store.base import DOWNLOAD_MARKER, ObjectStore, StoreError, cached_download
from rollpacker.store.local import TMP_MARK, FileStore
from rollpacker.store.s3 import S3Store
from rollpacker.store.state_store import StateStore
from tests.store.chain import advance, chain


def test_every_adapter_implements_the_port(store: ObjectStore) -> None:
    assert isinstance(store, ObjectStore)


# -- objects ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("data", [b"hello", b"", bytes(range(256)) * 40])
def test_put_get_round_trip(store: ObjectStore, prefix: str, data: bytes) -> None:
    key = f"{prefix}/blob.bin"
    assert store.put_bytes(key, data) == store.uri(key)
    assert store.get_bytes(key) == data


def test_put_replaces_the_object(store: ObjectStore, prefix: str) -> None:
    store.put_bytes(f"{prefix}/k", b"one")
    store.put_bytes(f"{prefix}/k", b"two")
    assert store.get_bytes(f"{prefix}/k") == b"two"
    assert store.list(f"{prefix}/") == [f"{prefix}/k"]


def test_missing_key_raises_naming_its_uri(store: ObjectStore, prefix: str) -> None:
    key = f"{prefix}/nope.json"
    missing = re.escape(store.uri(key)) + ": no such object"
    with pytest.raises(StoreError, match=missing):
        store.get_bytes(key)
    with pytest.raises(StoreError, match=missing):
        store.get_json(key)
    assert not store.exists(key)


def test_get_range_is_the_slice_of_the_object(store: ObjectStore, prefix: str) -> None:
    data = bytes(range(256)) * 40
    key = f"{prefix}/blob.bin"
    store.put_bytes(key, data)
    for offset, length in ((0, 1), (0, 8), (7, 1000), (256, 256), (len(data) - 3, 3), (len(data) - 3, 10)):
        assert store.get_range(key, offset, length) == data[offset : offset + length], (offset, length)
    assert store.get_range(key, len(data), 5) == b""
    for offset, length in ((-1, 4), (0, 0), (0, -2)):
        with pytest.raises(StoreError, match=r"range (offset|length)"):
            store.get_range(key, offset, length)
    with pytest.raises(StoreError, match=re.escape(f"{store.uri(f'{prefix}/nope')}: no such object")):
        store.get_range(f"{prefix}/nope", 0, 4)


def test_exists_is_true_exactly_for_written_keys(store: ObjectStore, prefix: str) -> None:
    assert not store.exists(f"{prefix}/a")
    store.put_bytes(f"{prefix}/a", b"x")
    assert store.exists(f"{prefix}/a")
    assert not store.exists(f"{prefix}/a2")
    store.put_bytes(f"{prefix}/d/b", b"x")
    assert not store.exists(f"{prefix}/d")  # a prefix is not an object


def test_json_round_trip(store: ObjectStore, prefix: str) -> None:
    obj = {"step": 3, "queue": ["p1", "p2"], "nested": {"x": 1.5, "ok": True, "none": None}}
    assert store.put_json(f"{prefix}/doc.json", obj) == store.uri(f"{prefix}/doc.json")
    assert store.get_json(f"{prefix}/doc.json") == obj


def test_get_json_of_garbage_names_the_uri(store: ObjectStore, prefix: str) -> None:
    store.put_bytes(f"{prefix}/bad.json", b"{not json")
    with pytest.raises(StoreError, match=re.escape(store.uri(f"{prefix}/bad.json")) + ": not JSON"):
        store.get_json(f"{prefix}/bad.json")


@pytest.mark.parametrize("bad", ["", "/abs", "dir/"])
def test_bad_keys_are_refused(store: ObjectStore, bad: str) -> None:
    for op in (lambda: store.put_bytes(bad, b"x"), lambda: store.get_bytes(bad), lambda: store.exists(bad)):
        with pytest.raises(StoreError, match="object key"):
            op()


# -- the state store's discipline: immutable documents, an atomic pointer ------------------------------


def test_state_documents_are_immutable(store: ObjectStore, prefix: str) -> None:
    ss = StateStore(store, prefix, "arm")
    s = chain(ss, 2)
    before = {k: store.get_bytes(k) for k in store.list(f"{prefix}/")}
    with pytest.raises(StateError, match="already committed"):
        ss.commit(dataclasses.replace(s[1], cursor_position=999))
    ss.commit(s[2])  # the same state again: a no-op
    assert {k: store.get_bytes(k) for k in store.list(f"{prefix}/")} == before


def test_commit_then_latest(store: ObjectStore, prefix: str) -> None:
    ss = StateStore(store, prefix, "arm")
    s = chain(ss, 1)
    nxt = advance(s[-1])
    assert ss.commit(nxt) == store.uri(ss.state_key(1))
    assert ss.latest() == nxt
    assert StateStore(store, prefix, "arm").latest() == nxt  # a fresh reader sees it too
    assert store.get_json(ss.pointer_key) == {"step": 1, "key": ss.state_key(1)}
    assert store.list(f"{prefix}/arm/state/") == [ss.pointer_key, *(ss.state_key(i) for i in (-1, 0, 1))]


def _race(write: Callable[[int], None], read: Callable[[], None], writes: int) -> None:
    """``writes`` calls of ``write`` in a thread while ``read`` runs in a loop here; re-raises the
    first failure of either side."""
    done = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            for i in range(writes):
                write(i)
        except BaseException as e:
            errors.append(e)
        finally:
            done.set()

    t = threading.Thread(target=writer)
    t.start()
    try:
        while not done.is_set():
            read()
    finally:
        t.join()
    if errors:
        raise errors[0]


def test_a_reader_never_sees_a_partly_written_pointer(store: ObjectStore, prefix: str) -> None:
    key = f"{prefix}/state/LATEST.json"
    pad = "x" * 2_000_000  # big enough that a non-atomic write is caught mid-way
    store.put_json(key, {"step": -1, "pad": pad})
    seen: set[int] = set()

    def read() -> None:
        doc = store.get_json(key)  # a torn or truncated document is not JSON: StoreError
        assert doc["pad"] == pad
        seen.add(doc["step"])

    _race(lambda i: store.put_json(key, {"step": i, "pad": pad}), read, writes=25)
    assert store.get_json(key)["step"] == 24
    assert len(seen) > 1  # the reader did overlap the writes
    assert store.list(f"{prefix}/") == [key]


# -- listing ---------------------------------------------------------------------------------------


def test_list_is_recursive_sorted_and_prefix_scoped(store: ObjectStore, prefix: str) -> None:
    for key in ("b/v", "a/x", "ab/w", "a/b/c/z", "a/b/y"):
        store.put_bytes(f"{prefix}/{key}", b"1")
    assert store.list(f"{prefix}/a/") == [f"{prefix}/a/b/c/z", f"{prefix}/a/b/y", f"{prefix}/a/x"]
    assert store.list(f"{prefix}/a") == [f"{prefix}/{k}" for k in ("a/b/c/z", "a/b/y", "a/x", "ab/w")]
    assert store.list(f"{prefix}/") == sorted(store.list(f"{prefix}/"))
    assert len(store.list(f"{prefix}/")) == 5
    assert store.list(f"{prefix}/none/") == []
    assert store.list(f"{prefix}/a/x") == [f"{prefix}/a/x"]


def test_list_never_returns_a_partly_written_object(store: ObjectStore, prefix: str) -> None:
    data = bytes(range(256)) * 4000
    keys = {f"{prefix}/objs/k{i:02d}" for i in range(12)}

    def read() -> None:
        for key in store.list(f"{prefix}/objs/"):
            assert key in keys  # never a temporary name
            assert store.get_bytes(key) == data  # never a partial object

    _race(lambda i: store.put_bytes(f"{prefix}/objs/k{i:02d}", data), read, writes=len(keys))
    assert store.list(f"{prefix}/objs/") == sorted(keys)


# -- deletion --------------------------------------------------------------------------------------


def test_delete_prefix_counts_and_stays_under_the_prefix(store: ObjectStore, prefix: str) -> None:
    for key in ("arm/s1", "arm/sub/s2", "arm2/s3"):
        store.put_bytes(f"{prefix}/{key}", b"1")
    assert store.delete_prefix(f"{prefix}/arm/") == 2
    assert store.list(f"{prefix}/") == [f"{prefix}/arm2/s3"]
    assert not store.exists(f"{prefix}/arm/s1")
    assert store.delete_prefix(f"{prefix}/arm/") == 0
    store.put_bytes(f"{prefix}/arm", b"now an object")  # no leftover of the deleted prefix in the way
    assert store.get_bytes(f"{prefix}/arm") == b"now an object"


def test_delete_removes_one_object_and_tells_whether_it_was_there(store: ObjectStore, prefix: str) -> None:
    for key in ("d/a", "d/ab"):
        store.put_bytes(f"{prefix}/{key}", b"1")
    assert store.delete(f"{prefix}/d/a") is True
    assert store.list(f"{prefix}/") == [f"{prefix}/d/ab"]  # not a prefix delete
    assert store.delete(f"{prefix}/d/a") is False


@pytest.mark.parametrize("bad", ["", "/", "x", "a/arm", "/abs/"])
def test_delete_prefix_needs_a_dir_prefix(store: ObjectStore, prefix: str, bad: str) -> None:
    store.put_bytes(f"{prefix}/keep", b"1")
    with pytest.raises(StoreError, match="must be a non-empty 'dir/'"):
        store.delete_prefix(bad)
    assert store.exists(f"{prefix}/keep")


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


def test_upload_download_dir_round_trip(store: ObjectStore, prefix: str, tmp_path: Path) -> None:
    files = _make_tree(tmp_path / "src")
    uri = store.upload_dir(tmp_path / "src", f"{prefix}/ckpt/step-000001")
    assert uri == store.uri(f"{prefix}/ckpt/step-000001/")
    assert store.list(f"{prefix}/ckpt/") == sorted(f"{prefix}/ckpt/step-000001/{k}" for k in files)
    out = store.download_dir(uri, tmp_path / "dst")
    assert out == tmp_path / "dst"
    assert _read_tree(out) == files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]  # no temp sibling left


def test_download_dir_reuses_a_complete_download(store: ObjectStore, prefix: str, tmp_path: Path) -> None:
    files = _make_tree(tmp_path / "src")
    uri = store.upload_dir(tmp_path / "src", f"{prefix}/m")
    store.download_dir(uri, tmp_path / "dst")
    store.delete_prefix(f"{prefix}/")  # a second download would now find nothing
    assert _read_tree(store.download_dir(uri.rstrip("/"), tmp_path / "dst")) == files


def test_download_dir_refuses_a_foreign_directory(store: ObjectStore, prefix: str, tmp_path: Path) -> None:
    _make_tree(tmp_path / "src")
    uri = store.upload_dir(tmp_path / "src", f"{prefix}/m")
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "mine.txt").write_text("user data")
    with pytest.raises(StoreError, match="is not a complete download"):
        store.download_dir(uri, tmp_path / "dst")
    assert (tmp_path / "dst" / "mine.txt").read_text() == "user data"


def _break_third_fetch(store: ObjectStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """The third object a download fetches fails (a dropped connection, a disk error)."""
    obj, name = (store._client, "fget_object") if isinstance(store, S3Store) else (shutil, "copyfile")
    real = getattr(obj, name)
    calls = []

    def flaky(*args: object, **kw: object) -> object:
        calls.append(args)
        if len(calls) == 3:
            raise ConnectionResetError("connection dropped mid-download")
        return real(*args, **kw)

    monkeypatch.setattr(obj, name, flaky)


def test_download_dir_is_atomic_on_failure(
    store: ObjectStore, prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = _make_tree(tmp_path / "src")
    uri = store.upload_dir(tmp_path / "src", f"{prefix}/m")
    (tmp_path / "cache").mkdir()
    _break_third_fetch(store, monkeypatch)
    with pytest.raises((ConnectionResetError, StoreError)):
        store.download_dir(uri, tmp_path / "cache" / "m")
    assert list((tmp_path / "cache").iterdir()) == []  # neither the target nor a temp dir
    monkeypatch.undo()
    assert _read_tree(store.download_dir(uri, tmp_path / "cache" / "m")) == files


def test_download_of_an_empty_prefix_fails(store: ObjectStore, prefix: str, tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="nothing under"):
        store.download_dir(store.uri(f"{prefix}/never/"), tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


def test_upload_dir_of_missing_or_empty_dir(store: ObjectStore, prefix: str, tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="is not a directory"):
        store.upload_dir(tmp_path / "missing", f"{prefix}/x")
    (tmp_path / "empty").mkdir()
    with pytest.raises(StoreError, match="holds no files"):
        store.upload_dir(tmp_path / "empty", f"{prefix}/x")
    assert store.list(f"{prefix}/") == []


def test_cached_download_is_keyed_by_uri_and_reused(store: ObjectStore, prefix: str, tmp_path: Path) -> None:
    for name, data in (("a", b"A"), ("b", b"B")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "w").write_bytes(data)
    ua = store.upload_dir(tmp_path / "a", f"{prefix}/ckpt/step-000001")
    ub = store.upload_dir(tmp_path / "b", f"{prefix}/ckpt/step-000002")
    cache = tmp_path / "cache"
    pa, pb = cached_download(store, ua, cache), cached_download(store, ub, cache)
    assert pa != pb and pa.parent == pb.parent == cache
    assert (pa / "w").read_bytes() == b"A" and (pb / "w").read_bytes() == b"B"
    store.delete_prefix(f"{prefix}/")
    # served from the cache: the objects are gone, the spelling of the URI does not matter
    assert cached_download(store, ua.rstrip("/"), cache) == pa
    assert (pa / "w").read_bytes() == b"A"


# -- setup errors: each names the setting to fix ---------------------------------------------------


def test_check_passes_on_a_good_store(store: ObjectStore) -> None:
    store.check()


def test_a_missing_bucket_or_directory_names_the_setting(broken_store: tuple[ObjectStore, str]) -> None:
    bad, pattern = broken_store
    with pytest.raises(StoreError, match=pattern):
        bad.check()
    for op in (lambda: bad.put_bytes("x/y", b"1"), lambda: bad.get_bytes("x/y"), lambda: bad.list("x/")):
        with pytest.raises(StoreError, match=pattern):
            op()


# -- URIs ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["exp/arm/ckpt/step-000003/model.safetensors", "x", "exp/arm/ckpt/"])
def test_uri_and_key_of_round_trip(store: ObjectStore, key: str) -> None:
    assert store.key_of(store.uri(key)) == key


def test_key_of_the_root_is_empty(store: ObjectStore) -> None:
    assert store.key_of(store.uri("")) == ""
    assert store.key_of(store.uri("").rstrip("/")) == ""


def test_key_of_refuses_a_uri_of_another_bucket_or_root(store: ObjectStore) -> None:
    if isinstance(store, S3Store):
        foreign, setting = "s3://other-bucket/exp/x", r"in bucket 'other-bucket'.*store\.bucket"
    else:
        foreign, setting = f"file:///elsewhere-{uuid.uuid4().hex[:6]}/exp/x", r"outside .*store\.endpoint"
    with pytest.raises(StoreError, match=setting):
        store.key_of(foreign)


def test_key_of_refuses_a_uri_of_the_other_adapter(store: ObjectStore) -> None:
    other = "file:///data/exp/x" if isinstance(store, S3Store) else "s3://rollpacker/exp/x"
    with pytest.raises(StoreError, match=r"is not an? (S3|file) URI; expected"):
        store.key_of(other)


@pytest.mark.parametrize("uri", ["", "exp/arm/x", "http://rollpacker-test/x", "S3://x/y", "file:/x"])
def test_key_of_malformed_uri(store: ObjectStore, uri: str) -> None:
    with pytest.raises(StoreError, match="URI"):
        store.key_of(uri)


# -- the file store's own duties: paths, temporary files, permissions --------------------------------


@pytest.mark.parametrize("bad", ["../x", "a/../../b", "a//b", "./a", "a/.", "a/..", f"a/.x{TMP_MARK}1"])
def test_file_store_refuses_keys_that_leave_the_root(tmp_path: Path, bad: str) -> None:
    store = FileStore(tmp_path / "outer" / "root")
    store.root.mkdir(parents=True)
    for op in (lambda: store.put_bytes(bad, b"x"), lambda: store.get_bytes(bad), lambda: store.exists(bad)):
        with pytest.raises(StoreError, match="object key"):
            op()
    assert [p.relative_to(tmp_path).as_posix() for p in sorted(tmp_path.rglob("*"))] == [
        "outer",
        "outer/root",
    ]
    with pytest.raises(StoreError, match="object key"):
        store.key_of(store.uri(bad))


def test_file_store_uri_is_the_absolute_path(filestore: FileStore) -> None:
    assert filestore.uri("a/b.json") == f"file://{filestore.root}/a/b.json"
    filestore.put_bytes("a/b.json", b"{}")
    assert (filestore.root / "a" / "b.json").read_bytes() == b"{}"


def test_file_store_refuses_a_sibling_root(filestore: FileStore) -> None:
    with pytest.raises(StoreError, match="outside this store's root"):
        filestore.key_of(f"file://{filestore.root}2/x")


def test_file_store_key_and_prefix_clash(filestore: FileStore) -> None:
    filestore.put_bytes("a", b"1")
    with pytest.raises(StoreError, match=r"clashes with an existing object or prefix"):
        filestore.put_bytes("a/b", b"2")
    filestore.put_bytes("c/d", b"3")
    with pytest.raises(StoreError, match=r"clashes with an existing object or prefix"):
        filestore.put_bytes("c", b"4")
    assert filestore.list() == ["a", "c/d"]


def test_file_store_failed_write_leaves_the_old_object_and_no_temp_file(
    filestore: FileStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    filestore.put_bytes("s/LATEST.json", b"old")

    def replace_fails(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", replace_fails)
    with pytest.raises(StoreError, match=r"write .*LATEST\.json: No space left on device"):
        filestore.put_bytes("s/LATEST.json", b"new")
    monkeypatch.undo()
    assert filestore.get_bytes("s/LATEST.json") == b"old"
    assert os.listdir(filestore.root / "s") == ["LATEST.json"]


def test_file_store_lists_no_temp_file_a_killed_writer_left(filestore: FileStore) -> None:
    script = (
        "import os, signal, sys\n"
        "from rollpacker.store.local import FileStore\n"
        "os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)\n"
        "FileStore(sys.argv[1]).put_bytes('s/step-000001.json', b'x' * 100000)\n"
    )
    filestore.put_bytes("s/step-000000.json", b"{}")
    proc = subprocess.run([sys.executable, "-c", script, str(filestore.root)], check=False, timeout=60)
    assert proc.returncode == -9
    left = sorted(os.listdir(filestore.root / "s"))
    assert len(left) == 2 and TMP_MARK in left[0]  # the killed writer's temporary file is still there
    assert filestore.list() == ["s/step-000000.json"]
    assert filestore.list("s/.step") == []
    assert not filestore.exists("s/step-000001.json")
    assert filestore.delete_prefix("s/") == 1


def test_file_store_delete_prefix_removes_emptied_directories(filestore: FileStore) -> None:
    filestore.put_bytes("exp/arm/ckpt/step-000001/w", b"1")
    filestore.put_bytes("exp/arm2/x", b"1")
    assert filestore.delete_prefix("exp/arm/") == 1
    assert sorted(p.name for p in (filestore.root / "exp").iterdir()) == ["arm2"]
    assert filestore.delete_prefix("exp/") == 1
    assert list(filestore.root.iterdir()) == []  # the root itself stays
    filestore.check()


def test_file_store_root_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    store = FileStore(tmp_path / "f")
    with pytest.raises(
        StoreError, match=rf"store\.endpoint = .*: {re.escape(str(tmp_path / 'f'))} is not a dir"
    ):
        store.check()


def _can_create_in(d: Path) -> bool:
    probe = d / f".probe-{uuid.uuid4().hex[:8]}"
    try:
        probe.open("x").close()
    except OSError:
        return False
    probe.unlink()
    return True


@pytest.fixture
def unwritable_dir(tmp_path: Path) -> Path:
    """A directory this process cannot write in: read-only bits for a normal user; for root (whom
    permission bits do not stop) a kernel directory no one can create files in, if there is one."""
    d = tmp_path / "ro"
    d.mkdir(mode=0o555)
    for cand in (d, Path("/sys/kernel"), Path("/proc/self")):
        if cand.is_dir() and not _can_create_in(cand):
            return cand
    pytest.skip("no directory this process cannot write in (root, and no read-only kernel directory)")


def test_file_store_unwritable_directory_names_the_path(unwritable_dir: Path) -> None:
    store = FileStore(unwritable_dir)
    path = re.escape(str(unwritable_dir))
    with pytest.raises(StoreError, match=rf"store\.endpoint = .*: cannot write in {path} .*make it writable"):
        store.check()


def test_file_store_documents_are_plain_json_files(filestore: FileStore, prefix: str) -> None:
    ss = StateStore(filestore, prefix, "arm")
    chain(ss, 0)
    ptr = json.loads((filestore.root / prefix / "arm" / "state" / "LATEST.json").read_text())
    assert ptr == {"step": -1, "key": ss.state_key(-1)}
