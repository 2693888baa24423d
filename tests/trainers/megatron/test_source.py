"""What a megatron rank reads, and from where (``trainers/megatron/source.py``): its own stage's
tensors only, each once, from its node's copy of a model in the store; the copy is shared by the
node's ranks and removed after the load; the rank is handed a URI, never a path."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import pytest
import torch

from rollpacker.core.config import StoreConfig
from rollpacker.store import open_store
from rollpacker.trainers.megatron.convert import Qwen2Layout, to_mcore
from rollpacker.trainers.megatron.source import LazyWeights, StoreSource, scratch_root
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
        weights = LazyWeights(stored.fetch())
        try:
            got = to_mcore(weights, lay, 2, 1, 2, pp_rank)
        finally:
            weights.close()
        want = to_mcore(full, lay, 2, 1, 2, pp_rank)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        assert len(weights.reads) == len(set(weights.reads))  # each tensor read once
        assert not [n for n in weights.reads if n.startswith(other)]  # nothing of the other stage
        assert ("lm_head.weight" in weights.reads) == (pp_rank == 1)
        assert ("model.embed_tokens.weight" in weights.reads) == (pp_rank == 0)
        assert len(weights.reads) < len(full)


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
