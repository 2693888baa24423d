"""What an objective is: a per-token policy-gradient loss and the ratios logged with it.

An objective maps ``PgInputs``, per response token the current logprob ``p`` (with gradient), the
behaviour logprob ``b`` the rollout engine sampled with, the proximal logprob ``q`` (no gradient;
only for objectives that declare ``needs_proximal``), the advantage ``A`` ([B, 1] per sample or
[B, R] per token) and the response mask (1 on response tokens, 0 on padding; sequence-level
objectives use it), to ``l_pg``. The trainer adds the KL term, weights and masks the tokens, and sums
(``rollpacker.core.stream_math``). Every objective's value stays independent of how samples are
chunked, so the stream trainer's deferred update stays exact.

Invariants:
- ``loss``, ``ratio``, ``clipped_ratio`` and ``behav_weight`` have the shape of ``logp``;
- ``clipped_ratio`` is ``ratio`` clamped to ``[1 - eps_low, 1 + eps_high]`` (a token is counted as
  clipped where they differ);
- only ``loss`` carries gradient from ``logp``'s graph into the update; ``behav_weight`` has none.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PgInputs:
    """What an objective reads: each tensor [B, R] padded, ``advantage`` [B, 1] or [B, R]."""

    logp: torch.Tensor  # p: current logprobs, with gradient
    behaviour: torch.Tensor  # b: the rollout engine's logprobs
    advantage: torch.Tensor  # A
    mask: torch.Tensor  # 1 on response tokens, 0 on padding
    proximal: torch.Tensor | None = None  # q: no gradient; only for ``needs_proximal``
    eps_low: float = 0.2
    eps_high: float = 0.28

    def clip(self, ratio: torch.Tensor) -> torch.Tensor:
        """``ratio`` clamped to ``[1 - eps_low, 1 + eps_high]``."""
        return ratio.clamp(1 - self.eps_low, 1 + self.eps_high)


@dataclass(frozen=True)
class PgTerms:
    """An objective's per-token terms, each shaped like ``logp`` ([B, R], padded)."""

    loss: torch.Tensor  # l_pg
    ratio: torch.Tensor  # the ratio that is clipped (logged as train/ratio_mean)
    clipped_ratio: torch.Tensor  # ratio clamped to [1 - eps_low, 1 + eps_high] (train/clip_frac)
    behav_weight: torch.Tensor  # pi_prox / pi_behav (1 where the objective has none; train/behav_weight)


PerTokenLoss = Callable[[PgInputs], PgTerms]


def clipped(x: PgInputs, ratio: torch.Tensor, unclipped: torch.Tensor | None = None) -> PgTerms:
    """PPO's pessimistic clipped term ``-min(u * A, clip(ratio) * A)`` with ``u = ratio`` unless
    ``unclipped`` is given, and no behaviour weight."""
    c = x.clip(ratio)
    u = ratio if unclipped is None else unclipped
    return PgTerms(-torch.minimum(u * x.advantage, c * x.advantage), ratio, c, torch.ones_like(x.logp))


@dataclass(frozen=True)
class Objective:
    """A registered objective: its ``train.objective`` name and its per-token loss."""

    name: str
    per_token: PerTokenLoss
    needs_proximal: bool = False  # the trainer passes q (else None)
