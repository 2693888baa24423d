from __future__ import annotations

import random

import pytest

from rollpacker.core.metrics import (
    acceptance_by_position,
    bubble_parts,
    bubble_ratio,
    percentile,
    rollout_metrics,
    sum_per_position,
)
from rollpacker.core.types import EngineStepStats, RoundKind, RoundResult, StepPlan


def _st(dur: float, running: int) -> EngineStepStats:
    return EngineStepStats(
        start_s=0,
        duration_s=dur,
        num_running=running,
        num_waiting=0,
        num_preemptions_total=0,
        kv_cache_usage=0,
    )


def test_bubble_ratio_matches_eq4_by_hand() -> None:
    # Q=4: a step of 1 s with 4 running, then 3 s with 1 running -> bubble (0*1 + 3*3)/(4*4).
    steps = [_st(1.0, 4), _st(3.0, 1)]
    assert bubble_ratio(steps, 4.0, 4) == pytest.approx(9 / 16)


def test_bubble_ratio_counts_gaps_and_full_engine() -> None:
    assert bubble_ratio([_st(2.0, 8)], 2.0, 8) == pytest.approx(0.0)
    # 1 s of the runtime's own time between steps is bubble.
    assert bubble_ratio([_st(2.0, 8)], 3.0, 8) == pytest.approx(1 / 3)
    with pytest.raises(ValueError):
        bubble_ratio([], 1.0, 0)


def test_bubble_parts_split_eq4_into_time_between_steps_and_empty_slots() -> None:
    # Q=4 over 5 s: 1 s full, 3 s with 1 running (9 empty slot-seconds), 1 s with no step at all
    steps = [_st(1.0, 4), _st(3.0, 1)]
    parts = bubble_parts(steps, 5.0, 4)
    assert parts.outside_steps == pytest.approx(1 / 5)
    assert parts.under_filled == pytest.approx(9 / 20)
    assert parts.outside_steps + parts.under_filled == pytest.approx(bubble_ratio(steps, 5.0, 4))
    assert bubble_parts([_st(2.0, 8)], 3.0, 8).under_filled == pytest.approx(0.0, abs=1e-12)  # all gap
    assert bubble_parts([], 0.0, 8) == bubble_parts([_st(1.0, 9)], 1.0, 8)  # nothing idle either way
    rng = random.Random(5)
    for _ in range(200):
        steps = [_st(rng.uniform(0.001, 0.1), rng.randint(0, 12)) for _ in range(rng.randint(0, 20))]
        total = sum(s.duration_s for s in steps) * rng.uniform(0.95, 1.5)
        p = bubble_parts(steps, total, 8)
        assert p.outside_steps >= 0 and p.under_filled >= 0
        assert p.outside_steps + p.under_filled == pytest.approx(bubble_ratio(steps, total, 8), abs=1e-9)


def test_percentile_matches_linear_interpolation() -> None:
    rng = random.Random(3)
    for _ in range(50):
        xs = [rng.randint(0, 1000) for _ in range(rng.randint(1, 40))]
        s = sorted(xs)
        pos = (len(s) - 1) * 0.75
        lo = int(pos)
        want = s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (pos - lo)
        assert percentile(xs, 75) == pytest.approx(want)
    assert percentile([], 75) == 0.0


def _spec_step(drafted: tuple[int, ...], accepted: tuple[int, ...]) -> EngineStepStats:
    return EngineStepStats(
        start_s=0,
        duration_s=0.1,
        num_running=2,
        num_waiting=0,
        num_preemptions_total=0,
        kv_cache_usage=0,
        spec_draft_tokens=sum(drafted),
        spec_accepted_tokens=sum(accepted),
        spec_draft_tokens_per_pos=drafted,
        spec_accepted_tokens_per_pos=accepted,
    )


def test_acceptance_per_draft_position_by_hand() -> None:
    # step 1: a 3-token draft with 2 accepted, a 2-token draft with 0 accepted; drafted per
    # position (2, 2, 1), accepted up to each position (1, 1, 0); step 2 (k was 1): a 1-token draft
    # accepted -> (1,), (1,). Summed: drafted (3, 2, 1), accepted (2, 1, 0): 2/3, 1/2, 0.
    steps = [_spec_step((2, 2, 1), (1, 1, 0)), _spec_step((1,), (1,))]
    result = RoundResult(
        plan=StepPlan(0, RoundKind.STANDARD, (), 1, 0, 1), groups=(), deferred=(), discarded=()
    )
    m = rollout_metrics(result, steps, time_s=0.2, concurrency=4, preemptions=0)
    assert m.spec_draft_tokens_per_pos == (3, 2, 1) and m.spec_accepted_tokens_per_pos == (2, 1, 0)
    assert m.spec_acceptance_by_position == pytest.approx((2 / 3, 1 / 2, 0.0))
    logged = m.logged(long_queue_size=0)
    assert logged["rollout/spec_acceptance_pos1"] == pytest.approx(2 / 3)
    assert logged["rollout/spec_acceptance_pos2"] == pytest.approx(0.5)
    assert logged["rollout/spec_acceptance_pos3"] == 0.0 and "rollout/spec_acceptance_pos4" not in logged
    assert m.spec_acceptance == pytest.approx(3 / 6)  # the overall rate is unchanged: 3 of 6 drafted


def test_per_position_counts_sum_with_ragged_lengths_and_bad_counts_are_refused() -> None:
    assert sum_per_position([(1, 2), (), (3, 4, 5)]) == (4, 6, 5)
    assert acceptance_by_position((4, 0), (2,)) == (0.5, 0.0)  # nothing drafted at position 2: 0
    with pytest.raises(ValueError, match="position 1: 3 accepted of 2 drafted"):
        acceptance_by_position((2,), (3,))
    with pytest.raises(ValueError, match="for 2 positions, drafted for only 1"):
        acceptance_by_position((2,), (1, 1))
