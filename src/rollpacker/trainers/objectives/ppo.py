"""PPO-clip (``train.objective: ppo``; GRPO's, Dr. GRPO's, DAPO's and REINFORCE++'s loss).

Per response token (advantage ``A``, current logprob ``p``, old logprob ``old``: the trainer's own
logprob under the weights the update starts from; ``rollpacker.core.fidelity``):

    l_pg = -min(exp(p - old) * A, clip(exp(p - old), 1 - eps_low, 1 + eps_high) * A)

The clip is a trust region around ``pi_old``; it never acts on the rollout engine's numbers (those
enter only through ``train.correction``).
"""

from __future__ import annotations

import torch

from rollpacker.trainers.objectives.base import Objective, PgInputs, PgTerms, clipped


def per_token(x: PgInputs) -> PgTerms:
    return clipped(x, torch.exp(x.logp - x.old))


OBJECTIVE = Objective("ppo", per_token)
