"""PPO-clip against the behaviour policy (``train.objective: ppo``; GRPO's loss).

Per response token (advantage ``A``, behaviour logprob ``b``, current logprob ``p``):

    ratio = exp(p - b)
    l_pg  = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)

There is no proximal policy: the behaviour weight is 1.
"""

from __future__ import annotations

import torch

from rollpacker.trainers.objectives.base import Objective, PgTerms


def per_token(
    logp: torch.Tensor,
    behaviour: torch.Tensor,
    proximal: torch.Tensor | None,
    advantage: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> PgTerms:
    ratio = torch.exp(logp - behaviour)
    clipped_ratio = ratio.clamp(1 - eps_low, 1 + eps_high)
    loss = -torch.minimum(ratio * advantage, clipped_ratio * advantage)
    return PgTerms(loss, ratio, clipped_ratio, torch.ones_like(logp))


OBJECTIVE = Objective("ppo", per_token, needs_proximal=False)
