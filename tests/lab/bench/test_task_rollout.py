"""The rollout benchmark's task mode: its arms, tail and speculation figures, estimate and table.

The arms run here on the simulated engine (the measurement itself needs vLLM and the warmed-up
model: ``rollpacker lab bench rollout-task``)."""

from __future__ import annotations

from typing import Any

import pytest

from rollpacker.core.config import config_from_text
from rollpacker.core.drafts import expected_tokens
from rollpacker.core.errors import ConfigError
from rollpacker.core.types import EngineStepStats, Prompt
from rollpacker.engines.fake import FakeEngine
from rollpacker.lab.bench.replay import PolicyRun, SampledResponse
from rollpacker.lab.bench.tables import MAX_COLUMNS
from rollpacker.lab.bench.task_rollout import (
    TaskBenchOptions,
    gpu_estimate,
    lossless_check,
    measured_bound,
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


def test_the_measured_bound_is_read_from_both_arms_engine_steps() -> None:
    plain, spec = PolicyRun(policy="tail_batching"), PolicyRun(policy="tail_batching+spec")
    # the plain arm: 6 s outside the tail, 2 s at batch 1 and 2 s at batch 4 (medians 10 ms, 20 ms)
    plain.engine_steps = [_step(32, 6.0, 32)] + [_step(1, 0.01, 1)] * 200 + [_step(4, 0.02, 4)] * 100
    # the speculative arm's tail steps lie on 5 ms + 2.5 ms per verified token
    spec.engine_steps = [_step(32, 6.0, 32)] + [
        _step(b, 0.005 + 0.0025 * (b + d), b + d, d, d // 2)
        for b, d in [(1, 0), (1, 3), (4, 0), (4, 8), (4, 12)]
    ]
    b = measured_bound(plain, spec, tail_batch=16, survival=[0.8, 0.6, 0.5])
    assert b is not None
    line = b["spec_step_s_line"]
    assert (line["intercept"], line["per_token"], line["points"]) == (
        pytest.approx(0.005),
        pytest.approx(0.0025),
        5,
    )
    assert b["tail_share"] == pytest.approx(0.4)
    assert b["plain_step_s_by_batch"] == {"1": pytest.approx(0.01), "4": pytest.approx(0.02)}
    at1 = max([1.0] + [(1 + sum([0.8, 0.6, 0.5][:k])) * 0.01 / (0.005 + 0.0025 * (k + 1)) for k in (1, 2, 3)])
    assert b["tail_speedup_by_batch"]["1"] == pytest.approx(at1)
    assert b["step_speedup"] < 1 / 0.6 and b["step_speedup"] > 1
    assert b["spec_step_s_by_tokens"]["16"] == {"median": pytest.approx(0.045), "steps": 1}
    assert measured_bound(plain, spec, tail_batch=16, survival=[0.0, 0.0]) is None  # nothing accepted


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
    report = run_arms(cfg, _prompts(80), engines, TaskBenchOptions(periods=1, max_steps=10, tail_batch=4))
    arms = report["arms"]
    assert list(arms) == ["sync", "sync+spec", "tail_batching", "tail_batching+spec", "partial+spec"]
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
        run_arms(
            config_from_text(CFG), _prompts(40), {"plain": FakeEngine()}, TaskBenchOptions(("partial+spec",))
        )
    with pytest.raises(ConfigError, match=r"periods 0.*each must be >= 1"):
        TaskBenchOptions(("sync",), periods=0)
    with pytest.raises(ConfigError, match=r"repeats 0.*each must be >= 1"):
        TaskBenchOptions(("sync",), repeats=0)


def test_acceptance_by_source_counts_the_arm_only() -> None:
    from rollpacker.lab.bench.task_rollout import acceptance_by_source

    before = ({"siblings": 10, "ngram": 4}, {"siblings": 5, "ngram": 1})
    after = ({"siblings": 30, "ngram": 4, "history": 8}, {"siblings": 15, "ngram": 1, "history": 6})
    got = acceptance_by_source(before, after)
    assert got == {
        "siblings": {"drafted": 20.0, "accepted": 10.0, "acceptance": 0.5},
        "history": {"drafted": 8.0, "accepted": 6.0, "acceptance": 0.75},
    }  # ngram drafted nothing in between: left out


def _two_engine_report(spec_engine: FakeEngine, repeats: int = 2) -> dict:
    engines = {"plain": FakeEngine(concurrency=64, stop_prob=1 / 24), "spec": spec_engine}
    opts = TaskBenchOptions(("tail_batching+spec",), periods=1, max_steps=10, tail_batch=4, repeats=repeats)
    return run_arms(config_from_text(CFG), _prompts(80), engines, opts)


def test_repeats_run_in_abba_order_and_the_ratios_are_paired_per_repeat() -> None:
    # the same tokens (the simulator's tokens depend on the context only), a faster engine
    report = _two_engine_report(FakeEngine(concurrency=64, stop_prob=1 / 24, base_s=0.0025), repeats=3)
    tb, spec = "tail_batching", "tail_batching+spec"
    assert report["settings"]["order"] == [[tb, spec, "sync"], [spec, tb, "sync"], [tb, spec, "sync"]]
    runs = report["runs"]
    assert [r["arm"] for r in runs] == [tb, spec, "sync", spec, tb, "sync", tb, spec, "sync"]
    assert all(len(r["load_avg_before"]) == 3 and len(r["load_avg_after"]) == 3 for r in runs)
    per = {(r["repeat"], r["arm"]): r for r in runs}
    s_tb = [per[(i, tb)]["rollout_s_per_step"] for i in range(3)]
    s_spec = [per[(i, spec)]["rollout_s_per_step"] for i in range(3)]
    assert report["arms"][tb]["repeats"]["rollout_s_per_step"]["values"] == s_tb
    pair = report["paired"][f"{spec} vs {tb}"]
    assert pair["speedup_s_per_step"]["per_repeat"] == pytest.approx(
        [a / b for a, b in zip(s_tb, s_spec, strict=True)]
    )
    assert pair["speedup_s_per_step"]["median"] > 1.5  # base_s halved: the speculative arm's steps are faster
    t_tb = [per[(i, tb)]["tail_tokens_per_s"] for i in range(3)]
    t_spec = [per[(i, spec)]["tail_tokens_per_s"] for i in range(3)]
    assert pair["tail_tokens_per_s_ratio"]["per_repeat"] == pytest.approx(
        [a / b for a, b in zip(t_spec, t_tb, strict=True)]
    )
    assert report["arms"][tb]["steps"] == sum(per[(i, tb)]["steps"] for i in range(3))  # pooled
    assert report["trained_prompts_identical"]
    assert report["lossless"]["same"] and report["lossless"]["prompts"] > 0
    text = render(report)
    assert "3 repeat(s)" in text and "paired per repeat" in text and "same distribution" in text
    assert max(len(line) for line in text.splitlines()) <= MAX_COLUMNS


class _DraftingEngine(FakeEngine):
    """The simulator with a draft history (``engines.base.DraftMemory``), recording when it empties."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.forgotten_at_step: list[int] = []
        self.steps_taken = 0

    def step(self) -> Any:
        self.steps_taken += 1
        return super().step()

    def remember_drafts(self, history: Any) -> int:
        return len(history)

    def forget_drafts(self) -> int:
        self.forgotten_at_step.append(self.steps_taken)
        return 0


def test_sync_with_drafts_trains_the_same_prompts_and_is_paired_with_sync() -> None:
    engines = {
        "plain": FakeEngine(concurrency=64, stop_prob=1 / 24),
        "spec": FakeEngine(concurrency=64, stop_prob=1 / 24, base_s=0.0025),
    }
    opts = TaskBenchOptions(
        ("sync+spec", "tail_batching+spec"), periods=1, max_steps=10, tail_batch=4, repeats=2
    )
    report = run_arms(config_from_text(CFG), _prompts(80), engines, opts)
    tb, spec = "tail_batching", "tail_batching+spec"
    assert report["settings"]["order"] == [[tb, spec, "sync", "sync+spec"], [spec, tb, "sync+spec", "sync"]]
    arms = report["arms"]
    assert list(arms) == ["sync", "sync+spec", tb, spec]
    assert arms["sync+spec"]["steps"] == arms["sync"]["steps"] == arms[tb]["steps"]
    assert report["trained_prompts_identical"]  # both sync arms: the prompts tail batching trained
    pair = report["paired"]["sync+spec vs sync"]
    assert pair is not None and pair["speedup_s_per_step"]["median"] > 1.5  # the faster engine
    assert set(report["paired"]) == {"tail_batching+spec vs tail_batching", "sync+spec vs sync"}
    assert "sync+spec vs sync, speedup in s/step" in render(report)


def test_every_repeat_starts_with_an_empty_draft_history() -> None:
    engine = _DraftingEngine(concurrency=64, stop_prob=1 / 24)
    _two_engine_report(engine, repeats=3)
    at = engine.forgotten_at_step
    assert len(at) == 3 and at[0] < at[1] < at[2]  # once per repeat, before it drafts anything


def test_k_chosen_counts_the_arm_only_and_pools_per_batch_bucket() -> None:
    from rollpacker.lab.bench.task_rollout import k_chosen, pooled_k

    before = {1: {4: 10}, 8: {0: 3}}
    after = {1: {4: 16, 2: 2}, 8: {0: 3}, 32: {0: 5}}
    assert k_chosen(before, after) == {"1": {"2": 2, "4": 6}, "32": {"0": 5}}  # 8 chose nothing new
    records = [
        {"arm": "tail_batching+spec", "k_by_batch": {"1": {"2": 2, "4": 6}}},
        {"arm": "tail_batching+spec", "k_by_batch": {"1": {"4": 2}, "32": {"0": 5}}},
        {"arm": "sync+spec", "k_by_batch": {"1": {"1": 100}}},
    ]
    assert pooled_k(records, "tail_batching+spec") == {
        "1": {"steps": 10, "mean_k": (2 * 2 + 4 * 8) / 10, "k": {"2": 2, "4": 8}},
        "32": {"steps": 5, "mean_k": 0.0, "k": {"0": 5}},
    }


class _CountingEngine(FakeEngine):
    """The simulator with a proposer's counters: every step chooses k = 3 at its batch's bucket."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.k_by_batch: dict[int, dict[int, int]] = {}
        self.before_arms: int | None = None  # steps taken before the first repeat (the warm-up's)

    def total(self) -> int:
        return sum(sum(per_k.values()) for per_k in self.k_by_batch.values())

    def remember_drafts(self, history: Any) -> int:
        return len(history)

    def forget_drafts(self) -> int:  # called as each repeat starts
        if self.before_arms is None:
            self.before_arms = self.total()
        return 0

    def step(self) -> Any:
        updates, stats = super().step()
        per_k = self.k_by_batch.setdefault(1 << max(stats.num_running - 1, 0).bit_length(), {})
        per_k[3] = per_k.get(3, 0) + 1
        return updates, stats

    def speculation_stats(self) -> Any:
        from types import SimpleNamespace

        return SimpleNamespace(
            drafted_by_source={},
            accepted_by_source={},
            k_by_batch={b: dict(v) for b, v in self.k_by_batch.items()},
        )


def test_the_report_gives_the_draft_lengths_chosen_per_batch_size() -> None:
    engine = _CountingEngine(concurrency=64, stop_prob=1 / 24)
    report = _two_engine_report(engine, repeats=2)
    spec = report["arms"]["tail_batching+spec"]
    per_bucket = spec["k_by_batch"]
    assert per_bucket and all(v["mean_k"] == 3.0 for v in per_bucket.values())
    counted = sum(v["steps"] for v in per_bucket.values())
    assert engine.before_arms  # the engine's warm-up stepped it before the arms
    assert counted == engine.total() - engine.before_arms  # the arms' steps, not the warm-up's
    assert "k_by_batch" not in report["arms"]["tail_batching"]  # the plain engine counts no drafts
    assert "draft length k chosen, mean by batch size" in render(report)


def test_the_lossless_check_catches_arms_that_sample_differently() -> None:
    report = _two_engine_report(FakeEngine(concurrency=64, stop_prob=1 / 6), repeats=1)
    assert report["lossless"]["same"] is False
    assert "DIFFERENT distributions" in render(report)


def _resp(step: int, pid: str, head: tuple[int, ...], natural: bool = True) -> SampledResponse:
    return SampledResponse(step, pid, len(head), natural, head)


def test_the_lossless_check_compares_first_launches_up_to_the_first_abort() -> None:
    def run(aborted_len: int, long_token: int) -> PolicyRun:
        r = PolicyRun(policy="x")
        r.responses = [_resp(0, f"p{i}", (i % 7 + 1, 2, 3, 4, 5, 6)) for i in range(40)]
        r.responses.append(_resp(0, "p0", (1, 2, 3, 9, 9, 9)[:aborted_len], natural=False))
        # a long round (step 1) relaunches a deferred prompt: not its first launch, left out
        r.responses += [_resp(1, "p1", (long_token,) * 6) for _ in range(20)]
        return r

    got = lossless_check([run(5, 11)], [run(4, 12)])
    assert got["positions"] == 4  # the shortest aborted response: 4 tokens
    assert got["responses"] == [41, 41] and got["prompts"] == 40
    assert got["same"]
    assert lossless_check([run(5, 11)], []) == {"skipped": "the arms launched no prompt in common"}


def test_the_command_refuses_bad_repeats_before_any_slow_work(tmp_path) -> None:
    from typer.testing import CliRunner

    from rollpacker.cli import app

    out = tmp_path / "r.json"
    res = CliRunner().invoke(app, ["lab", "bench", "rollout-task", "--repeats", "0", "--out", str(out)])
    assert res.exit_code == 2, res.output
    assert "repeats 0" in res.output and "each must be >= 1" in res.output
    assert not out.exists()
