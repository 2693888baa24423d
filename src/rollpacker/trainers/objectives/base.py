"""What an objective is: a per-token policy-gradient loss and the ratios logged with it.

An objective maps, per response token, the current logprob ``p`` (with gradient), the behaviour
logprob ``b`` the rollout engine sampled with, the proximal logprob ``q`` (no gradient; only for
objectives that declare ``needs_proximal``) and the sample's advantage ``A`` to ``l_pg``. The trainer
adds the KL term, weights and masks the tokens, and sums (``rollpacker.core.stream_math``).

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
class PgTerms:
    """An objective's per-token terms, each shaped like ``logp`` ([B, R], padded)."""

    loss: torch.Tensor  # l_pg
    ratio: torch.Tensor  # the ratio that is clipped (logged as train/ratio_mean)
    clipped_ratio: torch.Tensor  # ratio clamped to [1 - eps_low, 1 + eps_high] (train/clip_frac)
    behav_weight: torch.Tensor  # pi_prox / pi_behav (1 where the objective has none; train/behav_weight)


# (logp, behaviour, proximal or None, advantage [B, 1], eps_low, eps_high) -> PgTerms
PerTokenLoss = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, float, float], PgTerms
]


@dataclass(frozen=True)
class Objective:
    """A registered objective: its ``train.objective`` name and its per-token loss."""

    name: str
    per_token: PerTokenLoss
    needs_proximal: bool = False  # the trainer passes q (else None)
