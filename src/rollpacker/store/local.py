"""The filesystem adapter of the object store port: one directory holds every object.

:class:`FileStore` implements :class:`rollpacker.store.base.ObjectStore` for a run on one machine
(or on a shared filesystem) without an S3 server: ``store.endpoint: file:///abs/path``. It passes
``tests/store/test_store_contract.py``.

Invariants (tests/store/test_store_contract.py):
- the object ``k`` is the file ``<root>/k``; its URI is ``file://<root>/<k>`` (``<root>`` absolute,
  not percent-encoded), so ``key_of(uri(k)) == k``;
- a key never leaves the root: absolute keys and ``.``, ``..`` or empty segments are refused;
- every write goes to a temporary file in the object's directory and is renamed over the object
  with ``os.replace``: a reader sees the old object or the new one, never a part (the state
  store's pointer move is atomic); a failed write leaves no temporary file behind;
- ``list`` never returns a temporary file (not even one a killed writer left behind);
- ``delete_prefix`` removes the directories it empties, never the root;
- every operation on a root that does not exist raises :class:`StoreError` naming the path and
  ``store.endpoint``; nothing creates the root implicitly (``open_store`` may, see its docstring).
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from rollpacker.core.config import FILE_SCHEME
from rollpacker.store.base import (
    StoreError,
    check_dir_prefix,
    check_key,
    check_range,
    download_atomically,
    dump_json,
    load_json,
    upload_plan,
)

# Every temporary file's name holds this; keys that hold it are refused, so it never names an object.
TMP_MARK = ".rollpacker-tmp-"
FILE_MODE = 0o644


class FileStore:
    """One directory of objects. Keys are relative paths under ``root``; URIs are
    ``file:///<abs root>/<key>``. Implements :class:`rollpacker.store.base.ObjectStore`."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(os.path.abspath(root))
        if self.root == Path(self.root.anchor):
            raise StoreError(f"store.endpoint = {FILE_SCHEME}{self.root}: choose a directory, not the root /")
        self.endpoint = f"{FILE_SCHEME}{self.root.as_posix()}"

    # -- setup -----------------------------------------------------------------------------------

    def check(self) -> None:
        """Verify, before any step runs, that the root is an existing directory this process can
        write in (by writing and removing a probe file: permission bits alone lie for root)."""
        root = self._root()
        try:
            fd, probe = tempfile.mkstemp(dir=root, prefix=f".check{TMP_MARK}")
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise StoreError(
                f"store.endpoint = {self.endpoint!r}: cannot write in {root} ({e.strerror or e}); make "
                "it writable by this user (chmod / chown) or point store.endpoint at another directory"
            ) from e

    def _root(self) -> Path:
        """The root directory; a missing one (or a file) raises the error naming what to do."""
        if self.root.is_dir():
            return self.root
        what = "is not a directory" if self.root.exists() else "does not exist"
        raise StoreError(
            f"store.endpoint = {self.endpoint!r}: {self.root} {what}; create it (mkdir -p {self.root}) "
            "or point store.endpoint at an existing directory (open_store creates it only when its "
            "parent exists)"
        )

    # -- keys and URIs ---------------------------------------------------------------------------

    def uri(self, key: str) -> str:
        return f"{self.endpoint}/{key}"

    def key_of(self, uri: str) -> str:
        """The key of ``file://<root>/<key>`` (``""`` for the root itself); refuses other schemes,
        paths outside the root and keys that would escape it."""
        if not isinstance(uri, str) or not uri.startswith(FILE_SCHEME):
            raise StoreError(f"{uri!r} is not a file URI; expected {self.uri('<key>')}")
        if uri in (self.endpoint, self.endpoint + "/"):
            return ""
        if not uri.startswith(self.endpoint + "/"):
            raise StoreError(
                f"{uri!r} is outside this store's root {self.root} (store.endpoint = {self.endpoint!r}); "
                "fix store.endpoint or the URI"
            )
        key = uri[len(self.endpoint) + 1 :]
        _check_segments(key.removesuffix("/"), key)
        return key

    def _path(self, key: str) -> Path:
        """The file of ``key`` (checked: relative, no ``.``/``..``/empty segment, no temp name)."""
        check_key(key)
        _check_segments(key, key)
        return self.root.joinpath(*key.split("/"))

    # -- objects ---------------------------------------------------------------------------------

    def put_bytes(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> str:
        """Write ``data`` to ``key`` atomically (temp file + ``os.replace``); ``content_type`` is
        not stored (a file has none)."""
        path = self._path(key)
        self._write(path, key, lambda f: f.write(data))
        return self.uri(key)

    def get_bytes(self, key: str) -> bytes:
        path = self._path(key)
        self._root()
        with self._io(key):
            return path.read_bytes()

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        path = self._path(key)
        check_range(self.uri(key), offset, length)
        self._root()
        with self._io(key), open(path, "rb") as f:
            f.seek(offset)
            return f.read(length)

    def exists(self, key: str) -> bool:
        path = self._path(key)
        self._root()
        return path.is_file()

    def put_json(self, key: str, obj: Any) -> str:
        return self.put_bytes(key, dump_json(obj), "application/json")

    def get_json(self, key: str) -> Any:
        return load_json(self.get_bytes(key), self.uri(key))

    def list(self, prefix: str = "") -> builtins.list[str]:
        """Every key starting with ``prefix`` (a string prefix, as in S3; recursive), sorted;
        temporary files are never listed."""
        root = self._root()
        head = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        if head:
            _check_segments(head, prefix)
        top = root.joinpath(*head.split("/")) if head else root
        keys = []
        for dirpath, _dirs, files in os.walk(top):
            rel = Path(dirpath).relative_to(root).as_posix()
            for name in files:
                key = name if rel == "." else f"{rel}/{name}"
                if TMP_MARK not in name and key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def delete(self, key: str) -> bool:
        path = self._path(key)
        self._root()
        with self._io(key, "delete"):
            try:
                path.unlink()
            except FileNotFoundError:
                return False
        return True

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object under the ``dir/`` prefix ``prefix`` and the directories that leaves
        empty (never the root); returns how many objects were deleted."""
        check_dir_prefix(prefix)
        keys = self.list(prefix)
        for key in keys:
            with self._io(key, "delete"), contextlib.suppress(FileNotFoundError):
                self._path(key).unlink()
        top = self.root.joinpath(*prefix.rstrip("/").split("/"))
        if top.is_dir():
            for dirpath, _dirs, _files in os.walk(top, topdown=False):
                with contextlib.suppress(OSError):  # not empty: a concurrent writer's, or a temp file
                    os.rmdir(dirpath)
        return len(keys)

    # -- directories -----------------------------------------------------------------------------

    def upload_dir(self, local_dir: Path | str, prefix: str) -> str:
        """Copy every file under ``local_dir`` (recursive) to ``prefix/<relative path>``, each file
        atomically; returns the prefix's URI (ending in ``/``)."""
        prefix, files = upload_plan(local_dir, prefix)
        for src, key in files:
            with src.open("rb") as fin:
                self._write(self._path(key), key, functools.partial(shutil.copyfileobj, fin))
        return self.uri(prefix + "/")

    def download_dir(self, uri: str, local_dir: Path | str) -> Path:
        """Copy every object under ``uri`` into ``local_dir``, atomically (see
        :func:`rollpacker.store.base.download_atomically`)."""

        def fetch(key: str, target: Path) -> None:
            with self._io(key):
                shutil.copyfile(self._path(key), target)

        return download_atomically(self, uri, local_dir, fetch)

    # -- helpers ---------------------------------------------------------------------------------

    def _write(self, path: Path, key: str, write: Callable[[IO[bytes]], object]) -> None:
        """Write ``path`` through a temporary file in its directory, then ``os.replace`` it into
        place; the temporary file never outlives a failure."""
        self._root()
        with self._io(key, "write"):
            tmp, f = _open_temp(path)
            try:
                with f:
                    write(f)
                    f.flush()
                    os.fchmod(f.fileno(), FILE_MODE)
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    tmp.unlink()
                raise

    @contextlib.contextmanager
    def _io(self, key: str, verb: str = "read") -> Iterator[None]:
        """Translate an ``OSError`` on ``key`` into the ``StoreError`` saying what happened: a
        missing file is a missing object; a write that meets a file where a directory should be
        (or the reverse) clashes with another key."""
        try:
            yield
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError) as e:
            if verb != "write":
                raise StoreError(f"{self.uri(key)}: no such object") from e
            raise StoreError(
                f"write {self.uri(key)}: {key!r} clashes with an existing object or prefix ({e.strerror}); "
                "the file store cannot hold both 'a' and 'a/b'"
            ) from e
        except OSError as e:
            raise StoreError(f"{verb} {self.uri(key)}: {e.strerror or e} (under {self.root})") from e


def _open_temp(path: Path) -> tuple[Path, IO[bytes]]:
    """A new temporary file beside ``path`` (its directory made first), open for writing. Tried
    twice: a concurrent ``delete_prefix`` may remove the directory it just emptied in between."""
    tmp = path.parent / f".{path.name[:80]}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        return tmp, open(tmp, "xb")  # the caller closes it
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        return tmp, open(tmp, "xb")


def _check_segments(path: str, key: str) -> None:
    """Refuse a key (or prefix head) with an empty, ``.``, ``..`` or temporary-file segment: it
    would escape the root, alias another key, or hide as a temporary file."""
    for seg in path.split("/"):
        if seg in ("", ".", "..") or TMP_MARK in seg:
            raise StoreError(
                f"object key {key!r}: the file store refuses '.', '..', empty segments and "
                f"{TMP_MARK!r} in keys (they would leave the root or alias another key)"
            )
