"""Where the megatron gang reads weights: a prefix in the object store, never a path of one pod.

A ``StoreSource`` (a store configuration and a URI) is what crosses from the trainer service to
its ranks. Each rank opens the store itself, on its own node, with its own node's credentials
(the variables ``store.access_key_env`` / ``store.secret_key_env`` name, or the local credentials
file), and fetches what it reads into a scratch directory of its own node:

- a Hugging Face model (``config.json`` and ``*.safetensors``): ``fetch_stage`` copies to the node
  only what one pipeline stage reads (ranks of one node and stage share the copy): every file but
  the weights (config, tokenizer, the index), and of the weights only the stage's tensors
  (``convert.stage_hf_names``): the files the index (``model.safetensors.index.json``'s
  ``weight_map``) places them in, or every ``*.safetensors`` file without an index, each read by
  byte ranges (``ObjectStore.get_range``: the header, then the runs of wanted tensors) into a
  smaller safetensors file of only those tensors, bit for bit. ``LazyWeights`` reads a tensor from
  the copy only when ``to_mcore`` asks for it, so a rank holds only its own stage's tensors, cut
  to its TP shard, plus one full tensor at a time while it cuts;
- a ``dist_checkpointing`` checkpoint (``dist/``): downloaded once per node, and every rank reads
  its own shards of it.

After the gang-wide load (every rank past a barrier) each rank removes its node's scratch copy.
A ``file://`` store is a directory: fine on one node (tests, ``rollpacker run`` on a laptop), and
on a cluster only where that directory is a shared volume; the S3 store needs none.

Invariants:
- a rank never reads a path it was handed; it reads the store (``tests/trainers/megatron``:
  ``test_source.py``);
- ``LazyWeights`` reads exactly the tensors asked for, each once;
- ``fetch_stage`` reads from the store the non-weight files, the headers of the files it looks
  into and the bytes of the wanted tensors, nothing else; every wanted tensor is in the copy,
  equal bit for bit to the store's, or it fails naming the missing ones
  (``tests/trainers/megatron/test_source.py``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import shutil
import tempfile
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rollpacker.core.config import StoreConfig
from rollpacker.core.errors import TrainerError
from rollpacker.store import open_store
from rollpacker.store.base import ObjectStore, cached_download, download_atomically

SCRATCH_PREFIX = "rollpacker-fetch"  # the node scratch directory's name in the node's temp dir
INDEX = "model.safetensors.index.json"  # a sharded checkpoint's index (``weight_map``: tensor -> file)
RANGE_BYTES = 64 * 2**20  # the most one ranged read of tensor bytes asks for (and holds in memory)


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

    def fetch_stage(self, names: Collection[str]) -> StageCopy:
        """This node's copy of what one pipeline stage reads: every object under the URI but the
        weights, and of the ``*.safetensors`` files only the tensors ``names`` (module docstring).
        The node's first rank of the stage copies it, the others wait on the lock and reuse it."""
        want = frozenset(names)
        tag = hashlib.sha256("\n".join(sorted(want)).encode()).hexdigest()[:12]
        root = scratch_root()
        root.mkdir(parents=True, exist_ok=True)
        with open(root / f"{self._digest()}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            store = self.open()
            raw = self.read_bytes(INDEX) if self.exists(INDEX) else None
            index = self._weight_map(raw)
            files = {index[n] for n in want if n in index} if index is not None else None
            got = _Copied()

            def fetch(key: str, target: Path) -> None:
                if not key.endswith(".safetensors"):
                    data = raw if raw is not None and key == self.key(INDEX) else store.get_bytes(key)
                    got.bytes += len(data)
                    target.write_bytes(data)
                elif files is None or key.rsplit("/", 1)[-1] in files:
                    _copy_tensors(store, key, target, want, got)

            dst = download_atomically(store, self.uri, root / f"{self._digest()}-stage-{tag}", fetch)
            missing = sorted(want - got.names) if got.bytes else []
            if missing:
                shutil.rmtree(dst, ignore_errors=True)
                raise TrainerError(
                    f"{self.uri}: {len(missing)} tensor(s) a pipeline stage reads are in none of its "
                    f"safetensors files{' (by ' + INDEX + ')' if index is not None else ''}: {missing[:3]}"
                )
            return StageCopy(dst, got.bytes, tuple(sorted(got.files)))

    def _weight_map(self, raw: bytes | None) -> dict[str, str] | None:
        """The tensor -> file map of a sharded checkpoint's index (``raw``), None without one."""
        if raw is None:
            return None
        try:
            wm = json.loads(raw).get("weight_map")
        except (ValueError, AttributeError):
            wm = None
        if not isinstance(wm, dict):
            raise TrainerError(f"{self.uri}: {INDEX} has no weight_map (tensor name -> file)")
        return {str(k): str(v) for k, v in wm.items()}

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


@dataclass(frozen=True)
class StageCopy:
    """A stage's copy on this node: where it is, the bytes this call read from the store (0 when
    the node's copy was reused) and the safetensors files it cut (``key`` names in the store)."""

    path: Path
    fetched_bytes: int
    files: tuple[str, ...]


class _Copied:
    """What one ``fetch_stage`` read: bytes, the tensors found, the weight files looked into."""

    def __init__(self) -> None:
        self.bytes = 0
        self.names: set[str] = set()
        self.files: set[str] = set()


def _copy_tensors(store: ObjectStore, key: str, target: Path, want: frozenset[str], got: _Copied) -> None:
    """The tensors of safetensors object ``key`` that are in ``want``, read by byte ranges into a
    safetensors file ``target`` of only those (none wanted: no file)."""
    n = int.from_bytes(store.get_range(key, 0, 8), "little")
    header = json.loads(store.get_range(key, 8, n))
    got.bytes += 8 + n
    got.files.add(key)
    meta = header.pop("__metadata__", None)
    keep = sorted((v["data_offsets"][0], v["data_offsets"][1], k) for k, v in header.items() if k in want)
    if not keep:
        return
    out: dict[str, Any] = {"__metadata__": meta} if meta is not None else {}
    at = 0
    for start, end, k in keep:
        out[k] = {**header[k], "data_offsets": [at, at + end - start]}
        at += end - start
    blob = json.dumps(out, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the header padded to 8 bytes, as safetensors writes it
    with open(target, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        for lo, hi in _runs((start, end) for start, end, _ in keep):
            for pos in range(lo, hi, RANGE_BYTES):
                data = store.get_range(key, 8 + n + pos, min(RANGE_BYTES, hi - pos))
                if len(data) != min(RANGE_BYTES, hi - pos):
                    raise TrainerError(f"{store.uri(key)}: ends before its tensors do (a truncated upload?)")
                got.bytes += len(data)
                f.write(data)
    got.names.update(k for _, _, k in keep)


def _runs(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted byte ranges merged where one ends where the next begins (one read per run)."""
    out: list[tuple[int, int]] = []
    for lo, hi in ranges:
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


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
