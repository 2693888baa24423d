"""What an objective is: a per-token policy-gradient loss and the ratios logged with it.

An objective maps ``PgInputs``, per response token the current logprob ``p`` (with gradient), the
old logprob ``old`` (``pi_old``: the trainer's own logprob under the weights the step's update
starts from, no gradient; ``rollpacker.core.fidelity``), the advantage ``A`` ([B, 1] per sample or
[B, R] per token) and the response mask (1 on response tokens, 0 on padding; sequence-level
objectives use it), to ``l_pg``. An objective never sees the rollout engine's logprobs: they enter
only through the trainer's importance weight (``rollpacker.trainers.correction``), which multiplies
``l_pg`` where a correction is configured or the objective is ``behaviour_weighted`` (decoupled
PPO). The trainer adds the KL term, weights and masks the tokens, and sums
(``rollpacker.core.stream_math``). Every objective's value stays independent of how samples are
chunked, so the stream trainer's deferred update stays exact.

Invariants:
- ``loss``, ``ratio`` and ``clipped_ratio`` have the shape of ``logp``;
- ``clipped_ratio`` is ``ratio`` clamped to ``[1 - eps_low, 1 + eps_high]`` (a token is counted as
  clipped where they differ);
- with ``logp == old`` (one update on the weights that produced ``old``) every ratio is 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PgInputs:
    """What an objective reads: each tensor [B, R] padded, ``advantage`` [B, 1] or [B, R]."""

    logp: torch.Tensor  # p: current logprobs, with gradient
    old: torch.Tensor  # pi_old: the trainer's logprobs at the start of the update, no gradient
    advantage: torch.Tensor  # A
    mask: torch.Tensor  # 1 on response tokens, 0 on padding
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


PerTokenLoss = Callable[[PgInputs], PgTerms]


def clipped(x: PgInputs, ratio: torch.Tensor) -> PgTerms:
    """PPO's pessimistic clipped term ``-min(ratio * A, clip(ratio) * A)``."""
    c = x.clip(ratio)
    return PgTerms(-torch.minimum(ratio * x.advantage, c * x.advantage), ratio, c)


@dataclass(frozen=True)
class Objective:
    """A registered objective: its ``train.objective`` name and its per-token loss."""

    name: str
    per_token: PerTokenLoss
    # the trainer multiplies the loss by the importance weight pi_old / pi_rollout even with no
    # correction configured (decoupled PPO's behaviour weight)
    behaviour_weighted: bool = False
