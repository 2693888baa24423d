"""Policy-gradient objectives by ``train.objective`` name, one short file each (formula in its
docstring): ``ppo`` (``ppo.py``) and ``decoupled_ppo`` (``decoupled_ppo.py``).

``get_objective(name)`` returns the registered ``Objective``; an unknown name raises ``ConfigError``
listing the known ones. ``auto`` is not a name here: ``ExperimentConfig.for_arm`` resolves it per arm.

Invariants:
- every name here is accepted by ``TrainerConfig.objective`` (tests/trainers/test_objectives.py);
- a registered objective's key is its ``Objective.name``.
"""

from __future__ import annotations

from rollpacker.core.errors import ConfigError
from rollpacker.trainers.objectives import decoupled_ppo, ppo
from rollpacker.trainers.objectives.base import Objective, PgTerms

OBJECTIVES: dict[str, Objective] = {o.name: o for o in (ppo.OBJECTIVE, decoupled_ppo.OBJECTIVE)}


def get_objective(name: str) -> Objective:
    try:
        return OBJECTIVES[name]
    except KeyError:
        raise ConfigError(
            f"unknown objective {name!r} (train.objective); known objectives: {', '.join(OBJECTIVES)}"
        ) from None


__all__ = ["OBJECTIVES", "Objective", "PgTerms", "get_objective"]
