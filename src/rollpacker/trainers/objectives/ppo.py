from __future__ import annotations

import torch

from rollpacker.trainers.objectives.base import Objective, PgInputs, PgTerms, clipped


def per_token(x: PgInputs) -> PgTerms:
    return clipped(x, torch.exp(x.logp - x.behaviour))


OBJECTIVE = Objective("ppo", per_token, needs_proximal=False)
