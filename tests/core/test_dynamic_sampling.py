"""DAPO's dynamic sampling under tail batching, each invariant by name, on long randomized runs
against the fake engine (core/policies/dynamic.py, core/policies/tail_batching.py).

A prompt's responses are rewarded by its kind: always 0 (the model never solves it), always 1
(always solves it) or by the response's sample index (mixed: a group of the first R0 finishers may
still have equal rewards). Only mixed groups can carry signal.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from rollpacker.core.accounting import PromptAccount, StepPrompts, account_prompts
from rollpacker.core.advantages import has_signal
from rollpacker.core.config import DynamicSamplingConfig, ExperimentConfig, RolloutConfig
from rollpacker.core.errors import ConfigError, PolicyError
from rollpacker.core.policies.tail_batching import TailBatchingPolicy
from rollpacker.core.prompts import PromptCursor
from rollpacker.core.types import Group, RoundKind
from rollpacker.engines.fake import FakeEngine
from rollpacker.lab.bench.replay import replay_sampling
from rollpacker.rollout.driver import run_round
from tests.conftest import make_prompts

NEVER, ALWAYS, MIXED = 0, 1, 2


def _rewarder(kinds: list[int]):
    def rewards(g: Group) -> list[float]:
        kind = kinds[int(g.prompt.prompt_id[1:]) % len(kinds)]
        if kind == MIXED:
            return [float(c.sample_index % 2) for c in g.responses]
        return [float(kind)] * len(g.responses)

    return rewards


def _cfg(base: RolloutConfig, max_extra: int = 10_000) -> RolloutConfig:
    return dataclasses.replace(
        base, dynamic_sampling=DynamicSamplingConfig(enabled=True, max_extra_prompts=max_extra)
    )


def _run(cfg: RolloutConfig, lens, kinds, steps: int, cursor: PromptCursor | None = None):
    """Steps until the prompt set runs out (a round that dies before commit changes nothing)."""
    prompts = make_prompts(lens)
    pol = TailBatchingPolicy(
        cfg, cursor or PromptCursor(prompts, shuffle=False, epochs=1), replay_sampling(64, 0)
    )
    reward = _rewarder(kinds)
    runs = []
    for step in range(steps):
        queued_at_plan = {p.prompt_id for p in pol.queue.snapshot()}
        try:
            plan = pol.plan_step(step)
            rr = run_round(FakeEngine(concurrency=16), pol.open_round(plan), group_rewards=reward)
        except PolicyError as e:
            if "used up" in str(e) or "cannot give it" in str(e):  # the prompt set ran out
                break
            raise
        pol.commit(rr.result)
        runs.append((rr.result, queued_at_plan))
    return pol, runs, prompts


configs = st.builds(
    RolloutConfig,
    prompts_per_step=st.integers(1, 6),
    responses_per_prompt=st.integers(2, 6),
    eta_p=st.sampled_from([1.0, 1.25, 1.5, 2.0]),
    eta_r=st.sampled_from([1.0, 1.25, 2.0]),
)
lens_strategy = st.lists(
    st.lists(st.integers(min_value=1, max_value=60), min_size=12, max_size=12), min_size=30, max_size=90
)
kinds_strategy = st.lists(st.sampled_from([NEVER, ALWAYS, MIXED, MIXED]), min_size=1, max_size=17)


@settings(max_examples=50, deadline=None)
@given(cfg=configs, lens=lens_strategy, kinds=kinds_strategy)
def test_invariant_every_update_holds_p0_groups_with_signal(cfg, lens, kinds) -> None:
    _, runs, _ = _run(_cfg(cfg), lens, kinds, steps=60)
    reward = _rewarder(kinds)
    for res, _ in runs:
        assert len(res.groups) == cfg.prompts_per_step
        assert all(len(g.responses) == cfg.responses_per_prompt for g in res.groups)
        assert all(has_signal(reward(g)) for g in res.groups), "a group without reward variance was kept"


def _account(pol: TailBatchingPolicy, runs) -> PromptAccount:  # type: ignore[no-untyped-def]
    """The chain's exactly-once account (core.accounting), as experiment.exactly_once builds it."""
    return account_prompts(_steps(runs), queued=[p.prompt_id for p in pol.queue.snapshot()])


@settings(max_examples=50, deadline=None)
@given(cfg=configs, lens=lens_strategy, kinds=kinds_strategy)
def test_invariant_exactly_once_with_dropped_groups(cfg, lens, kinds) -> None:
    pol, runs, prompts = _run(_cfg(cfg), lens, kinds, steps=60)
    account = _account(pol, runs)
    assert account.problems() == []
    # every prompt the cursor handed out is trained, dropped or waiting in the queue: nothing lost
    trained = {g.prompt.prompt_id for res, _ in runs for g in res.groups}
    dropped = {p.prompt_id for res, _ in runs for p in res.filtered}
    queued = {p.prompt_id for p in pol.queue.snapshot()}
    drawn = pol.cursor.state.position
    assert {p.prompt_id for p in prompts[:drawn]} == trained | dropped | queued
    assert account.prompts_trained + account.dropped + len(queued) == drawn


def test_a_deferred_prompt_without_variance_in_its_long_round_is_dropped_not_lost() -> None:
    """The schedule the end-to-end run hit (tests/experiment/test_dynamic_sampling_run.py): the
    short round defers p001 (its responses are the longest), the queue fills, and the long round
    runs it to a group without reward variance; dynamic sampling drops it and draws p002. p001 is
    then neither trained nor queued, and is not lost: dropped is its outcome. An invariant that
    forgets drops (deferred <= trained | final queue, the run's old check) fails on this chain."""
    cfg = _cfg(RolloutConfig(prompts_per_step=1, responses_per_prompt=2, eta_p=2.0, eta_r=1.0))
    lens = [[4] * 12, [50] * 12, *([[6] * 12] * 10)]
    pol, runs, _ = _run(cfg, lens, [MIXED, NEVER, MIXED], steps=2)
    (short, _), (long, _) = runs
    assert [p.prompt_id for p in short.deferred] == ["p001"] and short.plan.round_kind is RoundKind.SHORT
    assert long.plan.round_kind is RoundKind.LONG and [p.prompt_id for p in long.filtered] == ["p001"]
    assert [p.prompt_id for p in long.extra_prompts] == ["p002"] == [g.prompt.prompt_id for g in long.groups]
    account = _account(pol, runs)
    assert account.problems() == [] and account.dropped == 1 and account.deferred_lost == ()
    trained = {g.prompt.prompt_id for res, _ in runs for g in res.groups}
    assert not {"p001"} <= trained | {p.prompt_id for p in pol.queue.snapshot()}, "the old check holds here"
    # forget the drop, and the same account names p001 lost
    forgot = [StepPrompts(s.trained, s.deferred) for s in _steps(runs)]
    assert account_prompts(forgot, queued=()).deferred_lost == ("p001",)


def _steps(runs) -> list[StepPrompts]:  # type: ignore[no-untyped-def]
    return [
        StepPrompts(
            tuple(g.prompt.prompt_id for g in res.groups),
            tuple(p.prompt_id for p in res.deferred),
            tuple(p.prompt_id for p in res.filtered),
        )
        for res, _ in runs
    ]


@settings(max_examples=50, deadline=None)
@given(cfg=configs, lens=lens_strategy, kinds=kinds_strategy)
def test_invariant_dropped_groups_are_replaced_and_counted(cfg, lens, kinds) -> None:
    _, runs, _ = _run(_cfg(cfg), lens, kinds, steps=60)
    for res, queued_at_plan in runs:
        launched = [p.prompt_id for p in (*res.plan.prompts, *res.extra_prompts)]
        assert len(launched) == len(set(launched)), "a prompt launched twice in one round"
        assert len(res.extra_prompts) == len(res.filtered), "one replacement per dropped group"
        assert not {p.prompt_id for p in res.filtered} & {p.prompt_id for p in res.deferred}, (
            "dropped, queued"
        )
        # a queued prompt is never drawn again while it waits
        fresh = (
            launched if res.plan.round_kind is RoundKind.SHORT else [p.prompt_id for p in res.extra_prompts]
        )
        assert not set(fresh) & queued_at_plan


@settings(max_examples=25, deadline=None)
@given(cfg=configs, kinds=kinds_strategy.filter(lambda k: MIXED in k), seed=st.integers(0, 5))
# one mixed prompt in seven: the set cannot fill the first update (found by a gate run)
@example(
    cfg=RolloutConfig(prompts_per_step=6, responses_per_prompt=2, eta_p=1.5, eta_r=1.0),
    kinds=[0, 0, 0, 0, 0, 0, 2],
    seed=0,
)
def test_invariant_a_queued_prompt_is_not_drawn_twice_across_epochs(cfg, kinds, seed) -> None:
    """A small prompt set the cursor cycles through: a prompt waiting in the queue comes round
    again in the next epoch; neither the round nor its replacements may launch it. A set with too
    few prompts that carry signal to fill even the first update stops at once, by name (``_run``):
    there is nothing to check then."""
    lens = [[(7 * i + 3 * j) % 50 + 1 for j in range(12)] for i in range(4 * 2 * 6)]
    prompts = make_prompts(lens)
    window = cfg.launched_prompts
    cursor = PromptCursor(prompts, seed=seed, shuffle=True, window=window)
    _, runs, _ = _run(_cfg(cfg), lens, kinds, steps=30, cursor=cursor)
    assume(runs)
    for res, queued_at_plan in runs:
        fresh = res.plan.prompts if res.plan.round_kind is RoundKind.SHORT else ()
        assert not {p.prompt_id for p in (*fresh, *res.extra_prompts)} & queued_at_plan


def test_without_variance_anywhere_the_budget_is_refused_by_name() -> None:
    cfg = _cfg(RolloutConfig(prompts_per_step=2, responses_per_prompt=2, eta_p=1.0, eta_r=1.0), max_extra=3)
    lens = [[5] * 12 for _ in range(40)]
    with pytest.raises(PolicyError, match=r"rollout\.dynamic_sampling\.max_extra_prompts"):
        _run(cfg, lens, [ALWAYS], steps=1)


def test_dynamic_sampling_off_keeps_groups_without_signal() -> None:
    """The invariant test above can fail: without dynamic sampling such groups are trained."""
    cfg = RolloutConfig(prompts_per_step=2, responses_per_prompt=2, eta_p=1.0, eta_r=1.0)
    prompts = make_prompts([[5] * 12 for _ in range(8)])
    pol = TailBatchingPolicy(cfg, PromptCursor(prompts, shuffle=False, epochs=1), replay_sampling(64, 0))
    rr = run_round(FakeEngine(concurrency=16), pol.open_round(pol.plan_step(0)))
    assert not any(has_signal(_rewarder([ALWAYS])(g)) for g in rr.result.groups)


def test_a_round_that_needs_rewards_refuses_a_runtime_that_gives_none() -> None:
    cfg = _cfg(RolloutConfig(prompts_per_step=1, responses_per_prompt=2, eta_p=1.0, eta_r=1.0))
    prompts = make_prompts([[5] * 12 for _ in range(8)])
    pol = TailBatchingPolicy(cfg, PromptCursor(prompts, shuffle=False, epochs=1), replay_sampling(64, 0))
    with pytest.raises(PolicyError, match="group_rewards"):
        run_round(FakeEngine(concurrency=16), pol.open_round(pol.plan_step(0)))


@pytest.mark.parametrize(
    ("rollout", "match"),
    [
        ({"responses_per_prompt": 1}, r"responses_per_prompt \(R0\) = 1.*never has reward variance"),
        ({"policy": "sync"}, r"dynamic_sampling.enabled with rollout.policy = 'sync'"),
        ({"dynamic_sampling": {"enabled": True, "max_extra_prompts": 0}}, "max_extra_prompts"),
    ],
)
def test_a_budget_that_can_never_fill_an_update_is_refused(rollout, match) -> None:
    from rollpacker.core.config import from_mapping

    data = {"arms": ["tail_batching"], "rollout": {"dynamic_sampling": {"enabled": True}, **rollout}}
    with pytest.raises(ConfigError, match=match):
        from_mapping(ExperimentConfig, data)
