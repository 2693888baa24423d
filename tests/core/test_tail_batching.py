"""Tail-batching invariants, each by name, on long randomized runs against the fake engine."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rollpacker.core.accounting import StepPrompts, account_prompts
from rollpacker.core.config import RolloutConfig
from rollpacker.core.policies.sync import SyncPolicy
from rollpacker.core.policies.tail_batching import TailBatchingPolicy
from rollpacker.core.prompts import PromptCursor
from rollpacker.core.types import FinishReason, RoundKind
from rollpacker.engines.fake import FakeEngine
from rollpacker.lab.bench.replay import replay_sampling
from rollpacker.rollout.driver import run_round
from tests.conftest import make_prompts

lens_strategy = st.lists(
    st.lists(st.integers(min_value=1, max_value=60), min_size=12, max_size=12), min_size=40, max_size=90
)


def _run(cfg: RolloutConfig, lens: list[list[int]], steps: int, concurrency: int = 64, kv: int = 1 << 30):
    prompts = make_prompts(lens)
    engine = FakeEngine(concurrency=concurrency, kv_capacity_tokens=kv)
    pol = TailBatchingPolicy(cfg, PromptCursor(prompts, shuffle=False, epochs=1), replay_sampling(64, 0))
    runs = []
    for step in range(steps):
        if len(pol.queue) < cfg.prompts_per_step and (pol.cursor.remaining() or 0) < cfg.launched_prompts:
            break
        rr = run_round(engine, pol.open_round(pol.plan_step(step)))
        pol.commit(rr.result)
        runs.append(rr)
    return pol, runs, prompts, engine


configs = st.builds(
    RolloutConfig,
    prompts_per_step=st.integers(1, 8),
    responses_per_prompt=st.integers(1, 6),
    eta_p=st.sampled_from([1.0, 1.1, 1.25, 1.5, 2.0]),
    eta_r=st.sampled_from([1.0, 1.25, 1.5, 2.0]),
)


@settings(max_examples=60, deadline=None)
@given(cfg=configs, lens=lens_strategy, conc=st.sampled_from([4, 16, 64]), kv=st.sampled_from([200, 1 << 30]))
def test_invariant_exactly_p0_groups_of_r0_responses(cfg, lens, conc, kv) -> None:
    _, runs, _, _ = _run(cfg, lens, steps=40, concurrency=conc, kv=kv)
    assert runs
    for rr in runs:
        assert len(rr.result.groups) == cfg.prompts_per_step
        assert all(len(g.responses) == cfg.responses_per_prompt for g in rr.result.groups)
        assert all(c.finish_reason is not FinishReason.ABORT for g in rr.result.groups for c in g.responses)


@settings(max_examples=60, deadline=None)
@given(cfg=configs, lens=lens_strategy)
def test_invariant_no_prompt_lost_or_trained_twice(cfg, lens) -> None:
    pol, runs, prompts, _ = _run(cfg, lens, steps=60)
    queued = [p.prompt_id for p in pol.queue.snapshot()]
    steps = [
        StepPrompts(
            tuple(g.prompt.prompt_id for g in rr.result.groups),
            tuple(p.prompt_id for p in rr.result.deferred),
        )
        for rr in runs
    ]
    account = account_prompts(steps, queued=queued)  # the one account every chain check uses
    assert account.problems() == [] and account.dropped == 0
    trained = {g.prompt.prompt_id for rr in runs for g in rr.result.groups}
    drawn = sum(len(rr.result.plan.prompts) for rr in runs if rr.result.plan.round_kind is RoundKind.SHORT)
    # Every prompt drawn from the dataset is either trained or waiting in the queue.
    assert {p.prompt_id for p in prompts[:drawn]} == set(trained) | set(queued)
    assert len(trained) + len(queued) == drawn


@settings(max_examples=60, deadline=None)
@given(cfg=configs, lens=lens_strategy)
def test_invariant_long_prompt_queue_is_fifo(cfg, lens) -> None:
    _, runs, _, _ = _run(cfg, lens, steps=60)
    entered: list[str] = []
    left: list[str] = []
    for rr in runs:
        plan = rr.result.plan
        if plan.round_kind is RoundKind.LONG:
            left.extend(plan.from_queue)
            assert [p.prompt_id for p in plan.prompts] == list(plan.from_queue)
        entered.extend(p.prompt_id for p in rr.result.deferred)
    assert left == entered[: len(left)]


@settings(max_examples=60, deadline=None)
@given(cfg=configs, lens=lens_strategy, conc=st.sampled_from([4, 64]))
def test_invariant_long_round_never_aborts(cfg, lens, conc) -> None:
    _, runs, _, _ = _run(cfg, lens, steps=60, concurrency=conc)
    for rr in runs:
        if rr.result.plan.round_kind is RoundKind.LONG:
            assert rr.result.discarded == ()
            assert rr.result.deferred == ()
            assert rr.metrics.aborted_requests == 0
            assert rr.result.plan.responses_per_prompt == cfg.responses_per_prompt


def test_short_round_keeps_the_fastest_and_defers_the_tail() -> None:
    # P0=2, R0=2, eta 1.5 -> 3 prompts x 3 responses; prompt p002 is the long one.
    cfg = RolloutConfig(prompts_per_step=2, responses_per_prompt=2, eta_p=1.5, eta_r=1.5)
    lens = [[5, 9, 30], [6, 4, 50], [40, 45, 50]] + [[3, 3, 3]] * 10
    pol, runs, _, _ = _run(cfg, lens, steps=1)
    res = runs[0].result
    assert res.plan.round_kind is RoundKind.SHORT
    assert [g.prompt.prompt_id for g in res.groups] == ["p001", "p000"]  # completion order
    assert sorted(c.num_tokens for c in res.groups[0].responses) == [4, 6]
    assert sorted(c.num_tokens for c in res.groups[1].responses) == [5, 9]
    assert [p.prompt_id for p in res.deferred] == ["p002"]
    assert [p.prompt_id for p in pol.queue.snapshot()] == ["p002"]
    # Wasted: the aborted third responses of p000/p001 and all of p002's partial responses. Each is
    # aborted while the step that completes its prompt is being processed, so that step's token of
    # a request listed later in the batch is never delivered: p001's third had 5 tokens (aborted at
    # step 6), p000's third and p002's three had 8 (aborted at step 9).
    assert runs[0].metrics.tokens_wasted == 5 + 8 + 3 * 8
    assert runs[0].metrics.tokens_useful == 4 + 6 + 5 + 9
    assert runs[0].engine_tokens == runs[0].metrics.tokens_generated


def test_long_round_when_queue_reaches_p0() -> None:
    cfg = RolloutConfig(prompts_per_step=2, responses_per_prompt=1, eta_p=1.5, eta_r=1.0)
    # Each short round launches 3 prompts and defers the slowest one.
    lens = [[1], [2], [50], [1], [2], [60]] + [[1]] * 20
    _, runs, _, _ = _run(cfg, lens, steps=3)
    kinds = [rr.result.plan.round_kind for rr in runs]
    assert kinds == [RoundKind.SHORT, RoundKind.SHORT, RoundKind.LONG]
    assert [g.prompt.prompt_id for g in runs[2].result.groups] == ["p002", "p005"]
    assert max(c.num_tokens for g in runs[2].result.groups for c in g.responses) == 60


def test_plan_is_pure_until_commit() -> None:
    cfg = RolloutConfig(prompts_per_step=2, responses_per_prompt=2)
    prompts = make_prompts([[3] * 3] * 10)
    pol = TailBatchingPolicy(cfg, PromptCursor(prompts, shuffle=False), replay_sampling(64, 0))
    assert pol.plan_step(0) == pol.plan_step(0)
    rnd = pol.open_round(pol.plan_step(0))
    run_round(FakeEngine(), rnd)  # not committed: a crashed step
    assert pol.plan_step(0) == pol.plan_step(0)
    assert pol.cursor.state.position == 0


def test_sync_trains_all_responses_in_order_without_aborts() -> None:
    cfg = RolloutConfig(prompts_per_step=3, responses_per_prompt=2)
    prompts = make_prompts([[i + 1, 2 * i + 1] for i in range(9)])
    pol = SyncPolicy(cfg, PromptCursor(prompts, shuffle=False, epochs=1), replay_sampling(64, 0))
    eng = FakeEngine()
    seen = []
    for step in range(3):
        rr = run_round(eng, pol.open_round(pol.plan_step(step)))
        pol.commit(rr.result)
        assert rr.result.discarded == () and rr.metrics.tokens_wasted == 0
        assert rr.metrics.response_len_max == 2 * (3 * step + 2) + 1
        seen.extend(sorted(g.prompt.prompt_id for g in rr.result.groups))
    assert seen == [p.prompt_id for p in prompts]


@settings(max_examples=40, deadline=None)
@given(cfg=configs, lens=lens_strategy, seed=st.integers(0, 5))
def test_invariant_a_queued_prompt_is_never_launched_again(cfg, lens, seed) -> None:
    """Many epochs over a small dataset: a prompt whose wait in the queue spans an epoch boundary is
    drawn again by the cursor; the short round skips it, so it is never queued twice."""
    prompts = make_prompts(lens[: max(2 * cfg.launched_prompts, 12)])
    cursor = PromptCursor(prompts, seed=seed, window=cfg.launched_prompts)
    pol = TailBatchingPolicy(cfg, cursor, replay_sampling(64, 0))
    engine = FakeEngine(concurrency=16, kv_capacity_tokens=1 << 30)
    for step in range(60):
        plan = pol.plan_step(step)
        queued = {p.prompt_id for p in pol.queue.snapshot()}
        if plan.round_kind is RoundKind.SHORT:
            assert not queued & {p.prompt_id for p in plan.prompts}
            assert len({p.prompt_id for p in plan.prompts}) == len(plan.prompts)
        pol.commit(run_round(engine, pol.open_round(plan)).result)
        ids = [p.prompt_id for p in pol.queue.snapshot()]
        assert len(ids) == len(set(ids))


def test_a_round_that_fails_leaves_nothing_running_so_its_rerun_starts_clean() -> None:
    """A round stopped by an error (a trainer that died under on_group) aborts its requests: the
    engine is left empty, so the step's re-run (new request ids: the attempt is in them) shares the
    engine with nothing of the failed attempt (on vLLM such leftovers take batch slots and, on
    CPU, draws of the engine-wide generator: the re-run would sample differently)."""
    import pytest

    cfg = RolloutConfig(prompts_per_step=2, responses_per_prompt=2)
    prompts = make_prompts([[3, 9], [4, 5], [20, 30], [6, 7]])

    def policy(attempt: str) -> SyncPolicy:
        cursor = PromptCursor(prompts, shuffle=False, epochs=1)
        return SyncPolicy(cfg, cursor, replay_sampling(64, 0), namespace=attempt)

    def dies(_g: object) -> None:
        raise RuntimeError("the trainer died")

    eng = FakeEngine()
    with pytest.raises(RuntimeError, match="the trainer died"):
        run_round(eng, policy("a1").open_round(policy("a1").plan_step(0)), on_group=dies)
    assert not eng.has_unfinished()
    rerun = run_round(eng, policy("a2").open_round(policy("a2").plan_step(0)))
    first = run_round(FakeEngine(), policy("a2").open_round(policy("a2").plan_step(0)))
    assert len(rerun.steps) == len(first.steps)
    assert [g.prompt.prompt_id for g in rerun.result.groups] == [
        g.prompt.prompt_id for g in first.result.groups
    ]
