"""The config against the model's shape (``core/model_fit.py``): one test per invariant."""

from __future__ import annotations

import json

import pytest

from rollpacker.core.config import load_config, shipped_configs
from rollpacker.core.memory import ModelShape
from rollpacker.core.model_fit import engine_tps, model_refusals, split_refusal
from rollpacker.tasks.models import model_shape

TINY = ModelShape(layers=4, hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=704, vocab=259, tied=True)
# Qwen2.5-7B's config.json (the shipped cluster config's model)
QWEN_7B = {
    "num_hidden_layers": 28,
    "hidden_size": 3584,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "intermediate_size": 18944,
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
}


def test_every_refusal_at_once_in_order() -> None:
    over = {"train.backend": "megatron", "train.megatron.tp": 3, "engine.tensor_parallel_size": 3}
    cfg = load_config("default", {**over, "engine.max_model_len": 5000})
    got = model_refusals(cfg, TINY, 4096, "tiny")
    assert [w.split(" ")[0] for w in got] == [
        "train.megatron.tp",
        "engine.tensor_parallel_size:",
        "engine.max_model_len",
    ]
    assert got[0].endswith("does not divide the model's 4 attention heads (tiny)")
    assert "exceeds the model's max_position_embeddings = 4096 (tiny)" in got[2]
    assert model_refusals(load_config("default"), TINY, 4096, "tiny") == []


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"train.megatron.tp": 3}, "tp = 3 does not divide the model's 4 attention heads"),
        ({"train.megatron.tp": 4}, "tp = 4 does not divide the model's 2 KV heads"),
        ({"train.megatron.pp": 8}, "pp = 8 is larger than the model's 4 layers"),
        ({"train.megatron.pp": 3}, "pp = 3 does not divide the model's 4 layers"),
    ],
)
def test_split_refusal_is_the_megatron_rule(overrides: dict[str, int], expected: str) -> None:
    cfg = load_config("default", {"train.backend": "megatron", **overrides})
    (got,) = model_refusals(cfg, TINY, 4096, "tiny")
    assert expected in got
    assert split_refusal(TINY, cfg.train.megatron.tp, cfg.train.megatron.pp) in got
    assert model_refusals(load_config("default", overrides), TINY, 4096, "tiny") == []  # torch backend


def test_engine_tps_and_kv_replication() -> None:
    assert engine_tps(load_config("default", {"engine.tensor_parallel_size": 2})) == (2,)
    over = {"planner.devices": 8, "planner.max_tp": 8, "planner.min_tp": 2, "planner.initial_tp": 2}
    layouts = load_config("default", over)
    assert engine_tps(layouts) == (2, 4, 8)
    gqa = ModelShape(layers=2, hidden=96, heads=12, kv_heads=3, head_dim=8, ffn=64, vocab=10)
    by_tp = {
        tp: model_refusals(load_config("default", {"engine.tensor_parallel_size": tp}), gqa, 4096, "m")
        for tp in (1, 2, 3, 4, 6, 12)
    }
    # vLLM splits the 3 KV heads at TP 3, replicates them at TP 6 and 12; TP 2 and 4 cut one
    assert [tp for tp, w in by_tp.items() if w] == [2, 4]
    assert "TP 2 neither divides the model's 3 KV heads nor is a multiple" in by_tp[2][0]


def test_no_refusal_for_the_shipped_configs(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(QWEN_7B))
    for name in shipped_configs():
        cfg = load_config(name)
        if cfg.model.model_dir:  # a path on the cluster's models volume: the 7B's config.json here
            cfg = load_config(name, {"model.model_dir": str(tmp_path)})
        for arm in cfg.arm_names:
            found = model_shape(cfg.for_arm(arm))
            assert found is not None
            assert model_refusals(cfg.for_arm(arm), *found) == [], (name, arm)
