"""Per-rank memory of a megatron-core training plan, estimated before any process starts.

The gang (``trainers/megatron/gang.py``) and ``rollpacker submit`` call ``check_fits`` with the
model's shape (its ``config.json``), the layout (TP, PP, DP, distributed optimizer), the dtype,
the activation recompute mode, the longest sequence (``engine.max_model_len``: prompt + response)
and ``train.tokens_per_micro_batch``; a plan whose worst rank exceeds ``train.megatron.gpu_memory_gib``
is refused with every term in GiB and what to change (docs/megatron.md, "Memory").

Per rank, for the worst pipeline stage (the first holds ``pp`` micro-batches in flight under 1F1B,
the last the output layer and the loss):

- weights ``e * P`` (``e`` = 2 bytes in bf16, 4 in fp32; ``P`` the rank's parameters), gradients
  ``4 * P`` (fp32 buffers), optimizer ``(4 if bf16 else 0) + 8`` bytes per parameter for Adam
  (fp32 master copy and two moments), divided by DP with the distributed optimizer;
- saved activations per token of a micro-batch (``N = max(tokens_per_micro_batch, S)`` padded
  tokens, ``S`` the longest sequence), per layer, with megatron's local layer spec (unfused
  attention, torch RMSNorm; an upper bound within 5 % of the bytes measured on CPU by
  ``tests/trainers/megatron/test_activation_memory.py``):
  ``2 (h (8 + e) + 4) + 4 d e + A e / t + 5 f e / t`` bytes, ``A = 4 a d`` (``none``)
  or ``(3 a + 3 k) d`` (``selective``), and ``h e`` with ``full`` recompute; ``none`` also keeps
  the attention probabilities, ``(a / t) * N * S * (4 if fp32 else 6)`` bytes per layer (quadratic
  in the sequence length: this is what ``selective`` and ``full`` remove); the last stage adds the
  final norm and the logits, ``8 V / t`` bytes per token;
- transient peaks in backward (derived, not measured): one layer's attention backward
  ``(a / t) N S (p + 12)`` bytes (probabilities, their gradient and the softmax backward's two
  temporaries; with ``none`` the probabilities are already counted), one layer's recomputed
  activations with ``full``, or the logits' gradient ``(4 + e) V / t`` per token, whichever is
  larger, plus the unfused attention's persistent scores buffer ``(a / t) N S e``; plus
  ``RESERVE_GIB`` for the CUDA context, NCCL buffers and allocator fragmentation.

Invariants:
- pure arithmetic on integers and floats (no torch): the same numbers on any machine;
- an estimate never decreases when the sequence, the micro-batch, the model or the layers per
  rank grow, nor when recompute is switched off;
- ``check_fits`` refuses by raising ``ConfigError`` naming the total, the limit and each term.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from rollpacker.core.config import ATTENTION_KINDS, RECOMPUTE_MODES, ExperimentConfig, MegatronConfig
from rollpacker.core.errors import ConfigError

GIB = 2**30
RESERVE_GIB = 4.0  # CUDA context, NCCL buffers, allocator fragmentation (an assumption, not measured)
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class ModelShape:
    """The shapes of a Qwen2-family decoder, from its Hugging Face ``config.json``."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool = False

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"model shape: {name} = {v!r}: must be a positive integer")

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any], where: str = "config.json") -> ModelShape:
        try:
            heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
            return cls(
                layers=int(cfg["num_hidden_layers"]),
                hidden=hidden,
                heads=heads,
                kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                ffn=int(cfg["intermediate_size"]),
                vocab=int(cfg["vocab_size"]),
                tied=bool(cfg.get("tie_word_embeddings", False)),
            )
        except KeyError as e:
            raise ConfigError(
                f"{where}: no {e.args[0]!r}; the memory preflight needs the model's shape"
            ) from e

    def layer_params(self) -> int:
        """One decoder layer: QKV (with bias), output projection, SwiGLU MLP, two norms."""
        qkv = (self.heads + 2 * self.kv_heads) * self.head_dim
        proj = self.heads * self.head_dim * self.hidden
        return self.hidden * qkv + qkv + proj + 3 * self.hidden * self.ffn + 2 * self.hidden

    def params(self) -> int:
        emb = self.vocab * self.hidden
        return self.layers * self.layer_params() + emb * (1 if self.tied else 2) + self.hidden


@dataclass(frozen=True)
class MemoryPlan:
    """What a rank's memory depends on besides the model."""

    tp: int
    pp: int
    dp: int
    dtype: str  # float32 | bfloat16
    recompute: str  # none | selective | full
    longest_tokens: int  # the longest sequence a micro-batch holds: prompt + response
    tokens_per_micro_batch: int
    distributed_optimizer: bool = True
    optimizer: str = "adam"
    gpu_memory_gib: float = 80.0
    attention: str = "unfused"  # unfused (megatron's DotProductAttention) | sdpa (torch's fused kernel)

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "longest_tokens", "tokens_per_micro_batch"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"memory plan: {name} = {v!r}: must be a positive integer")
        if self.dtype not in _DTYPE_BYTES:
            raise ConfigError(f"memory plan: dtype = {self.dtype!r}: use one of {', '.join(_DTYPE_BYTES)}")
        if self.recompute not in RECOMPUTE_MODES:
            raise ConfigError(f"memory plan: recompute = {self.recompute!r}: use one of {RECOMPUTE_MODES}")
        if self.attention not in ATTENTION_KINDS:
            raise ConfigError(f"memory plan: attention = {self.attention!r}: use one of {ATTENTION_KINDS}")

    @classmethod
    def of(cls, m: MegatronConfig, longest_tokens: int, tokens_per_micro_batch: int) -> MemoryPlan:
        return cls(
            tp=m.tp,
            pp=m.pp,
            dp=m.data_parallel,
            dtype=m.dtype,
            recompute=m.recompute,
            longest_tokens=longest_tokens,
            tokens_per_micro_batch=tokens_per_micro_batch,
            distributed_optimizer=m.distributed_optimizer,
            optimizer=m.optimizer,
            gpu_memory_gib=m.gpu_memory_gib,
            attention=m.attention,
        )

    @property
    def elem(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    @property
    def micro_batch_tokens(self) -> int:
        """Padded tokens of the largest micro-batch (a longer sequence gets one of its own)."""
        return max(self.tokens_per_micro_batch, self.longest_tokens)


@dataclass(frozen=True)
class MemoryEstimate:
    """One rank's memory in bytes (the worst pipeline stage)."""

    stage: int
    weights: int
    grads: int
    optimizer: int
    activations: int
    transient: int
    reserve: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations + self.transient + self.reserve

    def render(self) -> str:
        parts = ("weights", "grads", "optimizer", "activations", "transient", "reserve")
        terms = ", ".join(f"{p} {getattr(self, p) / GIB:.1f}" for p in parts)
        return f"{self.total / GIB:.1f} GiB on pipeline stage {self.stage} ({terms} GiB)"


def training_plan(cfg: ExperimentConfig) -> MemoryPlan | None:
    """The memory plan of an experiment's training gang on GPUs (the longest sequence is
    ``engine.max_model_len``: prompt + response); ``None`` for the torch backend or CPU ranks."""
    t = cfg.train
    if t.backend != "megatron" or t.megatron.gpus_per_rank <= 0:
        return None
    return MemoryPlan.of(t.megatron, cfg.engine.max_model_len, t.tokens_per_micro_batch)


def layer_activation_bytes(shape: ModelShape, plan: MemoryPlan, tokens: int, longest: int) -> int:
    """Bytes one layer keeps for backward over a micro-batch of ``tokens`` padded tokens whose
    longest sequence is ``longest`` (so at most ``tokens * longest`` attention scores per head)."""
    e, t, s = plan.elem, plan.tp, shape
    if plan.recompute == "full":
        return tokens * s.hidden * e
    if plan.recompute == "selective":  # the checkpoint's q, k, the packed qkv output, the context
        attn = 3 * (s.heads + s.kv_heads) * s.head_dim * e
    elif plan.attention == "sdpa":  # q, k and v repeated over the heads, output, its copy, log-sum-exp
        attn = 5 * s.heads * s.head_dim * e + 4 * s.heads
    else:  # q, k and v repeated over the heads, the context
        attn = 4 * s.heads * s.head_dim * e
    per_token = 2 * (s.hidden * (8 + e) + 4) + 4 * s.head_dim * e + (attn + 5 * s.ffn * e) // t
    unfused = plan.recompute == "none" and plan.attention == "unfused"
    quadratic = _probs_bytes(shape, plan, tokens, longest) if unfused else 0
    return tokens * per_token + quadratic


def _probs_bytes(shape: ModelShape, plan: MemoryPlan, tokens: int, longest: int) -> int:
    """Attention probabilities of one layer: fp32 (softmax in fp32), plus a bf16 copy in bf16."""
    return shape.heads // plan.tp * tokens * longest * (4 if plan.elem == 4 else 6)


def head_activation_bytes(shape: ModelShape, plan: MemoryPlan, tokens: int) -> int:
    """The last stage's final norm, logits (fp32) and loss, per micro-batch."""
    vocab = -(-shape.vocab // plan.tp)
    return tokens * (shape.hidden * (8 + plan.elem) + 4 + 8 * vocab + 40)


def activation_bytes(shape: ModelShape, plan: MemoryPlan, tokens: int, longest: int, stage: int = 0) -> int:
    """Saved activations of one micro-batch on ``stage`` (its layers, and the head on the last
    stage); ``full`` recompute also keeps the rotary table once."""
    layers = shape.layers // plan.pp
    out = layers * layer_activation_bytes(shape, plan, tokens, longest) + 8 * tokens
    if plan.recompute == "full":
        out += 4 * shape.head_dim * tokens
    if stage == plan.pp - 1:
        out += head_activation_bytes(shape, plan, tokens)
    return out


def _transient_bytes(shape: ModelShape, plan: MemoryPlan, stage: int) -> int:
    """The largest short-lived allocation of a backward pass: one layer's attention backward (the
    probabilities' gradient and the softmax backward's two temporaries, fp32; the probabilities
    themselves when recomputed, the whole layer with ``full``), or the logits' gradient; plus the
    ``[heads / tp, N, S]`` scores buffer megatron's unfused attention keeps for the whole run
    (``get_global_memory_buffer``, the dtype's bytes)."""
    n, s = plan.micro_batch_tokens, plan.longest_tokens
    heads = shape.heads // plan.tp
    if plan.attention == "sdpa":  # the fused backward's q, k, v and output gradients
        scores_buffer, attn = 0, n * 4 * heads * shape.head_dim * plan.elem
    else:
        scores_buffer, attn = heads * n * s * plan.elem, heads * n * s * 12
        if plan.recompute == "selective":
            attn += _probs_bytes(shape, plan, n, s)
    if plan.recompute == "full":
        attn += layer_activation_bytes(shape, replace(plan, recompute="none"), n, s)
    logits = n * (4 + plan.elem) * -(-shape.vocab // plan.tp) if stage == plan.pp - 1 else 0
    return max(attn, logits) + scores_buffer


def stage_params(shape: ModelShape, plan: MemoryPlan, stage: int) -> int:
    """Parameters one rank of ``stage`` holds (TP-sharded; the embedding on the first stage, the
    output layer on the last: a tied head is a copy there when ``pp > 1``)."""
    emb = -(-shape.vocab // plan.tp) * shape.hidden
    out = shape.layers // plan.pp * shape.layer_params() // plan.tp
    if stage == 0:
        out += emb
    if stage == plan.pp - 1:
        out += shape.hidden + (0 if shape.tied and plan.pp == 1 else emb)
    return out


def estimate_stage(shape: ModelShape, plan: MemoryPlan, stage: int) -> MemoryEstimate:
    p = stage_params(shape, plan, stage)
    state = (4 if plan.elem == 2 else 0) + (8 if plan.optimizer == "adam" else 0)
    shard = plan.dp if plan.distributed_optimizer else 1
    in_flight = plan.pp - stage  # 1F1B: stage i runs pp - i forwards before its first backward
    acts = in_flight * activation_bytes(shape, plan, plan.micro_batch_tokens, plan.longest_tokens, stage)
    return MemoryEstimate(
        stage=stage,
        weights=plan.elem * p,
        grads=4 * p,
        optimizer=-(-state * p // shard),
        activations=acts,
        transient=_transient_bytes(shape, plan, stage),
        reserve=int(RESERVE_GIB * GIB),
    )


def estimate(shape: ModelShape, plan: MemoryPlan) -> MemoryEstimate:
    """The worst rank: the first stage (most micro-batches in flight) or the last (the head)."""
    stages = {0, plan.pp - 1}
    return max((estimate_stage(shape, plan, st) for st in sorted(stages)), key=lambda m: m.total)


def check_fits(shape: ModelShape, plan: MemoryPlan, where: str = "train.megatron") -> MemoryEstimate:
    """The estimate, or ``ConfigError`` naming each term and what to change when it exceeds
    ``plan.gpu_memory_gib``."""
    est = estimate(shape, plan)
    if est.total <= plan.gpu_memory_gib * GIB:
        return est
    hints = []
    if plan.recompute != "full":
        hints.append(f"{where}.recompute: {'selective or full' if plan.recompute == 'none' else 'full'}")
    if plan.dtype == "float32":
        hints.append(f"{where}.dtype: bfloat16")
    hints.append(
        f"a larger {where}.tp or pp, or a shorter train.tokens_per_micro_batch / engine.max_model_len"
    )
    raise ConfigError(
        f"{where}: the training plan needs {est.render()} per GPU, more than gpu_memory_gib = "
        f"{plan.gpu_memory_gib:g} (tp {plan.tp} x pp {plan.pp} x dp {plan.dp}, {plan.dtype}, recompute "
        f"{plan.recompute}, longest sequence {plan.longest_tokens} tokens, micro-batch "
        f'{plan.micro_batch_tokens} tokens); try {"; ".join(hints)} (docs/megatron.md, "Memory")'
    )
