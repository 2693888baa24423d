"""Advantage estimators by ``train.advantage`` name, and the samples a trainer consumes.

Estimators (``get_advantage_estimator(name)``; an unknown name raises ``ConfigError`` listing the
known ones). ``r_j`` is response j's reward, a group is one prompt's responses:

- ``grpo`` (group scope): ``A_j = (r_j - mean(r)) / (std(r) + eps)``, population std over the group;
- ``dr_grpo`` (group scope, Dr. GRPO): ``A_j = r_j - mean(r)``, unscaled;
- ``zero`` (group scope): ``A_j = 0``, the no-RL control of ``bench learning`` (same rollouts and
  steps, no policy-gradient signal: with no KL term and no weight decay the weights never move);
- ``reinforce_pp`` (batch scope, REINFORCE++): a token-level reward with the KL penalty in it,
  ``r_{i,t} = -beta * kl_{i,t} + [t = |y_i|] * r_i``, its return ``G_{i,t} = sum_{s >= t} r_{i,s}``
  (gamma = 1) and global normalization over every response token of the whole batch B,
  ``A_{i,t} = (G_{i,t} - mean_B(G)) / (std_B(G) + eps)``. ``kl_{i,t}`` is the k-style estimate
  (``train.kl_estimator``) of KL(pi_old || pi_ref) at the token, from the behaviour logprob ``b``
  and the reference logprob ``q``: k1 ``b - q``, k2 ``(b - q)^2 / 2``, k3 ``exp(q - b) - (q - b) - 1``.

A group-scope estimator is computed when a group's rewards are in (the reward service), so its
samples stream to the trainer at once. A batch-scope estimator needs the whole batch's mean and std:
its per-group part (the returns ``G``, which need only the group and the reference model) is
computed as groups arrive and summarized by ``ReturnStats`` (count, sum, sum of squares: sufficient
statistics that merge exactly in any order); the normalization and the policy-gradient pass wait
for the last group (docs/training.md, "Exactness").

DAPO's reward-side pieces (``RewardShaping``, applied by ``train_samples``): the soft overlong
penalty for a response of ``L`` tokens with ``L_max = rollout.max_tokens`` and buffer
``L_cache = train.overlong_buffer``,

    R_len(L) = 0                                  if L <= L_max - L_cache
             = ((L_max - L_cache) - L) / L_cache  if L_max - L_cache < L <= L_max
             = -1                                 if L > L_max

scaled by ``train.overlong_penalty`` and added to the reward; and overlong filtering
(``train.overlong_filter``): truncated responses (finish reason ``length``) keep their place in the
group's statistics but are left out of the loss (DAPO's overlong filtering masks them).

Invariants:
- group-scope advantages of a group sum to 0 (within float rounding);
- a group whose rewards are all equal has all-zero advantages (no signal: ``has_signal`` is false);
- ``reinforce_pp`` advantages have mean 0 and std 1 over the batch's tokens, whatever the chunking
  of the batch into groups (``ReturnStats`` merges exactly);
- ``train_samples`` keeps every response's tokens, behaviour logprobs and policy version as sampled.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rollpacker.core.errors import ConfigError
from rollpacker.core.types import FinishReason, Group

# (a group's rewards, eps) -> one value per response: the advantage (group scope) or the scalar the
# batch pass starts from (batch scope: the shaped reward)
GroupFn = Callable[[Sequence[float], float], tuple[float, ...]]


class Scope(enum.Enum):
    GROUP = "group"  # needs one group: streams per group
    BATCH = "batch"  # needs the whole batch (global normalization): deferred, exactly


@dataclass(frozen=True)
class AdvantageEstimator:
    """A registered estimator: its ``train.advantage`` name, scope and per-group function."""

    name: str
    scope: Scope
    group: GroupFn

    def __call__(self, rewards: Sequence[float], eps: float = 1e-6) -> tuple[float, ...]:
        return self.group(rewards, eps)


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
    token_advantages: tuple[float, ...] = ()  # per-token advantages (batch scope; () = advantage)
    # pi_old: the trainer's logprobs under the weights the step's update starts from, taken before
    # the first of several mini-batch steps (() = the detached logprobs of the same forward;
    # rollpacker.core.fidelity)
    old_logprobs: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not self.response_ids:
            raise ValueError(f"sample {self.sample_id!r}: empty response; nothing to train on")
        for what, seq in (
            ("behaviour logprobs", self.behaviour_logprobs),
            ("token versions", self.token_versions),
            ("token advantages", self.token_advantages),
            ("old logprobs", self.old_logprobs),
        ):
            if (seq or what == "behaviour logprobs") and len(seq) != len(self.response_ids):
                raise ValueError(
                    f"sample {self.sample_id!r}: {len(self.response_ids)} tokens but {len(seq)} {what}"
                )

    @property
    def versions(self) -> tuple[int, ...]:
        return self.token_versions or (self.policy_version,) * len(self.response_ids)

    @property
    def advantages(self) -> tuple[float, ...]:
        """The advantage of each response token."""
        return self.token_advantages or (self.advantage,) * len(self.response_ids)

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


def zero(rewards: Sequence[float], eps: float = 1e-6) -> tuple[float, ...]:
    """The no-RL control: every advantage 0."""
    return (0.0,) * len(_centered(rewards))


def _raw(rewards: Sequence[float], eps: float = 1e-6) -> tuple[float, ...]:
    """A batch-scope estimator's per-group part: the rewards as they are (the batch pass follows)."""
    if not rewards:
        raise ValueError("a group needs at least one reward")
    return tuple(float(r) for r in rewards)


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    e.name: e
    for e in (
        AdvantageEstimator("grpo", Scope.GROUP, grpo),
        AdvantageEstimator("dr_grpo", Scope.GROUP, dr_grpo),
        AdvantageEstimator("reinforce_pp", Scope.BATCH, _raw),
        AdvantageEstimator("zero", Scope.GROUP, zero),
    )
}
KL_ESTIMATORS = ("k1", "k2", "k3")


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        raise ConfigError(
            f"unknown advantage estimator {name!r} (train.advantage); known estimators: "
            f"{', '.join(ADVANTAGE_ESTIMATORS)}"
        ) from None


def group_advantages(rewards: Sequence[float], eps: float = 1e-6, scale: bool = True) -> tuple[float, ...]:
    """The group's advantages: ``grpo`` (``scale``, train.scale_advantages) or ``dr_grpo``."""
    return get_advantage_estimator("grpo" if scale else "dr_grpo")(rewards, eps)


def has_signal(rewards: Sequence[float]) -> bool:
    """Whether a group's rewards differ (DAPO's dynamic sampling keeps only such groups)."""
    return len(rewards) > 1 and max(rewards) != min(rewards)


# -- REINFORCE++: the KL in the reward, returns, global normalization --------------------------------
def kl_estimate(kind: str, behaviour: float, reference: float) -> float:
    """The k-style estimate of KL(pi_old || pi_ref) at one sampled token."""
    d = reference - behaviour
    if kind == "k1":
        return -d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        return math.exp(d) - d - 1.0
    raise ConfigError(f"train.kl_estimator = {kind!r}: use one of {', '.join(KL_ESTIMATORS)}")


def token_returns(
    reward: float, behaviour: Sequence[float], reference: Sequence[float], kl_coef: float, kl_kind: str
) -> tuple[float, ...]:
    """``G_t = r - beta * sum_{s >= t} kl_s`` (the reward at the last token, gamma = 1)."""
    if len(behaviour) != len(reference) or not behaviour:
        raise ValueError(f"{len(behaviour)} behaviour but {len(reference)} reference logprobs")
    out = [0.0] * len(behaviour)
    acc = float(reward)
    for t in range(len(behaviour) - 1, -1, -1):
        acc -= kl_coef * kl_estimate(kl_kind, behaviour[t], reference[t]) if kl_coef else 0.0
        out[t] = acc
    return tuple(out)


@dataclass(frozen=True)
class ReturnStats:
    """Sufficient statistics of the batch's token returns: merge per group, in any order."""

    count: int = 0
    total: float = 0.0
    total_sq: float = 0.0

    @classmethod
    def of(cls, returns: Sequence[Sequence[float]]) -> ReturnStats:
        flat = [g for seq in returns for g in seq]
        return cls(len(flat), math.fsum(flat), math.fsum(g * g for g in flat))

    def merge(self, other: ReturnStats) -> ReturnStats:
        return ReturnStats(self.count + other.count, self.total + other.total, self.total_sq + other.total_sq)

    def mean_std(self) -> tuple[float, float]:
        if self.count == 0:
            raise ValueError("no returns: the batch is empty")
        mean = self.total / self.count
        return mean, math.sqrt(max(0.0, self.total_sq / self.count - mean * mean))


def normalized(returns: Sequence[float], stats: ReturnStats, eps: float = 1e-6) -> tuple[float, ...]:
    """``(G_t - mean_B) / (std_B + eps)`` with the whole batch's statistics."""
    mean, std = stats.mean_std()
    return tuple((g - mean) / (std + eps) for g in returns)


# -- DAPO's reward shaping and the samples a trainer consumes ----------------------------------------
@dataclass(frozen=True)
class RewardShaping:
    """DAPO's overlong reward shaping and filtering, and the estimator (``ExperimentConfig.shaping``)."""

    estimator: str = "grpo"
    max_tokens: int = 0  # L_max (rollout.max_tokens); 0 = no length penalty
    overlong_buffer: int = 0  # L_cache; 0 = no length penalty
    overlong_penalty: float = 1.0  # the penalty's scale at L >= L_max
    overlong_filter: bool = False  # truncated responses left out of the loss
    eps: float = 1e-6


def overlong_penalty(num_tokens: int, max_tokens: int, buffer: int, scale: float = 1.0) -> float:
    """DAPO's soft overlong punishment ``R_len`` (0 when ``buffer`` is 0)."""
    if buffer <= 0:
        return 0.0
    start = max_tokens - buffer
    if num_tokens <= start:
        return 0.0
    return -scale * min(1.0, (num_tokens - start) / buffer)


def train_samples(
    group: Group,
    rewards: Sequence[float],
    eps: float = 1e-6,
    scale: bool = True,
    shaping: RewardShaping | None = None,
) -> tuple[TrainSample, ...]:
    """The group's responses as train samples: shaped rewards, the estimator's advantages (group
    scope) or the shaped rewards the batch pass starts from (batch scope), overlong filtering.
    Without ``shaping``, ``grpo`` (``scale``) or ``dr_grpo`` and no shaping, as before DAPO."""
    if len(rewards) != len(group.responses):
        raise ValueError(
            f"prompt {group.prompt.prompt_id!r}: {len(rewards)} rewards for {len(group.responses)} responses"
        )
    sh = shaping or RewardShaping(estimator="grpo" if scale else "dr_grpo", eps=eps)
    shaped = [
        r + overlong_penalty(len(c.token_ids), sh.max_tokens, sh.overlong_buffer, sh.overlong_penalty)
        for c, r in zip(group.responses, rewards, strict=True)
    ]
    adv = get_advantage_estimator(sh.estimator)(shaped, sh.eps)
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
        for c, r, a in zip(group.responses, shaped, adv, strict=True)
        if not (sh.overlong_filter and c.finish_reason is FinishReason.LENGTH)
    )
