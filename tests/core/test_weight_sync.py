"""The collective weight push's messages (``core/weight_sync.py``): strict, exact round trips."""

from __future__ import annotations

import pytest

from rollpacker.core.errors import ConfigError
from rollpacker.core.serde import MessageError
from rollpacker.core.weight_sync import BucketHeader, TensorSpec, TransferGroup


def test_a_header_round_trips_and_a_malformed_one_is_refused_by_field() -> None:
    h = BucketHeader(
        3, (TensorSpec("a.weight", "bfloat16", (4, 8)), TensorSpec("b", "float32", (5,))), (7, 9)
    )
    assert BucketHeader.from_json(h.to_json()) == h
    assert h.bucket_bytes == 4 * 8 * 2 + 5 * 4
    with pytest.raises(MessageError, match=r"unknown field\(s\) \[.tensor.\]"):
        BucketHeader.from_json(h.to_json().replace('"tensors"', '"tensor"'))
    with pytest.raises(ConfigError, match="closing header"):
        BucketHeader(4, h.tensors, (0, 0), end=True)
    with pytest.raises(ConfigError, match="complex64"):
        TensorSpec("c", "complex64", (1,))


def test_a_transfer_group_needs_a_sender_and_a_worker() -> None:
    g = TransferGroup("10.0.0.1", 29500, 3, 1, "nccl")
    assert TransferGroup.from_json(g.to_json()) == g
    assert g.senders == 1 and g.workers == 2 and g.with_offset(2).rank_offset == 2
    bad_ones = ({"rank_offset": 0}, {"rank_offset": 3}, {"backend": "mpi"}, {"port": 0}, {"senders": 2})
    for bad in bad_ones:
        with pytest.raises(ConfigError):
            TransferGroup(**{**g.__dict__, **bad})


def test_train_weight_sync_names_the_paths_and_takes_a_pipelined_gang() -> None:
    from rollpacker.core.config import TrainerConfig

    assert TrainerConfig().weight_sync == "object_store"  # the fallback is the default
    assert TrainerConfig(weight_sync="collective").weight_sync == "collective"
    with pytest.raises(ConfigError, match=r"train.weight_sync = 'nccl'.*object_store, collective"):
        TrainerConfig(weight_sync="nccl")
    from rollpacker.core.config import MegatronConfig

    TrainerConfig(weight_sync="collective", backend="megatron", megatron=MegatronConfig(tp=2, dp=2))
    # one sender per pipeline stage (tests/trainers/megatron/test_weight_push.py)
    cfg = TrainerConfig(weight_sync="collective", backend="megatron", megatron=MegatronConfig(pp=2))
    assert cfg.megatron.pp == 2


def test_the_collective_push_is_taken_with_engines_in_layouts_and_by_the_cluster_config() -> None:
    from pathlib import Path

    import rollpacker
    from rollpacker.core.config import config_from_text

    text = "experiment: t\ntrain: {weight_sync: collective}\n"
    assert config_from_text(text).train.weight_sync == "collective"
    cfg = config_from_text(text + "planner: {devices: 2, max_tp: 2}\n")
    assert cfg.planner.devices == 2 and cfg.train.weight_sync == "collective"
    # the shipped cluster config pushes by collective to its layouts (planner.devices 8), pipelined too
    cluster = (Path(rollpacker.__file__).parent / "configs" / "cluster.yaml").read_text()
    pipelined = cluster.replace("    tp: 2\n    pp: 1\n", "    tp: 1\n    pp: 2\n")
    for doc, pp in ((cluster, 1), (pipelined, 2)):
        got = config_from_text(doc)
        assert (got.train.weight_sync, got.planner.devices, got.train.megatron.pp) == ("collective", 8, pp)
