"""HF <-> megatron-core conversion for Qwen2: bit-exact round trips at every TP x PP split, and
refusals by name of what the backend cannot run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rollpacker.core.errors import ConfigError
from rollpacker.trainers.megatron.convert import Qwen2Layout, _pack_qkv, gather_tp, to_hf, to_mcore


def _read_hf(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return dict(load_file(str(model_dir / "model.safetensors")))


def _round_trip(hf: dict[str, torch.Tensor], lay: Qwen2Layout, tp: int, pp: int) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for p in range(pp):
        shards = [to_mcore(hf, lay, tp, r, pp, p) for r in range(tp)]
        out.update(to_hf(gather_tp(shards), lay, pp, p))
    return out


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_round_trip_is_bit_exact(gqa_tied: Path, gqa_untied: Path, tied: bool, tp: int, pp: int) -> None:
    model_dir = gqa_tied if tied else gqa_untied
    hf = _read_hf(model_dir)
    lay = Qwen2Layout.from_dir(model_dir)
    assert lay.tied is tied and lay.num_kv_heads == 2 and lay.vocab_size == 63
    back = _round_trip(hf, lay, tp, pp)
    want = dict(hf)
    if tied:  # the export carries lm_head too (vLLM on CPU keeps its own copy of the head)
        assert "lm_head.weight" not in want
        want["lm_head.weight"] = hf["model.embed_tokens.weight"]
    assert sorted(back) == sorted(want)
    for name, t in want.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


def test_shards_have_megatron_shapes(gqa_untied: Path) -> None:
    hf = _read_hf(gqa_untied)
    lay = Qwen2Layout.from_dir(gqa_untied)
    sd = to_mcore(hf, lay, tp=2, tp_rank=1, pp=2, pp_rank=1)
    # stage 1 holds global layer 1 as its local layer 0, the final norm and the (padded) head
    assert "decoder.layers.1.input_layernorm.weight" not in sd
    assert torch.equal(
        sd["decoder.layers.0.input_layernorm.weight"], hf["model.layers.1.input_layernorm.weight"]
    )
    assert sd["output_layer.weight"].shape == (32, 32)  # 63 -> 64 rows, half per rank
    assert torch.count_nonzero(sd["output_layer.weight"][-1]) == 0  # the padded row
    # one KV group per rank: 2 query heads + k + v, 8 rows each
    assert sd["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (32, 32)
    assert sd["decoder.layers.0.mlp.linear_fc1.weight"].shape == (48, 32)  # [gate_r; up_r]
    assert sd["decoder.layers.0.self_attention.linear_proj.weight"].shape == (32, 16)


def test_qkv_packing_groups_queries_with_their_kv_head() -> None:
    lay = Qwen2Layout(2, 4, 4, 2, 1, 4, 8, True, 1e-6, 1e4, 16)
    q = torch.arange(4.0)[:, None]  # heads 0..3, head_dim 1
    k = torch.tensor([[10.0], [11.0]])
    v = torch.tensor([[20.0], [21.0]])
    assert _pack_qkv(q, k, v, lay).flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]


def _config(model_dir: Path, **changes: object) -> dict[str, object]:
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(changes)
    return cfg


def test_refusals_by_name(gqa_tied: Path) -> None:
    lay = Qwen2Layout.from_dir(gqa_tied)
    with pytest.raises(ConfigError, match=r"tp = 3 does not divide the model's 4 attention heads"):
        lay.check_parallel(3, 1)
    with pytest.raises(ConfigError, match=r"tp = 4 does not divide the model's 2 KV heads"):
        lay.check_parallel(4, 1)
    with pytest.raises(ConfigError, match=r"pp = 3 is larger than the model's 2 layers"):
        lay.check_parallel(1, 3)
    lay.check_parallel(2, 2)
    with pytest.raises(ConfigError, match=r"architecture 'LlamaForCausalLM' is not supported"):
        Qwen2Layout.from_config(_config(gqa_tied, architectures=["LlamaForCausalLM"]))
    with pytest.raises(ConfigError, match=r"sliding-window"):
        Qwen2Layout.from_config(_config(gqa_tied, use_sliding_window=True))
    with pytest.raises(ConfigError, match=r"rope scaling 'yarn'"):
        Qwen2Layout.from_config(_config(gqa_tied, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}))
