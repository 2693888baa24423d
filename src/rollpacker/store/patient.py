"""An object store that rides out an outage: ``PatientStore`` wraps another store and retries every
call that failed with :class:`StoreUnavailable` (the server did not answer, or answered 5xx), with
exponential backoff, for at most ``store.outage_s`` seconds in all; then it fails with a
``StoreError`` that says how long it tried and which setting bounds it.

What is retried is exactly what cannot have half-happened: every call of the port writes a whole
object or nothing (``put_bytes``), reads, lists, or is idempotent (``delete_prefix``,
``upload_dir``, ``download_dir``, which is atomic), so repeating it after a refused or dropped
request leaves the same objects as one success. ``check()`` is never retried: a wrong endpoint
must fail in seconds before any step runs. A call that fails for another reason (a missing
object, bad credentials) fails at once.

The state store's commit writes the document, then moves the pointer: an outage between the two
leaves the document one past the pointer, which the next plan's ``recover()`` adopts
(docs/pipeline.md), so a commit that gives up never leaves a half-written state.
"""

from __future__ import annotations

import builtins
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from rollpacker.store.base import ObjectStore, StoreError, StoreUnavailable

log = logging.getLogger(__name__)
T = TypeVar("T")


class PatientStore:
    """``inner`` with its calls retried through an outage of up to ``outage_s`` seconds."""

    def __init__(
        self,
        inner: ObjectStore,
        outage_s: float,
        first_backoff_s: float = 0.25,
        max_backoff_s: float = 5.0,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.inner = inner
        self.outage_s = outage_s
        self.first_backoff_s, self.max_backoff_s = first_backoff_s, max_backoff_s
        self._sleep, self._clock = sleep, clock
        self.retried = 0  # calls that needed at least one retry (and got through)

    def _patiently(self, what: str, fn: Callable[[], T]) -> T:
        t0 = self._clock()
        wait, tries = self.first_backoff_s, 0
        while True:
            try:
                out = fn()
            except StoreUnavailable as e:
                waited = self._clock() - t0
                if waited + wait > self.outage_s:
                    raise StoreError(
                        f"{e}; still unreachable after {waited:.1f} s of retries ({tries + 1} tries; "
                        f"store.outage_s = {self.outage_s:g} bounds how long a stage waits)"
                    ) from e
                if tries == 0:
                    log.warning(
                        "object store unreachable during %s (%s); retrying for up to %g s",
                        what,
                        e,
                        self.outage_s,
                    )
                tries += 1
                self._sleep(wait)
                wait = min(wait * 2, self.max_backoff_s)
                continue
            if tries:
                self.retried += 1
                log.warning("object store back after %.1f s (%s)", self._clock() - t0, what)
            return out

    # -- the port ---------------------------------------------------------------------------------
    def check(self) -> None:
        self.inner.check()

    def uri(self, key: str) -> str:
        return self.inner.uri(key)

    def key_of(self, uri: str) -> str:
        return self.inner.key_of(uri)

    def put_bytes(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> str:
        return self._patiently(f"put {key}", lambda: self.inner.put_bytes(key, data, content_type))

    def get_bytes(self, key: str) -> bytes:
        return self._patiently(f"get {key}", lambda: self.inner.get_bytes(key))

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        return self._patiently(f"get {key}", lambda: self.inner.get_range(key, offset, length))

    def exists(self, key: str) -> bool:
        return self._patiently(f"exists {key}", lambda: self.inner.exists(key))

    def put_json(self, key: str, obj: Any) -> str:
        return self._patiently(f"put {key}", lambda: self.inner.put_json(key, obj))

    def get_json(self, key: str) -> Any:
        return self._patiently(f"get {key}", lambda: self.inner.get_json(key))

    def list(self, prefix: str = "") -> builtins.list[str]:
        return self._patiently(f"list {prefix}", lambda: self.inner.list(prefix))

    def delete(self, key: str) -> bool:
        return self._patiently(f"delete {key}", lambda: self.inner.delete(key))

    def delete_prefix(self, prefix: str) -> int:
        return self._patiently(f"delete {prefix}", lambda: self.inner.delete_prefix(prefix))

    def upload_dir(self, local_dir: Path | str, prefix: str) -> str:
        return self._patiently(f"upload {prefix}", lambda: self.inner.upload_dir(local_dir, prefix))

    def download_dir(self, uri: str, local_dir: Path | str) -> Path:
        return self._patiently(f"download {uri}", lambda: self.inner.download_dir(uri, local_dir))

    def __getattr__(self, name: str) -> Any:  # adapter extras (credentials_source, bucket, ...)
        return getattr(self.inner, name)
