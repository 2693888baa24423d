"""Decoupled PPO of partial rollout (AReaL; ``train.objective: decoupled_ppo``).

Per response token (advantage ``A``, behaviour logprob ``b`` from the engine, current logprob ``p``,
old (proximal) logprob ``old``: the trainer's logprob under the weights the update starts from,
taken without gradient):

    l_pg = -min(exp(p - b) * A, exp(old - b) * clip(exp(p - old), 1 - eps_low, 1 + eps_high) * A)
         = -exp(old - b) * min(exp(p - old) * A, clip(exp(p - old)) * A)

(``exp(old - b) > 0`` factors out of the ``min``). So the objective is ``ppo``'s clipped term
around ``pi_old``, times the behaviour weight ``w = exp(old - b)`` (importance weight of stale
tokens, no gradient), which the trainer applies (``behaviour_weighted``): the raw ``w`` with
``train.correction.level: none``, the corrected one (truncated or masked) otherwise. With
``old == b`` it is ``ppo``.
"""

from __future__ import annotations

from rollpacker.trainers.objectives import ppo
from rollpacker.trainers.objectives.base import Objective

OBJECTIVE = Objective("decoupled_ppo", ppo.per_token, behaviour_weighted=True)
