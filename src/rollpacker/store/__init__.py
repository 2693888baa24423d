"""The object store: one port (:class:`~rollpacker.store.base.ObjectStore`), two adapters, and the
state store on top.

``open_store(cfg)`` is the one way the rest of the code gets a store:

- ``store.endpoint: file:///abs/path`` (or ``file://rel/path``, resolved against the current
  directory) gives a :class:`~rollpacker.store.local.FileStore` rooted there;
- anything else (``host:port``, the default) gives an :class:`~rollpacker.store.s3.S3Store` with
  the credentials ``S3Store.from_config`` finds, inside a :class:`~rollpacker.store.patient.PatientStore`
  that rides out an outage of up to ``store.outage_s`` seconds (0: the bare S3 store).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path

from rollpacker.core.config import StoreConfig
from rollpacker.store.base import ObjectStore, StoreError, cached_download
from rollpacker.store.local import FileStore
from rollpacker.store.patient import PatientStore
from rollpacker.store.s3 import S3Store

__all__ = [
    "FileStore",
    "ObjectStore",
    "PatientStore",
    "S3Store",
    "StoreError",
    "cached_download",
    "open_store",
]


def open_store(cfg: StoreConfig, env: Mapping[str, str] | None = None) -> ObjectStore:
    """The store ``cfg.endpoint`` names. Nothing is contacted: call ``check()`` to verify it.

    For a ``file://`` endpoint the root directory is created when it is missing and its parent
    exists (``file:///data/store`` makes ``store`` inside an existing ``/data``); a missing parent
    is left alone, and ``check()`` then names the path to create. ``env`` (default ``os.environ``)
    is where an S3 store looks for its credential variables."""
    root = cfg.file_root
    if root is None:
        s3 = S3Store.from_config(cfg, env=env)
        return PatientStore(s3, cfg.outage_s) if cfg.outage_s > 0 else s3
    path = Path(os.path.abspath(root))
    if not path.exists() and path.parent.is_dir():
        with contextlib.suppress(OSError):  # no permission: check() names the path
            path.mkdir()
    return FileStore(path)
