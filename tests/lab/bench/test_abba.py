"""ABBA ordering of repeated benchmark arms and the statistics of their per-repeat figures."""

from __future__ import annotations

import statistics

import pytest

from rollpacker.lab.bench.abba import abba_order, bootstrap_median_interval, paired_ratios, spread


def test_abba_order_alternates_a_b_b_a() -> None:
    assert [u for rep in abba_order(["A", "B"], 4) for u in rep] == list("ABBAABBA")
    assert abba_order(["A", "B"], 1) == [["A", "B"]]
    assert abba_order(["A"], 3) == [["A"], ["A"], ["A"]]


def test_over_even_repeats_every_unit_holds_every_position_equally_often() -> None:
    order = abba_order(["A", "B", "C"], 6)
    assert all(sorted(rep) == ["A", "B", "C"] for rep in order)  # each unit once per repeat
    for unit in "ABC":
        positions = [rep.index(unit) for rep in order]
        # a load rising linearly with the run position weighs the same on every unit
        assert statistics.mean(positions) == 1.0


def test_bad_orders_are_refused() -> None:
    with pytest.raises(ValueError, match="repeats 0"):
        abba_order(["A", "B"], 0)
    with pytest.raises(ValueError, match="no units"):
        abba_order([], 2)


def test_paired_ratios_by_hand() -> None:
    r = paired_ratios([10.0, 12.0, 9.0], [5.0, 4.0, 9.0])  # 2, 3, 1
    assert r.per_repeat == (2.0, 3.0, 1.0)
    assert (r.median, r.min, r.max) == (2.0, 1.0, 3.0)
    lo, hi = r.bootstrap95
    assert 1.0 <= lo <= 2.0 <= hi <= 3.0
    assert r.as_dict()["bootstrap95"] == [lo, hi]
    assert paired_ratios([10.0, 12.0, 9.0], [5.0, 4.0, 9.0]) == r  # seeded: reproducible


def test_paired_ratios_refuse_unpaired_or_zero_denominators() -> None:
    with pytest.raises(ValueError, match="2 numerators for 1 denominators"):
        paired_ratios([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match=r"repeats \[1\] have a denominator <= 0"):
        paired_ratios([1.0, 2.0], [1.0, 0.0])
    with pytest.raises(ValueError, match="no pairs"):
        paired_ratios([], [])


def test_the_bootstrap_interval_is_inside_the_range_and_narrower_than_it() -> None:
    values = [float(v) for v in range(1, 10)]
    lo, hi = bootstrap_median_interval(values)
    assert 1.0 < lo <= 5.0 <= hi < 9.0
    assert bootstrap_median_interval([4.0, 4.0, 4.0]) == (4.0, 4.0)
    with pytest.raises(ValueError, match=r"level 1\.5"):
        bootstrap_median_interval(values, level=1.5)


def test_spread_reports_median_and_range() -> None:
    s = spread([3.0, 1.0, 2.0, 10.0])
    assert (s.median, s.min, s.max) == (2.5, 1.0, 10.0)
    assert s.as_dict()["values"] == [3.0, 1.0, 2.0, 10.0]
    with pytest.raises(ValueError, match="no values"):
        spread([])
