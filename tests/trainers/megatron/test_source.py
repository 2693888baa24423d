"""What a megatron rank reads, and from where (``trainers/megatron/source.py``): its own stage's
tensors only, each once, from its node's copy of a model in the store; the copy holds only what its
pipeline stage reads (byte ranges of a single file, or the index's files of a sharded checkpoint),
is shared by the node's ranks and removed after the load; the rank is handed a URI, never a path."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from rollpacker.core.config import StoreConfig
from rollpacker.core.errors import TrainerError
from rollpacker.store import open_store
from rollpacker.store.base import ObjectStore
from rollpacker.trainers.megatron import source
from rollpacker.trainers.megatron.convert import Qwen2Layout, stage_hf_names, to_mcore
from rollpacker.trainers.megatron.source import INDEX, LazyWeights, StoreSource, scratch_root
from rollpacker.trainers.megatron.worker import RankSpec


@pytest.fixture
def stored(gqa_untied: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> StoreSource:
    """The untied model uploaded to a file store; this node's temp dir under ``tmp_path``."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "node-tmp"))
    cfg = StoreConfig(endpoint=f"file://{tmp_path / 'store'}")
    uri = open_store(cfg).upload_dir(gqa_untied, "exp/base")
    return StoreSource(cfg, uri)


def test_a_rank_reads_only_its_stage_once(stored: StoreSource, gqa_untied: Path) -> None:
    from safetensors.torch import load_file

    full = load_file(str(gqa_untied / "model.safetensors"))
    lay = Qwen2Layout.from_config(stored.read_json("config.json"))
    for pp_rank, other in ((0, "model.layers.1."), (1, "model.layers.0.")):
        reads = _same_shard(stored.fetch(), full, lay, (2, 1, 2, pp_rank))
        assert len(reads) == len(set(reads))  # each tensor read once
        assert not [n for n in reads if n.startswith(other)]  # nothing of the other stage
        assert ("lm_head.weight" in reads) == (pp_rank == 1)
        assert ("model.embed_tokens.weight" in reads) == (pp_rank == 0)
        assert len(reads) < len(full)


def _same_shard(
    model_dir: Path, full: dict[str, torch.Tensor], lay: Qwen2Layout, ranks: tuple[int, int, int, int]
) -> list[str]:
    """The shard (tp, tp_rank, pp, pp_rank) of the copy at ``model_dir`` equals a whole-model
    load's bit for bit; returns the tensors it read."""
    weights = LazyWeights(model_dir)
    try:
        got = to_mcore(weights, lay, *ranks)
    finally:
        weights.close()
    want = to_mcore(full, lay, *ranks)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    return weights.reads


def test_fetch_is_one_node_copy_removed_by_drop(stored: StoreSource) -> None:
    first = stored.fetch()
    assert first.is_relative_to(scratch_root()) and (first / "config.json").is_file()
    assert stored.fetch() == first  # the node's other ranks reuse the copy
    assert StoreSource(stored.store, stored.uri.rstrip("/")).fetch() == first  # any spelling of the URI
    stored.drop()
    assert not first.exists() and not list(scratch_root().iterdir())


def test_a_checkpoint_source_resolves_its_model(stored: StoreSource, tmp_path: Path) -> None:
    store = stored.open()
    store.put_bytes("exp/ck/model/config.json", stored.read_bytes("config.json"))
    store.put_bytes("exp/ck/trainer.json", b"{}")
    ck = StoreSource(stored.store, store.uri("exp/ck"))
    assert ck.model().uri == store.uri("exp/ck/model")
    assert stored.model() == stored  # a bare model is its own
    local = StoreSource.local(tmp_path / "store" / "exp" / "ck")
    assert local.read_json("trainer.json") == {} and local.model().exists("config.json")


def test_ranks_are_handed_no_path() -> None:
    """Everything a rank is built from crosses the process edge as data; the weights as a URI."""
    fields = {f.name: f.type for f in dataclasses.fields(RankSpec)}
    assert fields["model"] in (StoreSource, "StoreSource")
    assert not [n for n in fields if n.endswith(("_dir", "_path"))]


# -- a stage fetches only its own tensors ------------------------------------------------------------


class _Counting:
    """The store a rank opens, counting every byte it hands out (``get_bytes``, ``get_range``)."""

    def __init__(self, real: ObjectStore, counter: list[int]) -> None:
        self.real, self.counter = real, counter

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def get_bytes(self, key: str) -> bytes:
        out = self.real.get_bytes(key)
        self.counter[0] += len(out)
        return out

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        out = self.real.get_range(key, offset, length)
        self.counter[0] += len(out)
        return out

    def download_dir(self, uri: str, local_dir: Path | str) -> Path:
        raise AssertionError("a stage fetch downloads no whole directory")


@pytest.fixture
def read_bytes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    counter = [0]
    real = source.open_store
    monkeypatch.setattr(source, "open_store", lambda cfg: _Counting(real(cfg), counter))
    return counter


def _whole(model_dir: Path) -> int:
    return sum(f.stat().st_size for f in model_dir.iterdir() if f.is_file())


@pytest.mark.parametrize("fixture", ["gqa_untied", "gqa_tied"])
@pytest.mark.parametrize("pp", [1, 2])
def test_stage_hf_names_are_what_to_mcore_reads(
    fixture: str, pp: int, request: pytest.FixtureRequest
) -> None:
    model_dir: Path = request.getfixturevalue(fixture)
    lay = Qwen2Layout.from_dir(model_dir)
    for pp_rank in range(pp):
        weights = LazyWeights(model_dir)
        try:
            to_mcore(weights, lay, 2, 0, pp, pp_rank)
        finally:
            weights.close()
        assert stage_hf_names(lay, pp, pp_rank) == list(dict.fromkeys(weights.reads)), (pp, pp_rank)


@pytest.mark.parametrize("range_bytes", [source.RANGE_BYTES, 96])  # 96: every run read in pieces
def test_a_stage_fetches_byte_ranges_of_its_tensors_bit_equal_to_the_whole(
    stored: StoreSource,
    gqa_untied: Path,
    read_bytes: list[int],
    range_bytes: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Single file, pp 2: each stage reads the non-weight files, the header and its own tensors'
    bytes (fewer than the whole model), and its ranks' shards equal a whole-model load's."""
    monkeypatch.setattr(source, "RANGE_BYTES", range_bytes)
    from safetensors import safe_open
    from safetensors.torch import load_file

    full = load_file(str(gqa_untied / "model.safetensors"))
    lay = Qwen2Layout.from_dir(gqa_untied)
    header = int.from_bytes((gqa_untied / "model.safetensors").read_bytes()[:8], "little")
    others = sum(f.stat().st_size for f in gqa_untied.iterdir() if f.suffix != ".safetensors")
    for pp_rank in (0, 1):
        names = stage_hf_names(lay, 2, pp_rank)
        read_bytes[0] = 0
        copy = stored.fetch_stage(names)
        assert copy.fetched_bytes == read_bytes[0] < _whole(gqa_untied)
        assert copy.fetched_bytes == others + 8 + header + sum(full[n].nbytes for n in names)
        assert (copy.path / "config.json").is_file() and copy.path.is_relative_to(scratch_root())
        with safe_open(str(copy.path / "model.safetensors"), framework="pt") as f:
            assert sorted(f.keys()) == sorted(names)
        for tp_rank in (0, 1):
            _same_shard(copy.path, full, lay, (2, tp_rank, 2, pp_rank))
        read_bytes[0] = 0
        assert stored.fetch_stage(names) == dataclasses.replace(copy, fetched_bytes=0, files=())
        assert read_bytes[0] == 0  # the node's other ranks of the stage reuse the copy
    stored.drop()
    assert not list(scratch_root().iterdir())


def _shard(model_dir: Path, out: Path) -> Path:
    """``model_dir`` as a sharded checkpoint: embedding + layer 0, layer 1 + norm + head, and an index."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    full = load_file(str(model_dir / "model.safetensors"))
    first = {k: v for k, v in full.items() if k.startswith(("model.embed_tokens.", "model.layers.0."))}
    parts = {"model-00001-of-00002.safetensors": first}
    parts["model-00002-of-00002.safetensors"] = {k: v for k, v in full.items() if k not in first}
    for name, tensors in parts.items():
        save_file(tensors, str(out / name), metadata={"format": "pt"})
    weight_map = {k: name for name, tensors in parts.items() for k in tensors}
    (out / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_bytes((model_dir / "config.json").read_bytes())
    return out


def test_a_sharded_stage_fetches_only_the_files_the_index_names(
    gqa_untied: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, read_bytes: list[int]
) -> None:
    from safetensors.torch import load_file

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "node-tmp"))
    sharded = _shard(gqa_untied, tmp_path / "sharded")
    cfg = StoreConfig(endpoint=f"file://{tmp_path / 'store'}")
    src = StoreSource(cfg, open_store(cfg).upload_dir(sharded, "exp/sharded"))
    full = load_file(str(gqa_untied / "model.safetensors"))
    lay = Qwen2Layout.from_dir(gqa_untied)
    for pp_rank, shard in ((0, "model-00001-of-00002"), (1, "model-00002-of-00002")):
        read_bytes[0] = 0
        copy = src.fetch_stage(stage_hf_names(lay, 2, pp_rank))
        assert [Path(f).stem for f in copy.files] == [shard]
        assert sorted(p.stem for p in copy.path.glob("*.safetensors")) == [shard]
        assert copy.fetched_bytes == read_bytes[0] < _whole(sharded)
        _same_shard(copy.path, full, lay, (1, 0, 2, pp_rank))


def test_a_tensor_in_no_file_is_refused_naming_it(stored: StoreSource) -> None:
    with pytest.raises(
        TrainerError, match=r"1 tensor\(s\) a pipeline stage reads are in none.*model.layers.9"
    ):
        stored.fetch_stage(["model.norm.weight", "model.layers.9.mlp.up_proj.weight"])
    assert not [d for d in scratch_root().iterdir() if d.is_dir()]  # no partial copy left
