"""Sample-weighted loss normalization: why a streamed gradient equals the monolithic one.

A policy-gradient loss over a batch ``B`` is ``L = (1/D(B)) * sum_{i in B} sum_t w_i * l_{i,t}``:

- ``token-mean``: ``w_i = 1``, ``D(B)`` = number of response tokens in ``B``;
- ``seq-mean`` (seq-mean-token-mean): ``w_i = 1 / |y_i|``, ``D(B)`` = number of responses;
- ``constant`` (Dr. GRPO's normaliser, "Understanding R1-Zero-Like Training: A Critical
  Perspective", arXiv:2503.20783): ``w_i = 1``, ``D(B)`` = the generation budget ``L`` (tokens a
  response may have) times the number of responses: a constant for a fixed batch shape, so the
  loss's scale does not move with the batch's response lengths.

The stream trainer receives ``B`` in chunks, in any order, while rollout runs. It accumulates the
gradient of the *unnormalized* sum ``S_c = sum_{i in c} sum_t w_i l_{i,t}`` of each chunk ``c``
and, once rollout ends and ``D(B)`` is known, scales the sum of gradients by ``1/D(B)`` — the
paper's ``n_i / N`` (a replica's local mean times its count over the global count). Because
``sum_c S_c = D(B) * L``, the update is the monolithic one up to float summation order. Averaging
per-chunk means instead (``mean_c (S_c / D(c))``) is biased whenever chunks differ in size.

Invariants:
- ``sum(token_weights) / denominator == 1`` over a batch (the stream weights sum to 1) under
  token-mean and seq-mean; ``<= 1`` under constant (``== 1`` only when every response uses the
  whole budget), and a response longer than the budget is refused;
- the weights of a sample depend only on the sample, never on the chunk it arrives in.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable


class LossNorm(enum.Enum):
    TOKEN_MEAN = "token_mean"
    SEQ_MEAN = "seq_mean"
    CONSTANT = "constant"


def token_weight(norm: LossNorm, num_tokens: int) -> float:
    """The weight ``w_i`` of each token of a response with ``num_tokens`` tokens."""
    if num_tokens < 1:
        raise ValueError("a response needs >= 1 token")
    return 1.0 / num_tokens if norm is LossNorm.SEQ_MEAN else 1.0


def denominator(norm: LossNorm, response_lengths: Iterable[int], budget_tokens: int = 0) -> int:
    """``D(B)``: response tokens (token-mean), responses (seq-mean), or ``budget_tokens`` times
    the responses (constant) in the whole batch."""
    lens = list(response_lengths)
    if not lens:
        raise ValueError("an empty batch has no loss denominator")
    if norm is LossNorm.CONSTANT:
        if budget_tokens < 1:
            raise ValueError(
                f"loss_norm constant with a generation budget of {budget_tokens} tokens: pass the budget "
                "(train.loss_budget_tokens, by default rollout.max_tokens)"
            )
        if max(lens) > budget_tokens:
            raise ValueError(
                f"a response of {max(lens)} tokens is longer than the constant normaliser's budget of "
                f"{budget_tokens} tokens: set train.loss_budget_tokens >= rollout.max_tokens"
            )
        return budget_tokens * len(lens)
    return sum(lens) if norm is LossNorm.TOKEN_MEAN else len(lens)
