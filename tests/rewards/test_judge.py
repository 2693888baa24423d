"""The LLM judge reward: the reward port's invariants, batching, offload, and a warmed-up judge."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from rollpacker.core.errors import ConfigError
from rollpacker.core.tasks import RewardKind, TaskExample
from rollpacker.rewards.base import RewardFunction, RewardRequest, RewardStatus
from rollpacker.rewards.judge import JudgeConfig, JudgeReward
from rollpacker.tasks.judge_task import (
    JUDGE_EVAL_SEED_OFFSET,
    JudgePair,
    JudgeWarmupSpec,
    judge_info,
    judge_pairs,
    warm_up_judge,
)
from rollpacker.tasks.tiny_model import build_tiny_model

TOL = 1e-5


@pytest.fixture(scope="module")
def model_dir() -> Path:
    """An untrained tiny model: any HF causal LM directory can serve as the judge."""
    return build_tiny_model("tiny")


def _req(pair: JudgePair, i: int) -> RewardRequest:
    ex = TaskExample(f"j{i}", pair.problem, RewardKind.JUDGE, reference=pair.reference)
    return RewardRequest(f"s{i}", ex, pair.response)


def test_is_a_reward_function_and_resolves_every_future(model_dir) -> None:
    pairs = judge_pairs(12, seed=11)
    with JudgeReward(model_dir, JudgeConfig(max_batch=4)) as judge:
        assert isinstance(judge, RewardFunction) and judge.kind is RewardKind.JUDGE
        futures = [judge.submit(_req(p, i)) for i, p in enumerate(pairs)]
        results = [f.result(timeout=120) for f in futures]
        assert judge.batches >= 3  # at most 4 per batch
    for i, r in enumerate(results):
        assert r.sample_id == f"s{i}"
        assert r.status is RewardStatus.OK
        assert 0.0 <= r.reward <= 1.0
        assert r.correct == (r.reward > 0.5)
        assert r.detail.startswith("P(yes) = ")


def test_a_score_does_not_depend_on_its_batch(model_dir) -> None:
    prompts = [p.prompt() for p in judge_pairs(7, seed=12)]
    prompts[3] = "1\n1"  # a much shorter row
    with JudgeReward(model_dir) as judge:
        batched = judge.score_prompts(prompts)
        single = [judge.score_prompts([p])[0] for p in prompts]
    assert max(abs(a - b) for a, b in zip(batched, single, strict=True)) <= TOL


@pytest.mark.parametrize("config", [JudgeConfig(resident_layers=0), JudgeConfig(resident_layers=3)])
def test_offloaded_judge_scores_equal_the_resident_judge(model_dir, config) -> None:
    pairs = judge_pairs(8, seed=13)
    with JudgeReward(model_dir) as resident, JudgeReward(model_dir, config) as offloaded:
        want = [resident.submit(_req(p, i)).result(timeout=120).reward for i, p in enumerate(pairs)]
        got = [offloaded.submit(_req(p, i)).result(timeout=120).reward for i, p in enumerate(pairs)]
        assert offloaded.offload is not None and offloaded.offload.stats().layers_streamed > 0
    assert max(abs(a - b) for a, b in zip(want, got, strict=True)) <= TOL


def test_memory_budget_chooses_resident_layers_per_batch(model_dir) -> None:
    prompts = [p.prompt() for p in judge_pairs(8, seed=14)]
    with JudgeReward(model_dir) as resident:
        want = resident.score_prompts(prompts)
    probe = JudgeReward(model_dir, JudgeConfig(resident_layers=0))
    runner = probe.offload
    assert runner is not None
    seq_len = max(len(probe.tokenizer.encode(p)) for p in prompts)
    budget = runner.expected_weight_bytes(4) + runner.kv_bytes_per_token() * seq_len  # all layers, batch 1
    probe.close()
    with JudgeReward(model_dir, JudgeConfig(memory_budget_bytes=budget)) as judge:
        one = judge.score_prompts(prompts[:1])
        eight = judge.score_prompts(prompts)
        assert judge.resident_layers_used[0] == 4 and judge.resident_layers_used[1] < 4
    assert abs(one[0] - want[0]) <= TOL
    assert max(abs(a - b) for a, b in zip(eight, want, strict=True)) <= TOL


def test_a_sample_that_cannot_fit_the_budget_is_an_error(model_dir) -> None:
    with JudgeReward(model_dir, JudgeConfig(memory_budget_bytes=1000)) as judge:
        r = judge.submit(_req(judge_pairs(2, seed=1)[0], 0)).result(timeout=60)
    assert r.status is RewardStatus.ERROR and not r.correct and r.reward == 0.0
    assert "even with every layer offloaded" in r.detail


def test_misuse_raises(model_dir, tmp_path) -> None:
    with JudgeReward(model_dir) as judge, pytest.raises(ConfigError, match="not 'judge'"):
        judge.submit(RewardRequest("m", TaskExample("m", "q", RewardKind.MATH, reference="1"), "1"))
    with pytest.raises(RuntimeError, match="closed"):
        judge.submit(_req(judge_pairs(2, seed=1)[0], 0))
    with pytest.raises(ConfigError, match=r"no config\.json"):
        JudgeReward(tmp_path)
    with pytest.raises(ConfigError, match="not both"):
        JudgeConfig(resident_layers=1, memory_budget_bytes=10**9)
    with pytest.raises(ConfigError, match="the judge has 4 layers"):
        JudgeReward(model_dir, JudgeConfig(resident_layers=9))


class _Gated(JudgeReward):
    """Blocks in its first batch until ``gate`` is set, so later requests stay queued."""

    def __init__(self, *args, **kwargs) -> None:
        self.entered, self.gate = threading.Event(), threading.Event()
        super().__init__(*args, **kwargs)

    def score_prompts(self, prompts):
        self.entered.set()
        assert self.gate.wait(timeout=60)
        return super().score_prompts(prompts)


def test_close_resolves_queued_as_error_finishes_in_flight_and_is_idempotent(model_dir) -> None:
    pairs = judge_pairs(4, seed=15)
    judge = _Gated(model_dir)
    first = judge.submit(_req(pairs[0], 0))
    assert judge.entered.wait(timeout=60)
    queued = [judge.submit(_req(p, i)) for i, p in enumerate(pairs[1:], start=1)]
    closer = threading.Thread(target=judge.close)
    closer.start()
    for f in queued:  # resolved by close() while the first batch is still being scored
        r = f.result(timeout=60)
        assert r.status is RewardStatus.ERROR and "closed" in r.detail
    assert not first.done()
    judge.gate.set()
    closer.join(timeout=60)
    assert first.result(timeout=1).status is RewardStatus.OK
    assert not judge._thread.is_alive()
    judge.close()  # idempotent


def test_a_failing_batch_resolves_as_error_and_the_judge_goes_on(model_dir) -> None:
    class FailOnce(JudgeReward):
        calls = 0

        def score_prompts(self, prompts):
            FailOnce.calls += 1
            if FailOnce.calls == 1:
                raise RuntimeError("device lost")
            return super().score_prompts(prompts)

    pairs = judge_pairs(2, seed=16)
    with FailOnce(model_dir) as judge:
        bad = judge.submit(_req(pairs[0], 0)).result(timeout=60)
        good = judge.submit(_req(pairs[1], 1)).result(timeout=60)
    assert bad.status is RewardStatus.ERROR and "device lost" in bad.detail
    assert good.status is RewardStatus.OK


# --- the warmed-up judge --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def warm_judge_dir() -> Path:
    return warm_up_judge(JudgeWarmupSpec())  # cached after the first run (~2-3 min on 2 cores)


@pytest.mark.slow
def test_warmed_up_judge_tells_right_from_wrong(warm_judge_dir) -> None:
    info = judge_info(warm_judge_dir)
    assert info["heldout_accuracy"] >= 0.75, info
    pairs = judge_pairs(64, seed=JUDGE_EVAL_SEED_OFFSET + 99)
    with JudgeReward(warm_judge_dir, JudgeConfig(max_batch=32)) as judge:
        results = [f.result(timeout=120) for f in [judge.submit(_req(p, i)) for i, p in enumerate(pairs)]]
    right = [r.reward for r, p in zip(results, pairs, strict=True) if p.label]
    wrong = [r.reward for r, p in zip(results, pairs, strict=True) if not p.label]
    assert sum(right) / len(right) - sum(wrong) / len(wrong) >= 0.3, (right, wrong)
    acc = sum(r.correct == p.label for r, p in zip(results, pairs, strict=True)) / len(pairs)
    assert acc >= 0.7, acc
    # the same response judged against its own reference: right vs a wrong final answer
    p = pairs[0]
    with JudgeReward(warm_judge_dir, JudgeConfig(resident_layers=1)) as judge:
        yes = judge.score(p.problem, p.reference, p.reference)
        digit = p.reference[-1]
        no = judge.score(p.problem, p.reference[:-1] + str((int(digit) + 5) % 10), p.reference)
    assert yes > 0.5 > no, (yes, no)
