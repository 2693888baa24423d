"""The object store port: where the controller keeps everything between steps.

State documents, per-step blobs, checkpoints and profiles all go through one :class:`ObjectStore`.
Two adapters implement it: ``S3Store`` (``rollpacker.store.s3``: MinIO in a cluster, SeaweedFS on
one machine) and ``FileStore`` (``rollpacker.store.local``: a directory). ``open_store`` picks one
from ``store.endpoint``. Both pass ``tests/store/test_store_contract.py``.

Contract:
- keys are non-empty relative strings without a trailing ``/`` (``exp/arm/state/step-000003.json``);
  a bad key raises :class:`StoreError` before anything is written;
- ``put_bytes(k, b)`` writes the whole object at once and returns ``uri(k)``; ``get_bytes(k)`` after
  it returns ``b``; a reader sees the old object or the new one, never a part (the state store's
  pointer move relies on this); a later put replaces the object;
- ``get_bytes`` / ``get_json`` of a missing key raise :class:`StoreError` ``"<uri>: no such object"``;
  ``exists(k)`` is True exactly when ``get_bytes(k)`` would succeed;
- ``get_range(k, offset, length)`` returns ``get_bytes(k)[offset:offset + length]`` and reads only
  those bytes from the server (an HTTP range request on S3): fewer where the object ends sooner,
  ``b""`` from its end on; a negative offset or a length < 1 raises ``StoreError`` before any read;
  a missing key raises like ``get_bytes``;
- ``put_json`` / ``get_json`` round-trip JSON values; ``get_json`` of non-JSON raises ``StoreError``
  naming the URI;
- ``list(prefix)`` returns every key starting with ``prefix`` (a string prefix, recursive), sorted,
  and never a partly written object;
- ``delete(k)`` deletes the object ``k`` and returns whether there was one (a missing key is no
  error);
- ``delete_prefix(prefix)`` takes a ``dir/`` prefix ending in ``/`` (so ``a/b/`` never takes
  ``a/bc`` with it), deletes every key under it and returns how many it deleted (0 when none);
- ``upload_dir(d, p)`` writes every file under ``d`` to ``p/<relative path>`` and returns
  ``uri(p + "/")``; ``download_dir(uri, t)`` writes every object under ``uri`` into ``t``
  atomically (``t`` appears complete or not at all), reuses a ``t`` that holds a complete download
  of the same URI, and refuses a ``t`` that holds anything else;
- ``key_of(uri(k)) == k`` (``key_of`` of the store's own root URI is ``""``); ``key_of`` refuses a
  URI of another scheme, bucket or root with a ``StoreError`` naming the setting to fix;
- ``check()`` fails fast, before any step runs, with a ``StoreError`` naming the setting to fix
  (``store.endpoint``, ``store.bucket``, the credential variables; for the file store the path);
- every failure the user can fix is a :class:`StoreError`.

Callers must not rely on more than this: S3 allows ``a`` and ``a/b`` to coexist, a directory
cannot, so the file store refuses the second one.

The shared helpers below (key checks, JSON encoding, the atomic download, :func:`cached_download`)
use nothing but the port, so they work for every adapter.
"""

from __future__ import annotations

import builtins
import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any, Protocol, runtime_checkable

from rollpacker.core.errors import RollpackerError

# A download's marker file: the URI it came from. A directory holding it is a complete download.
DOWNLOAD_MARKER = ".rollpacker-download"


class StoreError(RollpackerError, RuntimeError):
    """The object store cannot be reached or used, or an object or URI is missing or malformed."""


class StoreUnavailable(StoreError):
    """The store did not answer (refused, reset, timed out, or a 5xx): possibly for a while only;
    ``PatientStore`` retries these and nothing else."""


@runtime_checkable
class ObjectStore(Protocol):
    """One bucket (S3) or one directory (file store) of objects; see the module's Contract."""

    def check(self) -> None:
        """Verify the store is reachable and writable; the error names the setting to fix."""
        ...

    def uri(self, key: str) -> str:
        """The URI of ``key`` (``s3://<bucket>/<key>``, ``file:///<root>/<key>``)."""
        ...

    def key_of(self, uri: str) -> str:
        """The key of one of this store's URIs; refuses another scheme, bucket or root."""
        ...

    def put_bytes(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> str:
        """Write ``data`` to ``key`` in one piece; returns ``uri(key)``."""
        ...

    def get_bytes(self, key: str) -> bytes:
        """The object at ``key``; a missing one raises ``StoreError("<uri>: no such object")``."""
        ...

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """``length`` bytes of the object at ``key`` from ``offset`` (fewer where it ends sooner)."""
        ...

    def exists(self, key: str) -> bool: ...

    def put_json(self, key: str, obj: Any) -> str:
        """``put_bytes`` of ``obj`` as JSON; returns ``uri(key)``."""
        ...

    def get_json(self, key: str) -> Any:
        """The JSON value at ``key``; non-JSON raises ``StoreError`` naming the URI."""
        ...

    def list(self, prefix: str = "") -> builtins.list[str]:
        """Every key starting with ``prefix`` (recursive), sorted."""
        ...

    def delete(self, key: str) -> bool:
        """Delete the object ``key``; True when it existed."""
        ...

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key under the ``dir/`` prefix ``prefix``; returns how many were deleted."""
        ...

    def upload_dir(self, local_dir: Path | str, prefix: str) -> str:
        """Write every file under ``local_dir`` to ``prefix/<relative path>``; returns its URI."""
        ...

    def download_dir(self, uri: str, local_dir: Path | str) -> Path:
        """Atomically download every object under ``uri`` into ``local_dir``; returns it."""
        ...


# -- keys ------------------------------------------------------------------------------------------


def check_key(key: str) -> None:
    """Refuse a key that is empty, absolute or ends in ``/`` (every adapter)."""
    if not isinstance(key, str) or not key or key.startswith("/") or key.endswith("/"):
        raise StoreError(f"object key {key!r}: use a non-empty relative key like 'exp/arm/state/x.json'")


def check_range(uri: str, offset: int, length: int) -> None:
    """Refuse a byte range no object has (``get_range``'s arguments)."""
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise StoreError(f"{uri}: range offset {offset!r} must be an integer >= 0")
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise StoreError(f"{uri}: range length {length!r} must be an integer >= 1")


def check_dir_prefix(prefix: str) -> None:
    """Refuse a ``delete_prefix`` prefix that is not a non-empty relative ``dir/``."""
    if not isinstance(prefix, str) or not prefix or not prefix.endswith("/") or prefix.startswith("/"):
        raise StoreError(f"delete_prefix({prefix!r}): the prefix must be a non-empty 'dir/' ending in '/'")


# -- JSON ------------------------------------------------------------------------------------------


def dump_json(obj: Any) -> bytes:
    """The bytes ``put_json`` writes (stable: sorted keys, so equal values give equal bytes)."""
    return json.dumps(obj, indent=1, sort_keys=True).encode()


def load_json(data: bytes, uri: str) -> Any:
    """The JSON value of ``data`` read from ``uri``; anything else is a ``StoreError`` naming it."""
    try:
        return json.loads(data)
    except ValueError as e:
        raise StoreError(f"{uri}: not JSON ({e})") from e


# -- directories -----------------------------------------------------------------------------------


def upload_plan(local_dir: Path | str, prefix: str) -> tuple[str, builtins.list[tuple[Path, str]]]:
    """The normalised prefix (no leading or trailing ``/``) and the ``(file, key)`` pairs an
    ``upload_dir`` writes, sorted; refuses a missing or empty directory and an empty prefix."""
    src = Path(local_dir)
    if not src.is_dir():
        raise StoreError(f"upload_dir: {src} is not a directory")
    prefix = prefix.strip("/")
    if not prefix:
        raise StoreError("upload_dir: give a non-empty key prefix (e.g. exp/arm/ckpt/step-000003)")
    files = sorted(p for p in src.rglob("*") if p.is_file() and p.name != DOWNLOAD_MARKER)
    if not files:
        raise StoreError(f"upload_dir: {src} holds no files")
    return prefix, [(p, f"{prefix}/{p.relative_to(src).as_posix()}") for p in files]


def download_atomically(
    store: ObjectStore, uri: str, local_dir: Path | str, fetch: Callable[[str, Path], None]
) -> Path:
    """``download_dir`` for any adapter: ``fetch(key, target)`` writes one object to a local file.

    Invariants: objects land in a temporary sibling of ``local_dir`` that is renamed into place
    once complete (with a marker naming the URI), so ``local_dir`` is complete or absent; a
    ``local_dir`` whose marker names the same URI is reused as it is; one holding anything else is
    refused; a failure leaves no temporary directory behind."""
    dst = Path(local_dir)
    prefix = store.key_of(uri).strip("/")
    uri = store.uri(prefix)  # one spelling per prefix: s3://b/x/ and s3://b/x are the same download
    if _is_download_of(dst, uri):
        return dst
    if dst.exists():
        raise StoreError(
            f"download_dir: {dst} exists and is not a complete download of {uri}; remove it or choose "
            "another directory"
        )
    keys = store.list(prefix + "/" if prefix else "")
    if not keys:
        raise StoreError(f"download_dir: nothing under {uri}; check the URI (was it uploaded?)")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        base = PurePosixPath(prefix) if prefix else None
        for key in keys:
            rel = PurePosixPath(key).relative_to(base) if base else PurePosixPath(key)
            if ".." in rel.parts or rel.is_absolute():
                raise StoreError(f"download_dir: refusing key {key!r} (escapes the target directory)")
            target = tmp.joinpath(*rel.parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            fetch(key, target)
        (tmp / DOWNLOAD_MARKER).write_text(uri)
        try:
            tmp.rename(dst)
        except OSError:
            if not _is_download_of(dst, uri):  # a concurrent download of the same URI won: reuse it
                raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(tmp, ignore_errors=True)
    return dst


def cached_download(store: ObjectStore, uri: str, cache_root: Path | str) -> Path:
    """``store.download_dir`` into a directory of ``cache_root`` keyed by the URI. Checkpoint and
    profile URIs are immutable, so a cached copy never goes stale; a second call (with any spelling
    of the URI: trailing ``/`` or not) returns the same directory without reading the store."""
    uri = store.uri(store.key_of(uri).strip("/"))
    tail = re.sub(r"[^A-Za-z0-9._-]", "_", uri.rstrip("/").rsplit("/", 1)[-1])[:40] or "root"
    digest = hashlib.sha256(uri.encode()).hexdigest()[:16]
    return store.download_dir(uri, Path(cache_root) / f"{digest}-{tail}")


def _is_download_of(path: Path, uri: str) -> bool:
    marker = path / DOWNLOAD_MARKER
    try:
        return marker.read_text() == uri
    except OSError:
        return False


def short(e: object, limit: int = 200) -> str:
    """``str(e)``, cut to ``limit`` characters for an error message."""
    text = str(e)
    return text if len(text) <= limit else text[: limit - 3] + "..."
