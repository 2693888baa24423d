"""Policy-gradient objectives by ``train.objective`` name, one short file each (formula in its
docstring): ``ppo`` (``ppo.py``: PPO-clip around ``pi_old``; GRPO's, Dr. GRPO's, DAPO's and
REINFORCE++'s loss), ``decoupled_ppo`` (``decoupled_ppo.py``: AReaL's, for partial rollout) and
``gspo`` (``gspo.py``: sequence-level ratio and clipping). The advantage estimators are the other
half of an algorithm (``rollpacker.core.advantages``, ``train.advantage``); docs/training.md maps
algorithm names to the two.

``get_objective(name)`` returns the registered ``Objective``; an unknown name raises ``ConfigError``
listing the known ones. ``auto`` is not a name here: ``ExperimentConfig.for_arm`` resolves it per arm.

Invariants:
- the names here are exactly ``rollpacker.core.config.OBJECTIVE_NAMES``, the names
  ``TrainerConfig.objective`` accepts (tests/trainers/test_objectives.py);
- a registered objective's key is its ``Objective.name``.
"""

from __future__ import annotations

from rollpacker.core.errors import ConfigError
from rollpacker.trainers.objectives import decoupled_ppo, gspo, ppo
from rollpacker.trainers.objectives.base import Objective, PgInputs, PgTerms

OBJECTIVES: dict[str, Objective] = {
    o.name: o for o in (ppo.OBJECTIVE, decoupled_ppo.OBJECTIVE, gspo.OBJECTIVE)
}


def get_objective(name: str) -> Objective:
    try:
        return OBJECTIVES[name]
    except KeyError:
        raise ConfigError(
            f"unknown objective {name!r} (train.objective); known objectives: {', '.join(OBJECTIVES)}"
        ) from None


__all__ = ["OBJECTIVES", "Objective", "PgInputs", "PgTerms", "get_objective"]
