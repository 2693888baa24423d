from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollpacker.core.advantages import (
    ADVANTAGE_ESTIMATORS,
    get_advantage_estimator,
    group_advantages,
    train_samples,
)
from rollpacker.core.errors import ConfigError
from rollpacker.core.stream_math import LossNorm, denominator, token_weight
from rollpacker.core.types import Completion, FinishReason, Group, Prompt


@given(st.lists(st.floats(-10, 10, allow_nan=False), min_size=1, max_size=16), st.booleans())
def test_group_advantages_sum_to_zero(rewards, scale):
    assert abs(sum(group_advantages(rewards, scale=scale))) < 1e-6 * max(1.0, len(rewards))


def test_equal_rewards_give_zero_advantages():
    assert group_advantages([1.0, 1.0, 1.0]) == (0.0, 0.0, 0.0)


def test_grpo_scaling_divides_by_population_std():
    adv = group_advantages([1.0, 0.0, 0.0, 0.0], eps=0.0)
    std = math.sqrt(0.1875)
    assert adv == pytest.approx((0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std))
    assert group_advantages([1.0, 0.0], scale=False) == (0.5, -0.5)


def test_train_samples_keep_tokens_logprobs_and_versions():
    p = Prompt("p", (5, 6))
    comps = tuple(
        Completion(f"r{j}", "p", j, (1, 2, j + 3), (-0.1, -0.2, -0.3), FinishReason.STOP, policy_version=7)
        for j in range(2)
    )
    samples = train_samples(Group(p, comps), [1.0, 0.0])
    assert [s.response_ids for s in samples] == [c.token_ids for c in comps]
    assert all(s.behaviour_logprobs == (-0.1, -0.2, -0.3) and s.policy_version == 7 for s in samples)
    assert samples[0].advantage > 0 > samples[1].advantage
    with pytest.raises(ValueError, match="2 responses"):
        train_samples(Group(p, comps), [1.0])


@given(
    st.lists(st.integers(1, 500), min_size=1, max_size=64),
    st.sampled_from([LossNorm.TOKEN_MEAN, LossNorm.SEQ_MEAN]),
)
def test_stream_weights_sum_to_one(lengths, norm):
    total = sum(token_weight(norm, n) * n for n in lengths)
    assert total / denominator(norm, lengths) == pytest.approx(1.0)


@given(st.lists(st.integers(1, 500), min_size=1, max_size=64), st.integers(500, 4096))
def test_constant_norm_divides_by_budget_times_responses(lengths, budget):
    """Dr. GRPO's normaliser: ``D = L * N`` whatever the lengths; the weights sum to <= 1."""
    assert denominator(LossNorm.CONSTANT, lengths, budget) == budget * len(lengths)
    total = sum(token_weight(LossNorm.CONSTANT, n) * n for n in lengths)
    assert total / denominator(LossNorm.CONSTANT, lengths, budget) <= 1.0
    if all(n == budget for n in lengths):
        assert total == budget * len(lengths)


def test_constant_norm_refuses_a_missing_budget_or_a_longer_response():
    with pytest.raises(ValueError, match="loss_budget_tokens"):
        denominator(LossNorm.CONSTANT, [3, 4])
    with pytest.raises(ValueError, match="longer than the constant normaliser's budget of 4 tokens"):
        denominator(LossNorm.CONSTANT, [3, 5], budget_tokens=4)


def test_advantage_estimators_by_name() -> None:
    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "dr_grpo", "reinforce_pp", "zero"}
    rewards = [1.0, 0.0, 0.0, 0.0]
    assert get_advantage_estimator("grpo")(rewards, 1e-6) == group_advantages(rewards, scale=True)
    assert get_advantage_estimator("dr_grpo")(rewards, 1e-6) == group_advantages(rewards, scale=False)
    with pytest.raises(ConfigError) as err:
        get_advantage_estimator("ppo_gae")
    assert "'ppo_gae'" in str(err.value)
    assert all(name in str(err.value) for name in ("grpo", "dr_grpo", "reinforce_pp"))
