"""The rollout benchmark's task mode: its arms, tail and speculation figures, estimate and table.

The arms run here on the simulated engine (the measurement itself needs vLLM and the warmed-up
model: ``rollpacker lab bench rollout-task``)."""

from __future__ import annotations

import pytest

from rollpacker.core.config import config_from_text
from rollpacker.core.drafts import expected_tokens
from rollpacker.core.errors import ConfigError
from rollpacker.core.types import EngineStepStats, Prompt
from rollpacker.engines.fake import FakeEngine
from rollpacker.lab.bench.replay import PolicyRun
from rollpacker.lab.bench.tables import MAX_COLUMNS
from rollpacker.lab.bench.task_rollout import (
    gpu_estimate,
    render,
    run_arms,
    spec_stats,
    tail_stats,
    task_arms,
)


def _step(running: int, seconds: float, tokens: int, drafted: int = 0, accepted: int = 0) -> EngineStepStats:
    return EngineStepStats(
        start_s=0.0,
        duration_s=seconds,
        num_running=running,
        num_waiting=0,
        num_preemptions_total=0,
        kv_cache_usage=0.0,
        new_tokens=tokens,
        spec_draft_tokens=drafted,
        spec_accepted_tokens=accepted,
        spec_draft_s=0.01 if drafted else 0.0,
    )


def test_the_baseline_arms_always_run_and_unknown_arms_are_refused() -> None:
    assert task_arms("partial+spec") == ("sync", "tail_batching", "partial+spec")
    assert task_arms(["tail_batching+spec", "sync"]) == ("sync", "tail_batching", "tail_batching+spec")
    with pytest.raises(ConfigError, match=r"sorted\+spec'\]: unknown"):
        task_arms("sorted+spec")


def test_tail_and_speculation_figures_count_only_their_steps() -> None:
    run = PolicyRun(policy="x")
    run.engine_steps = [
        _step(64, 1.0, 64),
        _step(20, 0.5, 20),
        _step(4, 0.25, 10, 8, 6),
        _step(1, 0.25, 3, 4, 2),
    ]
    t = tail_stats(run, tail_batch=16)
    assert t["tail_tokens"] == 13 and t["tail_s"] == 0.5
    assert t["tail_tokens_per_s"] == 26 and t["tail_share"] == pytest.approx(0.25)
    s = spec_stats(run)
    assert s["spec_steps"] == 2 and s["drafted"] == 12 and s["accepted"] == 8
    assert s["acceptance"] == pytest.approx(8 / 12) and s["accepted_per_spec_step"] == 4


def test_gpu_estimate_follows_the_expected_tokens_per_step() -> None:
    assert gpu_estimate(0.5, 0.0, 4)["rollout_speedup"] == pytest.approx(1.0)
    est = gpu_estimate(0.6, 0.7, 4)
    per = expected_tokens(0.7, 4)
    assert est["tokens_per_tail_step"] == pytest.approx(per)
    assert est["rollout_speedup"] == pytest.approx(1 / (0.4 + 0.6 / per))
    assert gpu_estimate(1.0, 0.7, 4)["rollout_speedup"] == pytest.approx(per)  # all tail: the per-step gain


CFG = """
rollout:
  prompts_per_step: 4
  responses_per_prompt: 4
  eta_p: 1.5
  eta_r: 1.5
  max_tokens: 96
"""


def _prompts(n: int) -> list[Prompt]:
    return [Prompt(prompt_id=f"p{i}", token_ids=(5 + i % 50, 7, 9), dataset_index=i) for i in range(n)]


def test_the_arms_run_on_the_same_prompts_and_the_report_explains_itself() -> None:
    cfg = config_from_text(CFG)
    engines = {"plain": FakeEngine(concurrency=64, stop_prob=1 / 24), "spec": FakeEngine(concurrency=64)}
    report = run_arms(cfg, _prompts(80), engines, periods=1, max_steps=10, tail_batch=4)
    arms = report["arms"]
    assert list(arms) == ["sync", "tail_batching", "tail_batching+spec", "partial+spec"]
    tb = arms["tail_batching"]
    assert tb["long_rounds"] == 1 and tb["steps"] == arms["sync"]["steps"] == arms["partial+spec"]["steps"]
    assert report["trained_prompts_identical"]
    assert arms["sync"]["speedup_vs_sync"] == 1.0 and tb["speedup_vs_tail_batching"] == 1.0
    assert arms["sync"]["speedup_vs_tail_batching"] == pytest.approx(
        tb["rollout_s_per_step"] / arms["sync"]["rollout_s_per_step"]
    )
    assert 0 < tb["tail_share"] < 1 and tb["tail_tokens_per_s"] > 0
    assert report["settings"]["drafts_sampled"] is False  # the simulator does not draft
    assert report["gpu_estimate"] is None  # nothing was accepted, nothing to extrapolate
    text = render(report)
    assert "ran on the plain engine" in text and "legend:" in text
    assert max(len(line) for line in text.splitlines()) <= MAX_COLUMNS


def test_the_spec_arms_need_an_engine_that_drafts() -> None:
    with pytest.raises(ConfigError, match="engines\\['spec'\\]"):
        run_arms(config_from_text(CFG), _prompts(40), {"plain": FakeEngine()}, arms="partial+spec")
    with pytest.raises(ConfigError, match="periods 0"):
        run_arms(config_from_text(CFG), _prompts(40), {"plain": FakeEngine()}, arms="sync", periods=0)


def test_acceptance_by_source_counts_the_arm_only() -> None:
    from rollpacker.lab.bench.task_rollout import acceptance_by_source

    before = ({"siblings": 10, "ngram": 4}, {"siblings": 5, "ngram": 1})
    after = ({"siblings": 30, "ngram": 4, "history": 8}, {"siblings": 15, "ngram": 1, "history": 6})
    got = acceptance_by_source(before, after)
    assert got == {
        "siblings": {"drafted": 20.0, "accepted": 10.0, "acceptance": 0.5},
        "history": {"drafted": 8.0, "accepted": 6.0, "acceptance": 0.75},
    }  # ngram drafted nothing in between: left out
