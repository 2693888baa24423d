"""SortedRL and partial-rollout invariants, each by name, on randomized runs against the fake engine.

Every run bumps the policy version once per step (one update per step), so a token's version says
which step's weights sampled it and the lag of a trained token is measurable.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollpacker.core.config import PartialConfig, RolloutConfig, SortedConfig, SortedMode
from rollpacker.core.errors import PolicyError
from rollpacker.core.metrics import policy_lag
from rollpacker.core.policies.entries import BufferEntry, CachedSample, buffer_from_state
from rollpacker.core.policies.partial import PartialPolicy, drop_stale, scheduling_priority
from rollpacker.core.policies.sorted import SortedPolicy
from rollpacker.core.prompts import PromptCursor
from rollpacker.core.types import FinishReason
from rollpacker.engines.fake import FakeEngine
from rollpacker.lab.bench.replay import replay_sampling
from rollpacker.rollout.driver import run_round
from tests.conftest import make_prompts

MAX_LEN = 64
lens_strategy = st.lists(
    st.lists(st.integers(min_value=1, max_value=MAX_LEN), min_size=8, max_size=8), min_size=60, max_size=90
)


def _cfg(p0: int, r0: int, **kw) -> RolloutConfig:
    return RolloutConfig(prompts_per_step=p0, responses_per_prompt=r0, max_tokens=MAX_LEN, **kw)


def _sorted(cfg: RolloutConfig, prompts) -> SortedPolicy:
    cursor = PromptCursor(prompts, shuffle=False, epochs=1)
    return SortedPolicy(cfg, cursor, replay_sampling(MAX_LEN, 0), {p.prompt_id: p for p in prompts})


def _partial(cfg: RolloutConfig, prompts, in_flight: int) -> PartialPolicy:
    cursor = PromptCursor(prompts, shuffle=False, epochs=1)
    return PartialPolicy(
        cfg, cursor, replay_sampling(MAX_LEN, 0), {p.prompt_id: p for p in prompts}, in_flight
    )


def _run(pol, steps: int, concurrency: int = 32, restart_every: int = 0):
    """Run ``steps`` steps (fewer when the dataset runs out), version = step. With
    ``restart_every`` the policy is rebuilt from its buffer serialized as the state would hold it."""
    engine = FakeEngine(concurrency=concurrency)
    runs = []
    for step in range(steps):
        if isinstance(pol, PartialPolicy):
            pol.policy_version = step
        try:
            plan = pol.plan_step(step)
        except PolicyError as e:
            if "used up" in str(e):
                break
            raise
        rr = run_round(engine, pol.open_round(plan), policy_version=step)
        pol.commit(rr.result)
        runs.append(rr)
        if restart_every and (step + 1) % restart_every == 0:
            docs = [BufferEntry.from_dict(e.to_dict()) for e in pol.buffer]  # a state round trip
            pol.buffer = buffer_from_state(docs, lambda _i: True)
    return runs


configs = st.tuples(st.integers(1, 6), st.integers(1, 4))


@settings(max_examples=40, deadline=None)
@given(pr=configs, n=st.integers(1, 4), mode=st.sampled_from(list(SortedMode)), lens=lens_strategy)
def test_sorted_exactly_p0_groups_and_bounded_wait(pr, n, mode, lens) -> None:
    """SortedRL never starves a prompt: loaded at step s, trained by step s + n - 1."""
    p0, r0 = pr
    cfg = _cfg(p0, r0, policy="sorted", sorted=SortedConfig(mode=mode, group_size=n))
    prompts = make_prompts(lens)
    pol = _sorted(cfg, prompts)
    runs = _run(pol, steps=4 * n + 3)
    assert runs
    loaded_at: dict[str, int] = {}
    trained: Counter[str] = Counter()
    for rr in runs:
        plan = rr.result.plan
        if not plan.from_queue:  # a fresh group was loaded into the empty buffer
            assert len(plan.prompts) == n * p0
            for p in plan.prompts:
                loaded_at[p.prompt_id] = plan.step
        assert len(rr.result.groups) == p0
        for g in rr.result.groups:
            assert len(g.responses) == r0
            assert all(c.finish_reason.is_natural for c in g.responses)
            assert plan.step - loaded_at[g.prompt.prompt_id] <= n - 1
            trained[g.prompt.prompt_id] += 1
    assert set(trained.values()) == {1}, "a prompt was trained twice"
    buffered = {e.prompt_id for e in pol.buffer}
    assert not buffered & set(trained)
    assert set(loaded_at) == set(trained) | buffered


@settings(max_examples=40, deadline=None)
@given(pr=configs, n=st.integers(1, 4), lens=lens_strategy)
def test_sorted_on_policy_never_trains_a_token_from_an_older_policy(pr, n, lens) -> None:
    p0, r0 = pr
    cfg = _cfg(p0, r0, policy="sorted", sorted=SortedConfig(mode=SortedMode.ON_POLICY, group_size=n))
    runs = _run(_sorted(cfg, make_prompts(lens)), steps=3 * n)
    for rr in runs:
        step = rr.result.plan.step
        for g in rr.result.groups:
            for c in g.responses:
                assert c.resumed_tokens == 0
                assert set(c.token_versions) == {step}
        assert rr.metrics.policy_lag == 0.0 and rr.metrics.tokens_cached == 0
        assert not rr.result.cached


def _check_resumed_tokens_keep_their_logprobs(runs) -> int:
    """Every trained response that resumed a cached one starts with exactly the cached tokens,
    logprobs and versions; returns how many resumed responses were checked."""
    cache: dict[tuple[str, int], object] = {}
    checked = 0
    for rr in runs:
        for g in rr.result.groups:
            for c in g.responses:
                if c.resumed_tokens:
                    old = cache[(c.prompt_id, c.sample_index)]
                    n = old.num_tokens
                    assert c.resumed_tokens == n
                    assert c.token_ids[:n] == old.token_ids
                    assert c.logprobs[:n] == old.logprobs
                    assert c.token_versions[:n] == old.token_versions
                    assert c.token_versions[n:] == (rr.result.plan.step,) * (c.num_tokens - n)
                    checked += 1
        for c in rr.result.cached:
            cache[(c.prompt_id, c.sample_index)] = c
    return checked


@settings(max_examples=30, deadline=None)
@given(pr=configs, n=st.integers(2, 4), lens=lens_strategy, restart=st.sampled_from([0, 1, 2]))
def test_sorted_partial_resumed_tokens_keep_their_logprobs_and_versions(pr, n, lens, restart) -> None:
    p0, r0 = pr
    cfg = _cfg(p0, r0, policy="sorted", sorted=SortedConfig(mode=SortedMode.PARTIAL, group_size=n))
    runs = _run(_sorted(cfg, make_prompts(lens)), steps=3 * n, concurrency=8, restart_every=restart)
    _check_resumed_tokens_keep_their_logprobs(runs)


def test_sorted_partial_resumes_and_lags_on_a_long_tail() -> None:
    """A concrete long tail: the partial mode resumes cached tokens and its lag is positive."""
    lens = [[60, 3, 3, 3]] * 2 + [[3, 3, 3, 3]] * 14
    cfg = _cfg(2, 4, policy="sorted", sorted=SortedConfig(mode=SortedMode.PARTIAL, group_size=4))
    runs = _run(_sorted(cfg, make_prompts(lens)), steps=4, concurrency=64)
    assert _check_resumed_tokens_keep_their_logprobs(runs) >= 2
    assert runs[-1].metrics.policy_lag > 0  # the last step trains the long responses' older tokens
    assert sum(rr.metrics.tokens_wasted for rr in runs) == 0  # partial mode throws nothing away
    # selective batching: each update lists its groups shortest first
    for rr in runs:
        means = [sum(c.num_tokens for c in g.responses) / len(g.responses) for g in rr.result.groups]
        assert means == sorted(means)


@settings(max_examples=30, deadline=None)
@given(
    pr=configs,
    lens=lens_strategy,
    bound=st.integers(0, 3),
    in_flight=st.sampled_from([4, 16, 48]),
    restart=st.sampled_from([0, 1]),
)
def test_partial_staleness_bound_and_resumed_tokens(pr, lens, bound, in_flight, restart) -> None:
    p0, r0 = pr
    cfg = _cfg(p0, r0, policy="partial", partial=PartialConfig(max_staleness=bound))
    prompts = make_prompts(lens)
    pol = _partial(cfg, prompts, in_flight)
    runs = _run(pol, steps=10, concurrency=16, restart_every=restart)
    assert runs
    _check_resumed_tokens_keep_their_logprobs(runs)
    trained: Counter[str] = Counter()
    for rr in runs:
        step = rr.result.plan.step
        assert len(rr.result.groups) == p0
        lag = policy_lag([c.token_versions for g in rr.result.groups for c in g.responses], step)
        assert lag.max <= bound
        trained.update(g.prompt.prompt_id for g in rr.result.groups)
    assert set(trained.values()) == {1}
    # every prompt the cursor handed out is trained or cached, never both, never neither
    drawn = {p.prompt_id for p in prompts[: pol.cursor.state.position]}
    cached = {e.prompt_id for e in pol.buffer}
    assert not cached & set(trained)
    assert drawn == set(trained) | cached


def test_partial_supplements_to_keep_the_engine_full_and_interrupts_the_rest() -> None:
    lens = [[40, 40, 40, 40]] * 2 + [[2, 2, 2, 2]] * 60
    cfg = _cfg(8, 4, policy="partial")
    pol = _partial(cfg, make_prompts(lens), in_flight=16)
    (rr,) = _run(pol, steps=1, concurrency=16)
    # 2 long prompts hold 8 slots; as short prompts finish, new ones keep 16 requests running
    assert len(rr.steps) >= 8
    assert all(s.num_running == 16 for s in rr.steps)
    assert {g.prompt.prompt_id for g in rr.result.groups}.isdisjoint({"p000", "p001"})
    # the long prompts were interrupted and cached with their tokens, nothing was thrown away
    assert rr.result.cached and rr.metrics.tokens_wasted == 0
    assert all(c.finish_reason is FinishReason.ABORT and c.num_tokens > 0 for c in rr.result.cached)
    assert {e.prompt_id for e in pol.buffer} >= {c.prompt_id for c in rr.result.cached}


def _sample(idx: int, n: int, version: int, finished: bool) -> CachedSample:
    return CachedSample(
        sample_index=idx,
        token_ids=tuple(range(3, 3 + n)),
        logprobs=tuple(-0.5 for _ in range(n)),
        versions=(version,) * n,
        finish_reason=FinishReason.STOP if finished else None,
        request_id=f"r{idx}",
    )


def test_prompt_manager_priority_is_the_recipes_key() -> None:
    a = BufferEntry("a", 0, (_sample(0, 10, 5, True), _sample(1, 4, 5, False)))  # 3 unfinished (R0=4)
    b = BufferEntry("b", 0, (_sample(0, 30, 5, True), _sample(1, 30, 5, True), _sample(2, 2, 3, False)))
    c = BufferEntry("c", 0, (_sample(0, 10, 4, True), _sample(1, 10, 4, True), _sample(2, 2, 6, False)))
    assert scheduling_priority(a, 6, 4) == (3, 10.0, 1)
    assert scheduling_priority(b, 6, 4) == (2, 30.0, 3)
    assert scheduling_priority(c, 6, 4) == (2, 10.0, 2)
    assert scheduling_priority(BufferEntry("d", 0), 6, 4) == (4, 1e9, 0)
    order = sorted([a, b, c, BufferEntry("d", 0)], key=lambda e: scheduling_priority(e, 6, 4))
    assert [e.prompt_id for e in order] == ["c", "b", "a", "d"]
    # the staleness bound drops only the samples older than it
    assert [s.sample_index for s in drop_stale(b, 6, 2).samples] == [0, 1]
    assert drop_stale(b, 6, 3) is b


@given(
    st.lists(
        st.tuples(st.integers(0, 7), st.integers(0, 40), st.integers(0, 9), st.booleans()),
        max_size=6,
        unique_by=lambda t: t[0],
    )
)
def test_buffer_entries_round_trip_through_the_state_document(samples) -> None:
    import json

    entry = BufferEntry("p1", 3, tuple(_sample(i, n, v, f) for i, n, v, f in samples))
    doc = json.loads(json.dumps([entry.to_dict()]))
    assert buffer_from_state([BufferEntry.from_dict(d) for d in doc], lambda _i: True) == [entry]


def test_a_corrupt_or_foreign_buffer_is_refused_by_name() -> None:
    good = BufferEntry("p1", 0, (_sample(0, 3, 1, False),))
    with pytest.raises(PolicyError, match="another dataset"):
        buffer_from_state([good], lambda i: i != "p1")
    bad = dataclasses.replace(BufferEntry("p1", 0), samples=()).to_dict()
    bad["samples"] = [{"sample_index": 0, "token_ids": [1, 2], "logprobs": [0.0], "versions": [[0, 2]]}]
    with pytest.raises(PolicyError, match="2 tokens, 1 logprobs"):
        BufferEntry.from_dict(bad)
    with pytest.raises(PolicyError, match="twice"):
        buffer_from_state([good, good], lambda _i: True)


def test_an_on_policy_arm_refuses_a_buffer_with_cached_tokens() -> None:
    cfg = _cfg(2, 2, policy="sorted")
    prompts = make_prompts([[3, 3]] * 10)
    with pytest.raises(PolicyError, match="on_policy"):
        SortedPolicy(
            cfg,
            PromptCursor(prompts, shuffle=False),
            replay_sampling(MAX_LEN, 0),
            {p.prompt_id: p for p in prompts},
            buffer=[BufferEntry(prompts[0].prompt_id, 0, (_sample(0, 3, 0, False),))],
        )


def test_policy_lag_is_token_weighted_and_refuses_future_tokens() -> None:
    lag = policy_lag([(3, 3, 3, 5), (5, 5)], 5)
    assert lag.mean == pytest.approx(6 / 6) and lag.max == 2 and lag.off_policy_frac == pytest.approx(0.5)
    assert policy_lag([], 4).mean == 0.0
    with pytest.raises(ValueError, match="ahead"):
        policy_lag([(6,)], 5)


def test_partial_never_restarts_a_slow_response_and_trains_it_when_due() -> None:
    """A response longer than the bound's worth of steps still gets trained: once its oldest token
    is max_staleness versions old the prompt is due, is not interrupted again, and is trained."""
    lens = [[60, 60]] + [[2, 2]] * 200
    cfg = _cfg(2, 2, policy="partial", partial=PartialConfig(max_staleness=2))
    pol = _partial(cfg, make_prompts(lens), in_flight=4)
    runs = _run(pol, steps=6, concurrency=4)
    steps_of = {g.prompt.prompt_id: rr.result.plan.step for rr in runs for g in rr.result.groups}
    assert "p000" in steps_of, "the long prompt was never trained"
    step = steps_of["p000"]
    (long_group,) = [g for g in runs[step].result.groups if g.prompt.prompt_id == "p000"]
    for c in long_group.responses:
        assert c.num_tokens == 60  # resumed, never regenerated from scratch
        assert min(c.token_versions) == 0 and step - min(c.token_versions) <= 2
    assert step == 2  # first cached at step 0, due at step 2, trained there
    assert sum(rr.metrics.tokens_wasted for rr in runs) == 0
    # while the step waits for the due prompt, no prompt is started that the full update cannot take
    assert all(len(rr.result.deferred) <= 2 for rr in runs)


def test_groups_complete_from_the_cache_reach_the_stream_even_without_an_engine_step() -> None:
    """A step whose update the cache alone fills runs no engine step; its groups must still be
    handed to the rewards and the trainer (the pipeline's drain waits for them)."""
    prompts = make_prompts([[3, 3]] * 6)
    by_id = {p.prompt_id: p for p in prompts}
    done = tuple(
        BufferEntry(p.prompt_id, 0, (_sample(0, 3, 1, True), _sample(1, 4, 1, True))) for p in prompts[:2]
    )
    cfg = _cfg(2, 2, policy="partial")
    pol = PartialPolicy(
        cfg, PromptCursor(prompts[2:], shuffle=False), replay_sampling(MAX_LEN, 0), by_id, 2, list(done), 1
    )
    got = []
    rr = run_round(FakeEngine(), pol.open_round(pol.plan_step(1)), policy_version=1, on_group=got.append)
    assert not rr.steps and sorted(g.prompt.prompt_id for g in got) == ["p000", "p001"]
    assert {g.prompt.prompt_id for g in rr.result.groups} == {"p000", "p001"}


def test_the_stored_buffer_round_trips_and_a_foreign_document_is_refused() -> None:
    from rollpacker.core.policies.entries import buffer_from_json, buffer_to_json

    entries = (BufferEntry("p1", 2, (_sample(0, 3, 1, False), _sample(1, 2, 2, True))), BufferEntry("p2", 3))
    assert buffer_from_json(buffer_to_json(entries), "s3://b/buf.json") == entries
    with pytest.raises(PolicyError, match=r"s3://b/x\.json: not a rollout buffer"):
        buffer_from_json('{"entries": [], "extra": 1}', "s3://b/x.json")
    with pytest.raises(PolicyError, match=r"s3://b/x\.json: not JSON"):
        buffer_from_json("{", "s3://b/x.json")


@pytest.mark.parametrize("mode", list(SortedMode))
def test_sorted_keeps_the_engine_at_its_running_capacity_while_the_buffer_holds_more(mode) -> None:
    """Oversubscription (SortedRL section 3.1): with the engine's running capacity Q below the
    group's requests, every engine step of every round runs Q requests as long as the buffer still
    owes at least Q unfinished requests (and all it owes once it owes fewer): nothing is held back
    until a batch drains."""
    p0, r0, n, q = 4, 2, 4, 12  # a group is 32 requests, Q = 12
    lens = [[(7 * i + 3 * j) % 29 + 2 for j in range(r0)] for i in range(48)]
    cfg = _cfg(p0, r0, policy="sorted", sorted=SortedConfig(mode=mode, group_size=n))
    pol = _sorted(cfg, make_prompts(lens))
    engine = FakeEngine(concurrency=q)
    oversubscribed = 0
    for step in range(2 * n):
        plan = pol.plan_step(step)
        cached = {e.prompt_id: len(e.finished) for e in pol.buffer}
        owed = sum(r0 - cached.get(p.prompt_id, 0) for p in plan.prompts)  # unfinished requests
        under: list[tuple[int, int]] = []
        done = [0]  # requests finished before the engine step being checked

        def on_step(stats, completed, owed=owed, under=under, done=done) -> None:
            want = min(q, owed - done[0])
            if stats.num_running != want:
                under.append((stats.num_running, want))
            done[0] = completed

        rr = run_round(engine, pol.open_round(plan), policy_version=step, on_step=on_step)
        pol.commit(rr.result)
        assert not under, f"step {step}: engine under-filled (running, wanted) {under[:5]}"
        oversubscribed += owed > q
    assert oversubscribed >= n  # most rounds of the two groups launch more than Q requests
