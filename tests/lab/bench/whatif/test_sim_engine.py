"""SimEngine: the engine contract, and the same schedule as a token-by-token engine."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from rollpacker.core.config import RolloutConfig
from rollpacker.core.errors import EngineError
from rollpacker.core.trace import PRESETS, generate
from rollpacker.engines.fake import FakeEngine
from rollpacker.lab.bench.replay import BenchConfig, run_benchmark
from rollpacker.lab.bench.whatif.engine import SimEngine

# the port's contract tests, run on this engine (load_weights has its own test below: the shared
# one restores a real model's weights)
from tests.engines.test_engine_contract import (  # noqa: F401
    CONCURRENCY,
    _drain,
    _req,
    test_abort_stops_a_request_at_once,
    test_concurrency_limit_holds_and_every_request_finishes,
    test_counters_are_sane,
    test_greedy_is_reproducible_and_resume_continues_seamlessly,
    test_ignore_eos_generates_exactly_max_tokens_with_logprobs,
    test_request_ids_are_single_use,
)


@dataclass(frozen=True)
class LinearCost:
    """FakeEngine's timing model as a StepCost: base + per request, no prefill."""

    base_s: float = 0.0025
    per_seq_s: float = 0.00007
    kv_capacity_tokens: int = 1 << 30
    tp: int = 1
    label: str = "linear"

    def decode_s(self, batch: int, tokens: float) -> float:
        return self.base_s + self.per_seq_s * batch if batch else 0.0

    def prefill_s(self, contexts: Sequence[int]) -> float:
        return 0.0


@pytest.fixture
def engine():
    eng = SimEngine(LinearCost(kv_capacity_tokens=4096), concurrency=CONCURRENCY, max_skip=1)
    yield eng
    eng.close()


def test_load_weights_changes_what_is_served() -> None:
    eng = SimEngine(LinearCost())
    base, _, _, _ = _drain(eng, [_req(10, temperature=0.0)])
    eng.load_weights([("w", [1.0, 2.0])])
    changed, _, _, _ = _drain(eng, [_req(10, temperature=0.0)])
    assert next(iter(changed.values())) != next(iter(base.values()))
    with pytest.raises(EngineError, match="no tensors"):
        eng.load_weights([])


def test_one_step_runs_to_the_next_completion() -> None:
    eng = SimEngine(LinearCost(), concurrency=8)
    reqs = [_req(n) for n in (3, 10, 25)]
    toks, _, _, running = _drain(eng, reqs)
    assert running == [3, 2, 1]  # three events: each step ends when the next request finishes
    assert [len(toks[r.request_id]) for r in reqs] == [3, 10, 25]
    c = LinearCost()
    expect = 3 * c.decode_s(3, 0) + 7 * c.decode_s(2, 0) + 15 * c.decode_s(1, 0)
    assert eng.now() == pytest.approx(expect)


def test_balanced_replicas_price_the_busiest_share() -> None:
    one, two = SimEngine(LinearCost(), dp=1, concurrency=8), SimEngine(LinearCost(), dp=2, concurrency=4)
    _drain(one, [_req(5) for _ in range(8)])
    _drain(two, [_req(5) for _ in range(8)])
    c = LinearCost()
    assert one.now() == pytest.approx(5 * c.decode_s(8, 0))
    assert two.now() == pytest.approx(5 * c.decode_s(4, 0))
    assert two.concurrency == 8


def test_kv_pressure_preempts_and_every_request_still_finishes() -> None:
    eng = SimEngine(LinearCost(kv_capacity_tokens=60), concurrency=8)
    toks, _, reasons, _ = _drain(eng, [_req(20) for _ in range(6)])
    assert eng.num_preemptions() > 0
    assert len(reasons) == 6 and all(len(t) == 20 for t in toks.values())


def test_natural_stops_come_before_max_tokens_without_ignore_eos() -> None:
    eng = SimEngine(LinearCost(), concurrency=64, stop_prob=1 / 8)
    reqs = [_req(400, ignore_eos=False) for _ in range(40)]
    toks, _, reasons, _ = _drain(eng, reqs)
    lens = [len(toks[r.request_id]) for r in reqs]
    assert min(lens) < 400 and sum(lens) / len(lens) < 40  # geometric, mean 8
    assert {r.value for r in reasons.values()} >= {"stop"}


def _replay(engine) -> dict:
    records = generate(PRESETS["smoke"], seed=3)
    rc = RolloutConfig(prompts_per_step=8, responses_per_prompt=4, max_tokens=128)
    return run_benchmark(engine, records, BenchConfig(rc, scaledown_replicas=0))["policies"]


def test_skipping_ahead_changes_nothing_the_policies_see() -> None:
    """Every policy of the replay benchmark, skip-ahead vs one decode iteration a step on the same
    cost model: the same seconds, bubble ratio and tokens."""
    skip = _replay(SimEngine(LinearCost(), concurrency=64))
    token = _replay(SimEngine(LinearCost(), concurrency=64, max_skip=1))
    for name, t in token.items():
        s = skip[name]
        for key in ("steps", "tokens_generated", "tokens_wasted", "tokens_trained", "tokens_resumed"):
            assert s[key] == t[key], (name, key)
        assert s["rollout_time_s"] == pytest.approx(t["rollout_time_s"], rel=1e-9), name
        assert s["bubble_ratio"] == pytest.approx(t["bubble_ratio"], rel=1e-9), name
        assert s["engine_tokens"] == t["engine_tokens"], name


def test_the_schedule_is_fake_engines_where_nothing_is_resumed() -> None:
    """Against FakeEngine with the same timing model: identical for the policies that resume
    nothing. (FakeEngine reports a step's completions in batch order, SimEngine after the running
    requests, so the driver keeps a different last token of requests aborted on a completion;
    resuming policies regenerate a dropped one, and their schedules drift a little.)"""
    fake = _replay(FakeEngine(concurrency=64, base_s=0.0025, per_seq_s=0.00007))
    sim = _replay(SimEngine(LinearCost(), concurrency=64))
    for name in ("sync", "tail_batching", "sorted"):
        f, s = fake[name], sim[name]
        assert (s["steps"], s["tokens_trained"], s["aborted_requests"]) == (
            f["steps"],
            f["tokens_trained"],
            f["aborted_requests"],
        ), name
        assert s["rollout_time_s"] == pytest.approx(f["rollout_time_s"], rel=1e-9), name
        assert s["bubble_ratio"] == pytest.approx(f["bubble_ratio"], rel=1e-9), name
        assert 0 <= s["tokens_generated"] - f["tokens_generated"] <= f["aborted_requests"], name
    for name in ("sorted_partial", "partial"):
        assert sim[name]["rollout_time_s"] == pytest.approx(fake[name]["rollout_time_s"], rel=0.1), name
