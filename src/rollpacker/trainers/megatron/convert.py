"""Hugging Face Qwen2 <-> megatron-core GPTModel weights, sharded for tensor and pipeline parallelism.

Pure torch (no megatron import): a ``Qwen2Layout`` read from ``config.json`` says the shapes, and
``to_mcore`` / ``to_hf`` map names and layouts both ways. Written here rather than taken from
mbridge (deprecated, hard-codes Transformer Engine specs and needs its own pins) or Megatron-Bridge
(Python 3.12 and CUDA-only packages): for the Qwen2 family the mapping is a page of tensor
reshapes, exact by construction (no arithmetic, only copies), and testable on this CPU.

Megatron-core's layout (local layer spec, RMSNorm, SwiGLU, RoPE):

- ``linear_qkv`` packs, per KV group ``g``: the group's ``heads / kv_heads`` query heads, then its
  key head, then its value head (rows of ``head_dim``), and its bias the same way (Qwen2 has QKV
  bias); tensor parallelism splits the packed rows into ``tp`` contiguous runs of whole groups;
- ``linear_fc1`` is ``[gate; up]``, and each TP shard holds ``[gate_r; up_r]``;
- ``linear_proj`` and ``linear_fc2`` are row-parallel (split on the input dimension);
- the embedding and output layer are vocab-parallel: the vocabulary is padded to a multiple of
  ``tp`` (``padded_vocab``) with zero rows, which ``to_hf`` drops again (the backend masks the
  padded logits to ``-inf``, so they never carry probability);
- layers are numbered per pipeline stage from 0; stage ``p`` holds global layers
  ``[p * L / pp, (p + 1) * L / pp)``; with tied embeddings the last stage holds a copy of the
  embedding as ``output_layer.weight``.

Invariants:
- ``to_hf(gather(to_mcore(hf)))`` equals ``hf`` bit for bit, for any tp and pp dividing the model
  (tests/trainers/megatron/test_convert.py);
- an unsupported architecture or feature (sliding window, rope scaling, no QKV bias) is refused by
  name by ``Qwen2Layout.from_config`` before any process starts.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rollpacker.core.errors import ConfigError
from rollpacker.core.memory import ModelShape
from rollpacker.core.model_fit import split_refusal

SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM",)


@dataclass(frozen=True)
class Qwen2Layout:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tied: bool
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], where: str = "model") -> Qwen2Layout:
        arch = list(cfg.get("architectures") or [cfg.get("model_type", "?")])
        if arch[0] not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"{where}: architecture {arch[0]!r} is not supported by the megatron backend "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)}); use train.backend: torch"
            )
        rope = dict(cfg.get("rope_parameters") or {})
        if cfg.get("rope_scaling"):
            rope.update(cfg["rope_scaling"])
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ConfigError(
                f"{where}: rope scaling {rope.get('rope_type')!r} is not supported by the converter"
            )
        if cfg.get("use_sliding_window"):
            raise ConfigError(f"{where}: sliding-window attention is not supported by the megatron backend")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ConfigError(
                f"{where}: hidden_act {cfg.get('hidden_act')!r}: only silu (SwiGLU) is supported"
            )
        shape = ModelShape.from_hf_config(cfg, where)
        return cls(
            num_layers=shape.layers,
            hidden_size=shape.hidden,
            num_heads=shape.heads,
            num_kv_heads=shape.kv_heads,
            head_dim=shape.head_dim,
            ffn_hidden_size=shape.ffn,
            vocab_size=shape.vocab,
            tied=shape.tied,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        )

    @property
    def shape(self) -> ModelShape:
        """The shapes the memory preflight needs (``core/memory.py``)."""
        return ModelShape(
            self.num_layers, self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim,
            self.ffn_hidden_size, self.vocab_size, self.tied,
        )  # fmt: skip

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Qwen2Layout:
        f = Path(model_dir) / "config.json"
        if not f.is_file():
            raise ConfigError(f"model directory {model_dir} has no config.json: pass a Hugging Face model")
        return cls.from_config(json.loads(f.read_text()), where=str(model_dir))

    def check_parallel(self, tp: int, pp: int, where: str = "train.megatron") -> None:
        """Refuse, by name, a TP/PP layout this model cannot be split into (the rule the config's
        load-time check applies too: ``core/model_fit.py``)."""
        why = split_refusal(self.shape, tp, pp, where)
        if why:
            raise ConfigError(why)

    def padded_vocab(self, tp: int) -> int:
        return -(-self.vocab_size // tp) * tp

    def stage_layers(self, pp: int, pp_rank: int) -> range:
        n = self.num_layers // pp
        return range(pp_rank * n, (pp_rank + 1) * n)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])


def _pack_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lay: Qwen2Layout) -> torch.Tensor:
    """HF q/k/v (rows = heads x head_dim) -> megatron's per-group [q..., k, v] rows."""
    g, d = lay.num_kv_heads, lay.head_dim
    rest = q.shape[1:]
    qg = q.reshape(g, (lay.num_heads // g) * d, *rest)
    return torch.cat([qg, k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1).reshape(-1, *rest)


def _unpack_qkv(qkv: torch.Tensor, lay: Qwen2Layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d = lay.num_kv_heads, lay.head_dim
    qpg = lay.num_heads // g
    rest = qkv.shape[1:]
    x = qkv.reshape(g, (qpg + 2) * d, *rest)
    q, k, v = x.split([qpg * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def stage_hf_names(lay: Qwen2Layout, pp: int, pp_rank: int) -> list[str]:
    """The Hugging Face tensors ``to_mcore`` reads for pipeline stage ``pp_rank`` of ``pp`` (what
    the stage's ranks fetch: ``StoreSource.fetch_stage``), in reading order."""
    out = ["model.embed_tokens.weight"] if pp_rank == 0 else []
    for i in lay.stage_layers(pp, pp_rank):
        h = f"model.layers.{i}."
        out += [h + "input_layernorm.weight"]
        out += [f"{h}self_attn.{p}_proj.{kind}" for kind in ("weight", "bias") for p in "qkv"]
        out += [h + n for n in ("self_attn.o_proj.weight", "post_attention_layernorm.weight")]
        out += [h + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
    if pp_rank == pp - 1:
        out += ["model.norm.weight", "model.embed_tokens.weight" if lay.tied else "lm_head.weight"]
    return list(dict.fromkeys(out))


def to_mcore(
    hf: Mapping[str, torch.Tensor], lay: Qwen2Layout, tp: int, tp_rank: int, pp: int, pp_rank: int
) -> dict[str, torch.Tensor]:
    """The megatron state dict of rank (tp_rank, pp_rank) from a full HF state dict."""

    def shard(t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.chunk(tp, dim=dim)[tp_rank].clone()

    out: dict[str, torch.Tensor] = {}
    vocab = lay.padded_vocab(tp)
    if pp_rank == 0:
        out["embedding.word_embeddings.weight"] = shard(_pad_rows(hf["model.embed_tokens.weight"], vocab), 0)
    for local, i in enumerate(lay.stage_layers(pp, pp_rank)):
        h, m = f"model.layers.{i}.", f"decoder.layers.{local}."
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"].clone()
        for kind in ("weight", "bias"):
            qkv = _pack_qkv(*(hf[f"{h}self_attn.{p}_proj.{kind}"] for p in "qkv"), lay)
            out[f"{m}self_attention.linear_qkv.{kind}"] = shard(qkv, 0)
        out[m + "self_attention.linear_proj.weight"] = shard(hf[h + "self_attn.o_proj.weight"], 1)
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"].clone()
        gate, up = hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat([shard(gate, 0), shard(up, 0)])
        out[m + "mlp.linear_fc2.weight"] = shard(hf[h + "mlp.down_proj.weight"], 1)
    if pp_rank == pp - 1:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
        head = hf["model.embed_tokens.weight"] if lay.tied else hf["lm_head.weight"]
        if not (lay.tied and pp == 1):  # tied at pp = 1: the output layer reads the embedding
            out["output_layer.weight"] = shard(_pad_rows(head, vocab), 0)
    return out


_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_ROW_PARALLEL = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")


def gather_tp(shards: list[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One stage's TP shards (in tp-rank order) -> that stage's full (unsharded) megatron tensors."""
    tp = len(shards)
    out: dict[str, torch.Tensor] = {}
    for name, first in shards[0].items():
        parts = [s[name] for s in shards]
        if name.endswith("layernorm.weight") or tp == 1:
            out[name] = first
        elif name.endswith("mlp.linear_fc1.weight"):
            halves = [p.chunk(2, dim=0) for p in parts]
            out[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        elif name.endswith(_ROW_PARALLEL):
            out[name] = torch.cat(parts, dim=1)
        else:
            out[name] = torch.cat(parts, dim=0)
    return out


def to_hf(
    full: Mapping[str, torch.Tensor], lay: Qwen2Layout, pp: int, pp_rank: int
) -> dict[str, torch.Tensor]:
    """One stage's full megatron tensors -> HF names and layouts (its layers; embedding on the first
    stage; final norm and ``lm_head`` on the last, ``lm_head`` included when tied, as vLLM needs)."""
    out: dict[str, torch.Tensor] = {}
    first = lay.stage_layers(pp, pp_rank).start
    v = lay.vocab_size
    for name, t in full.items():
        m = _LAYER.fullmatch(name)
        if m is None:
            if name == "embedding.word_embeddings.weight":
                out["model.embed_tokens.weight"] = t[:v]
                if lay.tied and pp == 1:
                    out["lm_head.weight"] = t[:v]
            elif name == "output_layer.weight":
                out["lm_head.weight"] = t[:v]
            elif name == "decoder.final_layernorm.weight":
                out["model.norm.weight"] = t
            continue
        h = f"model.layers.{first + int(m.group(1))}."
        rest = m.group(2)
        if rest == "input_layernorm.weight":
            out[h + rest] = t
        elif rest == "pre_mlp_layernorm.weight":
            out[h + "post_attention_layernorm.weight"] = t
        elif rest.startswith("self_attention.linear_qkv."):
            kind = rest.rsplit(".", 1)[1]
            for p, x in zip("qkv", _unpack_qkv(t, lay), strict=True):
                out[f"{h}self_attn.{p}_proj.{kind}"] = x
        elif rest == "self_attention.linear_proj.weight":
            out[h + "self_attn.o_proj.weight"] = t
        elif rest == "mlp.linear_fc1.weight":
            gate, up = t.chunk(2, dim=0)
            out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate, up
        elif rest == "mlp.linear_fc2.weight":
            out[h + "mlp.down_proj.weight"] = t
    return out
