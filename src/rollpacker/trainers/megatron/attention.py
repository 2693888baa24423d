"""Core attention for megatron-core's local layer spec through torch's
``scaled_dot_product_attention`` (``train.megatron.attention: sdpa``).

megatron-core's local spec computes attention unfused (``DotProductAttention``): the
``[heads / tp, seq, seq]`` scores and probabilities are materialized per layer, and a scores buffer
of that size is kept for the whole run, so memory grows with the square of the sequence length
(docs/megatron.md, "Memory"). Without Transformer Engine there is no fused alternative in
megatron-core 0.16.1. ``SdpaAttention`` has the same constructor and ``forward`` as
``DotProductAttention`` and calls torch's fused kernel (flash or memory-efficient attention on
CUDA, the flash kernel on CPU), which keeps only its inputs, the output and one log-sum-exp per
query: linear in the sequence length.

Causal only: the backend's batches are right-padded, so a causal mask is the attention mask (the
explicit mask the backend passes is not read). Grouped-query attention repeats each KV head over
its query heads first (as ``DotProductAttention`` does), so any kernel accepts it.

Invariants:
- the same outputs as ``DotProductAttention`` (dropout 0, causal, right padding) up to the
  kernels' float rounding: the gang's gradients and logprobs with ``sdpa`` match the torch
  backend's within the exactness bounds (tests/trainers/megatron/test_activation_memory.py);
- no ``[seq, seq]`` tensor is kept for backward.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from megatron.core.transformer.module import MegatronModule


class SdpaAttention(MegatronModule):  # type: ignore[misc]
    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config=config)
        from megatron.core import parallel_state as ps

        tp = ps.get_tensor_model_parallel_world_size()
        self.heads = config.num_attention_heads // tp
        self.groups = (config.num_query_groups or config.num_attention_heads) // tp
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError("SdpaAttention: attention dropout is not supported (the backend trains with 0)")
        self.scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        """``[s, b, heads, d]`` query, ``[s, b, groups, d]`` key and value -> ``[s, b, heads * d]``."""
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("SdpaAttention: no attention bias or packed sequences")
        s, b = query.shape[0], query.shape[1]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, n, s, d]
        if self.heads != self.groups:
            k = k.repeat_interleave(self.heads // self.groups, dim=1)
            v = v.repeat_interleave(self.heads // self.groups, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)
