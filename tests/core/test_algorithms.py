"""The algorithm pieces of core/advantages.py by formula (DAPO's overlong shaping and filtering,
REINFORCE++'s KL in the reward and whole-batch normalization) and the config's refusals by name."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollpacker.core.advantages import (
    ADVANTAGE_ESTIMATORS,
    ReturnStats,
    RewardShaping,
    Scope,
    grpo,
    has_signal,
    kl_estimate,
    normalized,
    overlong_penalty,
    token_returns,
    train_samples,
)
from rollpacker.core.config import OBJECTIVE_NAMES, ExperimentConfig, TrainerConfig, from_mapping
from rollpacker.core.errors import ConfigError
from rollpacker.core.types import Completion, FinishReason, Group, Prompt


# -- DAPO: overlong reward shaping and filtering ---------------------------------------------------
@pytest.mark.parametrize(
    ("n", "want"),
    [(1, 0.0), (60, 0.0), (61, -0.025), (80, -0.5), (99, -0.975), (100, -1.0), (140, -1.0)],
)
def test_overlong_penalty_is_dapos_soft_ramp(n, want) -> None:
    # L_max = 100, L_cache = 40: no penalty up to 60 tokens, linear to -1 at 100
    assert overlong_penalty(n, 100, 40) == pytest.approx(want)
    assert overlong_penalty(n, 100, 40, scale=0.5) == pytest.approx(want / 2)
    assert overlong_penalty(n, 100, 0) == 0.0


def _group(lengths: list[int], reasons: list[FinishReason]) -> Group:
    p = Prompt("p", (5, 6))
    return Group(
        p,
        tuple(
            Completion(f"r{j}", "p", j, tuple(range(1, n + 1)), (-0.5,) * n, reason)
            for j, (n, reason) in enumerate(zip(lengths, reasons, strict=True))
        ),
    )


def test_train_samples_shape_rewards_before_the_advantage() -> None:
    g = _group([10, 80, 100], [FinishReason.STOP, FinishReason.STOP, FinishReason.LENGTH])
    sh = RewardShaping(estimator="grpo", max_tokens=100, overlong_buffer=40)
    samples = train_samples(g, [1.0, 1.0, 1.0], shaping=sh)
    assert [s.reward for s in samples] == pytest.approx([1.0, 0.5, 0.0])
    assert [s.advantage for s in samples] == pytest.approx(grpo([1.0, 0.5, 0.0]))
    # unshaped, the equal rewards give no signal at all
    assert all(s.advantage == 0 for s in train_samples(g, [1.0, 1.0, 1.0]))


def test_overlong_filter_leaves_truncated_responses_out_of_the_loss_not_the_statistics() -> None:
    g = _group(
        [10, 20, 100, 30], [FinishReason.STOP, FinishReason.STOP, FinishReason.LENGTH, FinishReason.STOP]
    )
    rewards = [1.0, 0.0, 0.0, 1.0]
    sh = RewardShaping(estimator="grpo", max_tokens=100, overlong_filter=True)
    kept = train_samples(g, rewards, shaping=sh)
    assert [s.sample_id for s in kept] == ["r0", "r1", "r3"]
    full = grpo(rewards)
    assert [s.advantage for s in kept] == pytest.approx([full[0], full[1], full[3]])


def test_has_signal_is_reward_variance() -> None:
    assert has_signal([0.0, 1.0]) and not has_signal([1.0, 1.0]) and not has_signal([0.3])


# -- REINFORCE++ -----------------------------------------------------------------------------------
def test_registry_scopes() -> None:
    assert {n: e.scope for n, e in ADVANTAGE_ESTIMATORS.items()} == {
        "grpo": Scope.GROUP,
        "dr_grpo": Scope.GROUP,
        "reinforce_pp": Scope.BATCH,
        "zero": Scope.GROUP,
    }


@pytest.mark.parametrize(("kind", "want"), [("k1", 0.5), ("k2", 0.125), ("k3", math.exp(-0.5) + 0.5 - 1)])
def test_kl_estimates(kind, want) -> None:
    assert kl_estimate(kind, -1.0, -1.5) == pytest.approx(want, rel=1e-12)


def test_token_returns_put_the_kl_in_the_reward() -> None:
    b, q = [-1.0, -2.0, -0.5], [-1.5, -2.0, -0.3]  # k1 per token: 0.5, 0.0, -0.2
    assert token_returns(1.0, b, q, 0.1, "k1") == pytest.approx((0.97, 1.02, 1.02), rel=1e-12)
    assert token_returns(1.0, b, q, 0.0, "k1") == (1.0, 1.0, 1.0)


floats = st.floats(-5, 5, allow_nan=False)


@given(st.lists(st.lists(floats, min_size=1, max_size=6), min_size=2, max_size=12), st.randoms())
def test_return_stats_merge_exactly_in_any_order(returns, rnd) -> None:
    whole = ReturnStats.of(returns)
    order = list(returns)
    rnd.shuffle(order)
    merged = ReturnStats()
    for r in order:
        merged = merged.merge(ReturnStats.of([r]))
    assert merged.count == whole.count
    assert merged.mean_std() == pytest.approx(whole.mean_std(), rel=1e-9, abs=1e-9)
    flat = [a for r in returns for a in normalized(r, merged)]
    _, std = whole.mean_std()
    assert abs(sum(flat) / len(flat)) < 1e-6
    if std > 1e-3:  # unit RMS, up to the formula's eps: (G - mean) / (std + 1e-6)
        rms = math.sqrt(sum(a * a for a in flat) / len(flat))
        assert rms == pytest.approx(std / (std + 1e-6), rel=1e-4)


# -- the config refuses by name ----------------------------------------------------------------------
def test_unknown_algorithm_names_are_refused_with_the_known_ones() -> None:
    with pytest.raises(ConfigError) as err:
        TrainerConfig(objective="ppo2")
    assert "train.objective = 'ppo2'" in str(err.value)
    assert all(n in str(err.value) for n in OBJECTIVE_NAMES)
    with pytest.raises(ConfigError) as err:
        TrainerConfig(advantage="gae")
    assert "train.advantage = 'gae'" in str(err.value)
    assert all(n in str(err.value) for n in ADVANTAGE_ESTIMATORS)
    with pytest.raises(ConfigError, match=r"train\.kl_estimator = 'k4'"):
        TrainerConfig(kl_estimator="k4")


def test_conflicting_algorithm_knobs_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"train\.reward_kl_coef = 0.1: only advantage: reinforce_pp"):
        TrainerConfig(reward_kl_coef=0.1)
    with pytest.raises(ConfigError, match=r"train\.scale_advantages = false with train.advantage = 'grpo'"):
        TrainerConfig(advantage="grpo", scale_advantages=False)
    assert TrainerConfig(scale_advantages=False).advantage_estimator == "dr_grpo"
    assert TrainerConfig(advantage="reinforce_pp", reward_kl_coef=0.01).advantage_estimator == "reinforce_pp"


@pytest.mark.parametrize("buffer", [1024, 4096])
def test_an_overlong_buffer_not_below_the_max_length_is_refused(buffer) -> None:
    with pytest.raises(
        ConfigError, match=rf"train.overlong_buffer = {buffer}: must be smaller than rollout.max_tokens"
    ):
        from_mapping(
            ExperimentConfig, {"rollout": {"max_tokens": 1024}, "train": {"overlong_buffer": buffer}}
        )
    ok = from_mapping(ExperimentConfig, {"rollout": {"max_tokens": 1024}, "train": {"overlong_buffer": 256}})
    assert ok.shaping() == RewardShaping("grpo", 1024, 256, 1.0, False)
