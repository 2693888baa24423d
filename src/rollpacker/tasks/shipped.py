"""Shipped models: the warmed-up tiny models of the embedded default experiment, carried as package
data (``rollpacker/models/shipped``) so that a fresh machine's first run installs them into the model
cache instead of training them. ``rollpacker model ship`` (``tasks/ship.py``) builds them.

Layout: ``models/shipped/manifest.json`` and one directory per cache entry, named as the cache
names it (``warm-<preset>-<key>`` under ``<cache>/models``, ``judge-<key>`` at the cache's root),
holding the files the warm-up wrote there, its completeness marker (``warmup.json``,
``judge.json``) included.

Invariants (tests/tasks/test_shipped.py):
- a cache entry is installed from a shipped one only when its name, which carries the recipe's
  key, is in the manifest: any other recipe trains as before;
- every file of a shipped entry is checked against the manifest's sha256 before anything is
  installed; a mismatch is refused (``ShippedModelError`` naming the file and the rebuild command);
- an installed entry is complete or absent (copied into a temporary sibling, then renamed by
  ``publish_dir``) and holds exactly the shipped files, marker included.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from rollpacker.core.errors import RollpackerError
from rollpacker.tasks.tiny_model import publish_dir

SHIPPED_ROOT = Path(__file__).resolve().parent.parent / "models" / "shipped"
MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
REBUILD_COMMAND = "rollpacker model ship"  # (make shipped-models)
# the completeness marker each kind of warm-up writes last into its cache entry
MARKERS = {"warm-up": "warmup.json", "judge": "judge.json"}


# what the manifest records as an entry's validation figure: metric, value, examples, set, ...
ValFigure = dict[str, float | int | str]


class ShippedModelError(RollpackerError, RuntimeError):
    """A shipped model is not what its manifest says (a changed or missing file, a bad manifest)."""


@dataclass(frozen=True)
class ShippedEntry:
    """One shipped cache entry as the manifest describes it."""

    name: str  # the cache entry's directory name: warm-<preset>-<key> or judge-<key>
    kind: str  # "warm-up" (the policy's start model) or "judge" (the toy judge)
    key: str  # the recipe's cache key (WarmupSpec.key(), JudgeWarmupSpec.key())
    config: str  # the shipped config whose recipe it is
    recipe: dict[str, object]  # the recipe (the warm-up spec) as a dict
    files: dict[str, str]  # file name -> sha256
    val: ValFigure  # what was measured at build time: metric, value, examples, set
    shape: dict[str, int | bool]  # the config.json shape keys (TinyModelSpec.config_json())
    tensors: dict[str, list[int]]  # tensor name -> shape, in the safetensors file
    parameters: int
    dtype: str
    tokenizer: str  # tiny_model.tokenizer_id()
    built_with: dict[str, str]  # torch / transformers versions, threads: where the bits came from

    def __post_init__(self) -> None:
        if self.kind not in MARKERS:
            raise ShippedModelError(
                f"shipped entry {self.name!r}: kind {self.kind!r}; use one of {sorted(MARKERS)}"
            )
        if MARKERS[self.kind] not in self.files:
            raise ShippedModelError(
                f"shipped entry {self.name!r}: its marker {MARKERS[self.kind]} is not listed"
            )
        if not self.name.endswith(self.key):
            raise ShippedModelError(
                f"shipped entry {self.name!r}: its name does not end with its key {self.key}"
            )

    @property
    def marker(self) -> str:
        return MARKERS[self.kind]

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, object], where: str) -> ShippedEntry:
        names = {f.name for f in fields(cls)}
        missing, unknown = sorted(names - set(data)), sorted(set(data) - names)
        if missing or unknown:
            raise ShippedModelError(
                f"{where}: missing fields {missing}, unknown fields {unknown}; {rebuild_hint()}"
            )
        return cls(**data)  # type: ignore[arg-type]


def rebuild_hint() -> str:
    return f"rebuild the shipped models with `{REBUILD_COMMAND}` (or `make shipped-models`)"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def load_manifest(root: Path | None = None) -> dict[str, ShippedEntry]:
    """The shipped entries by name ({} when nothing is shipped)."""
    f = (root or SHIPPED_ROOT) / MANIFEST
    if not f.is_file():
        return {}
    try:
        data = json.loads(f.read_text())
    except ValueError as e:
        raise ShippedModelError(f"{f}: not valid JSON ({e}); {rebuild_hint()}") from e
    if data.get("version") != MANIFEST_VERSION or not isinstance(data.get("entries"), list):
        raise ShippedModelError(f"{f}: not a version-{MANIFEST_VERSION} manifest; {rebuild_hint()}")
    entries = [ShippedEntry.from_json(e, f"{f} entry {i}") for i, e in enumerate(data["entries"])]
    return {e.name: e for e in entries}


def write_manifest(root: Path, entries: list[ShippedEntry]) -> Path:
    f = root / MANIFEST
    body = {
        "version": MANIFEST_VERSION,
        "rebuild": REBUILD_COMMAND,
        "entries": [e.to_json() for e in entries],
    }
    f.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
    return f


def verify(entry: ShippedEntry, root: Path | None = None) -> Path:
    """The entry's directory, once every listed file is there with the manifest's sha256."""
    d = (root or SHIPPED_ROOT) / entry.name
    for name, want in sorted(entry.files.items()):
        f = d / name
        if not f.is_file():
            raise ShippedModelError(f"shipped model {entry.name}: {f} is missing; {rebuild_hint()}")
        got = sha256_file(f)
        if got != want:
            raise ShippedModelError(
                f"shipped model {entry.name}: {f} has sha256 {got[:16]}..., the manifest says {want[:16]}... "
                f"(a changed or corrupted file); {rebuild_hint()}"
            )
    return d


def install(dest: Path, root: Path | None = None) -> Path | None:
    """Install the shipped entry named ``dest.name`` at ``dest`` (a cache entry's path), verified;
    ``dest``, or None when no shipped entry has that name (the recipe's key)."""
    entry = load_manifest(root).get(dest.name)
    if entry is None:
        return None
    src = verify(entry, root)

    def copy(tmp: Path) -> None:
        for name in sorted(entry.files, key=lambda n: n == entry.marker):  # the marker last
            shutil.copyfile(src / name, tmp / name)

    return publish_dir(dest, copy, lambda d: (d / entry.marker).is_file())
