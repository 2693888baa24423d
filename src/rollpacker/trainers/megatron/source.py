"""Where the megatron gang reads weights: a prefix in the object store, never a path of one pod.

A ``StoreSource`` (a store configuration and a URI) is what crosses from the trainer service to
its ranks. Each rank opens the store itself, on its own node, with its own node's credentials
(the variables ``store.access_key_env`` / ``store.secret_key_env`` name, or the local credentials
file), and fetches what it reads into a scratch directory of its own node:

- a Hugging Face model (``config.json`` and ``*.safetensors``): ``fetch`` downloads the files once
  per node (ranks of one node share the download), and ``LazyWeights`` reads a tensor from them
  only when ``to_mcore`` asks for it, so a rank holds only its own stage's tensors, cut to its TP
  shard, plus one full tensor at a time while it cuts;
- a ``dist_checkpointing`` checkpoint (``dist/``): downloaded once per node, and every rank reads
  its own shards of it.

After the gang-wide load (every rank past a barrier) each rank removes its node's scratch copy.
A ``file://`` store is a directory: fine on one node (tests, ``rollpacker run`` on a laptop), and
on a cluster only where that directory is a shared volume; the S3 store needs none.

Invariants:
- a rank never reads a path it was handed; it reads the store (``tests/trainers/megatron``:
  ``test_source.py``);
- ``LazyWeights`` reads exactly the tensors asked for, each once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rollpacker.core.config import StoreConfig
from rollpacker.core.errors import TrainerError
from rollpacker.store import open_store
from rollpacker.store.base import ObjectStore, cached_download

SCRATCH_PREFIX = "rollpacker-fetch"  # the node scratch directory's name in the node's temp dir


@dataclass(frozen=True)
class StoreSource:
    """A model or checkpoint at ``uri`` in the store ``store`` names (what ranks get: no paths)."""

    store: StoreConfig
    uri: str

    def __post_init__(self) -> None:
        if not self.uri:
            raise TrainerError("the megatron gang needs the URI of a model or checkpoint in the store")

    @classmethod
    def local(cls, path: str | Path) -> StoreSource:
        """A directory of this machine, as a file store (tests; one-node runs)."""
        p = Path(path).resolve()
        return cls(StoreConfig(endpoint=f"file://{p.parent}"), f"file://{p}")

    def open(self) -> ObjectStore:
        return open_store(self.store)

    def key(self, rel: str = "") -> str:
        base = self.open().key_of(self.uri).strip("/")
        return f"{base}/{rel}" if rel else base

    def child(self, rel: str) -> StoreSource:
        """The source of ``rel`` under this one (``model``, ``dist``)."""
        return StoreSource(self.store, self.open().uri(self.key(rel)))

    def exists(self, rel: str) -> bool:
        return self.open().exists(self.key(rel))

    def read_bytes(self, rel: str) -> bytes:
        return self.open().get_bytes(self.key(rel))

    def read_json(self, rel: str) -> Any:
        return json.loads(self.read_bytes(rel))

    def read_torch(self, rel: str) -> Any:
        return torch.load(io.BytesIO(self.read_bytes(rel)), weights_only=False)

    def model(self) -> StoreSource:
        """The Hugging Face model of a checkpoint (its ``model/``), or this source itself."""
        return self.child("model") if self.exists("model/config.json") else self

    def fetch(self) -> Path:
        """Every object under the URI in this node's scratch directory: the node's first rank
        downloads it, the others wait on a lock file and reuse the copy."""
        root = scratch_root()
        root.mkdir(parents=True, exist_ok=True)
        with open(root / f"{self._digest()}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return cached_download(self.open(), self.uri, root)

    def drop(self) -> None:
        """This node's scratch copy removed (after the gang-wide load; missing is no error)."""
        for d in scratch_root().glob(f"{self._digest()}-*"):
            shutil.rmtree(d, ignore_errors=True)
        with contextlib.suppress(OSError):
            (scratch_root() / f"{self._digest()}.lock").unlink()

    def _digest(self) -> str:
        """``cached_download``'s key of this URI (one spelling per prefix)."""
        store = self.open()
        return hashlib.sha256(store.uri(store.key_of(self.uri).strip("/")).encode()).hexdigest()[:16]


def scratch_root() -> Path:
    """This node's scratch directory for fetched weights (the node's own temp dir)."""
    return Path(tempfile.gettempdir()) / SCRATCH_PREFIX


class LazyWeights(Mapping[str, torch.Tensor]):
    """The tensors of a fetched Hugging Face model, each read from its safetensors file when asked
    for (``reads`` lists the names read, in order)."""

    def __init__(self, model_dir: Path) -> None:
        from safetensors import safe_open

        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise TrainerError(f"the model fetched to {model_dir} holds no *.safetensors weights")
        self._stack = contextlib.ExitStack()
        self._where: dict[str, Any] = {}
        for f in files:
            h = self._stack.enter_context(safe_open(str(f), framework="pt"))
            self._where.update(dict.fromkeys(h.keys(), h))
        self.reads: list[str] = []

    def __getitem__(self, name: str) -> torch.Tensor:
        h = self._where.get(name)
        if h is None:
            raise KeyError(name)
        self.reads.append(name)
        return h.get_tensor(name)  # type: ignore[no-any-return]

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def close(self) -> None:
        self._stack.close()
