"""Decoupled PPO of partial rollout (AReaL; ``train.objective: decoupled_ppo``).

Per response token (advantage ``A``, behaviour logprob ``b``, current logprob ``p``, proximal
logprob ``q``: the logprob under the weights the update starts from, taken without gradient):

    l_pg = -min(exp(p - b) * A, exp(q - b) * clip(exp(p - q), 1 - eps_low, 1 + eps_high) * A)

The clipped ratio is ``exp(p - q)`` (the trust region is around the proximal policy) and the
behaviour weight is ``exp(q - b)`` (importance weight of the stale tokens, no gradient). With
``q == b`` it is ``ppo``.
"""

from __future__ import annotations

import torch

from rollpacker.core.errors import TrainerError
from rollpacker.trainers.objectives.base import Objective, PgInputs, PgTerms


def per_token(x: PgInputs) -> PgTerms:
    if x.proximal is None:
        raise TrainerError("decoupled_ppo needs the proximal logprobs: pass q (the detached logprobs)")
    behav_weight = torch.exp(x.proximal - x.behaviour)  # pi_prox / pi_behav, no gradient
    ratio = torch.exp(x.logp - x.proximal)
    c = x.clip(ratio)
    loss = -torch.minimum(torch.exp(x.logp - x.behaviour) * x.advantage, behav_weight * c * x.advantage)
    return PgTerms(loss, ratio, c, behav_weight)


OBJECTIVE = Objective("decoupled_ppo", per_token, needs_proximal=True)
