from __future__ import annotations

import random

import pytest

from rollpacker.core.metrics import bubble_ratio, percentile
from rollpacker.core.types import EngineStepStats


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
