"""GRPO advantages and the samples a trainer consumes.

A group's advantage of response j is ``(r_j - mean(r)) / (std(r) + eps)`` (population std, as in
GRPO; ``scale=False`` gives Dr. GRPO's unscaled ``r_j - mean(r)``). Every token of a response gets
its response's advantage. The estimators are registered by name (``grpo``, ``dr_grpo``);
``get_advantage_estimator(name)`` finds one, and an unknown name raises ``ConfigError`` listing the
known ones.

Invariants:
- advantages of a group sum to 0 (within float rounding);
- a group whose rewards are all equal has all-zero advantages (no signal, no update direction);
- ``train_samples`` keeps every response's tokens, behaviour logprobs and policy version as sampled.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rollpacker.core.errors import ConfigError
from rollpacker.core.types import Group

# (a group's rewards, eps) -> one advantage per response
AdvantageEstimator = Callable[[Sequence[float], float], tuple[float, ...]]


@dataclass(frozen=True)
class TrainSample:
    """One response, ready for a policy-gradient loss."""

    sample_id: str  # the request id it was generated under
    prompt_id: str
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    behaviour_logprobs: tuple[float, ...]  # what the rollout engine sampled with
    advantage: float
    reward: float
    policy_version: int = 0
    token_versions: tuple[int, ...] = ()  # version that sampled each token (() = policy_version)

    def __post_init__(self) -> None:
        if not self.response_ids:
            raise ValueError(f"sample {self.sample_id!r}: empty response; nothing to train on")
        if len(self.response_ids) != len(self.behaviour_logprobs):
            raise ValueError(
                f"sample {self.sample_id!r}: {len(self.response_ids)} tokens but "
                f"{len(self.behaviour_logprobs)} behaviour logprobs"
            )
        if self.token_versions and len(self.token_versions) != len(self.response_ids):
            raise ValueError(
                f"sample {self.sample_id!r}: {len(self.response_ids)} tokens but "
                f"{len(self.token_versions)} token versions"
            )

    @property
    def versions(self) -> tuple[int, ...]:
        return self.token_versions or (self.policy_version,) * len(self.response_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.response_ids)


def _centered(rewards: Sequence[float]) -> list[float]:
    if not rewards:
        raise ValueError("a group needs at least one reward")
    mean = sum(rewards) / len(rewards)
    return [r - mean for r in rewards]


def grpo(rewards: Sequence[float], eps: float = 1e-6) -> tuple[float, ...]:
    """GRPO: ``(r_j - mean(r)) / (std(r) + eps)``, population std."""
    centered = _centered(rewards)
    std = math.sqrt(sum(c * c for c in centered) / len(centered))
    return tuple(c / (std + eps) for c in centered)


def dr_grpo(rewards: Sequence[float], eps: float = 1e-6) -> tuple[float, ...]:
    """Dr. GRPO: ``r_j - mean(r)``, unscaled (``eps`` unused)."""
    return tuple(_centered(rewards))


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {"grpo": grpo, "dr_grpo": dr_grpo}


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        raise ConfigError(
            f"unknown advantage estimator {name!r}; known estimators: {', '.join(ADVANTAGE_ESTIMATORS)}"
        ) from None


def group_advantages(rewards: Sequence[float], eps: float = 1e-6, scale: bool = True) -> tuple[float, ...]:
    """The group's advantages: ``grpo`` (``scale``, train.scale_advantages) or ``dr_grpo``."""
    return get_advantage_estimator("grpo" if scale else "dr_grpo")(rewards, eps)


def train_samples(
    group: Group, rewards: Sequence[float], eps: float = 1e-6, scale: bool = True
) -> tuple[TrainSample, ...]:
    """The group's responses as train samples, with group-normalized advantages."""
    if len(rewards) != len(group.responses):
        raise ValueError(
            f"prompt {group.prompt.prompt_id!r}: {len(rewards)} rewards for {len(group.responses)} responses"
        )
    adv = group_advantages(rewards, eps=eps, scale=scale)
    return tuple(
        TrainSample(
            sample_id=c.request_id,
            prompt_id=c.prompt_id,
            prompt_ids=group.prompt.token_ids,
            response_ids=c.token_ids,
            behaviour_logprobs=c.logprobs,
            advantage=a,
            reward=r,
            policy_version=c.policy_version,
            token_versions=c.token_versions if c.resumed_tokens else (),
        )
        for c, r, a in zip(group.responses, rewards, adv, strict=True)
    )
