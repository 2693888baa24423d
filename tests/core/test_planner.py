"""The per-step parallelism planner's heuristic (RollPacker section 4.2) on recorded preemption series."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollpacker.core.errors import ConfigError
from rollpacker.core.planner import PlannerConfig, initial, observe, replay

CFG = PlannerConfig(initial_tp=2, max_tp=8, min_tp=1)


def test_a_rise_above_1_05x_doubles_tp_and_one_at_or_below_does_not() -> None:
    assert replay(CFG, [("short", 100), ("short", 105)]).tp_for("short") == 2  # 1.05x: not a rise
    assert replay(CFG, [("short", 100), ("short", 106)]).tp_for("short") == 4
    assert replay(CFG, [("short", 100), ("short", 106), ("short", 120)]).tp_for("short") == 8
    assert replay(CFG, [("short", 0), ("short", 3)]).tp_for("short") == 4  # from none to some


def test_four_calm_steps_halve_tp_three_do_not() -> None:
    assert replay(CFG, [("short", 0)] * 3).tp_for("short") == 2
    assert replay(CFG, [("short", 0)] * 4).tp_for("short") == 1
    # a step with preemptions (even falling ones) restarts the count
    calm_broken = [("short", 0), ("short", 0), ("short", 0), ("short", 5), ("short", 0)]
    assert replay(CFG, calm_broken).tp_for("short") == 4  # 0 -> 5 was a rise


def test_short_and_long_rounds_keep_separate_tp_sizes() -> None:
    # tail batching's periods: 4 short rounds, then a calm long round; once short-round TP has
    # doubled, short rounds preempt less (a recorded series, as the paper's Figure 13b shows)
    first = [("short", 10), ("short", 12), ("short", 12), ("short", 11), ("long", 0)]
    later = [("short", 6), ("short", 6), ("short", 6), ("short", 6), ("long", 0)]
    state = replay(CFG, first + later)
    assert state.tp_for("short") == 4  # doubled once (10 -> 12), compared short with short only
    assert state.tp_for("long") == 2  # two calm long rounds: not yet four
    state = replay(CFG, first + later * 3)
    assert state.tp_for("long") == 1  # four calm long rounds halve long-round TP only
    # the long rounds' zeros never make the next short round's preemptions a "rise"
    assert state.tp_for("short") == 4


def test_tp_stays_within_one_node_and_above_the_minimum() -> None:
    rising = [("short", 2**i) for i in range(10)]
    assert replay(CFG, rising).tp_for("short") == 8
    assert replay(CFG, [("long", 0)] * 40).tp_for("long") == 1


@given(
    st.lists(st.tuples(st.sampled_from(["short", "long", "standard"]), st.integers(0, 1000)), max_size=60),
    st.sampled_from([(1, 1, 8), (1, 2, 4), (2, 4, 8), (1, 8, 8)]),
)
def test_invariant_tp_is_a_power_of_two_in_bounds_and_replay_equals_stepping(
    history: list[tuple[str, int]], bounds: tuple[int, int, int]
) -> None:
    lo, start, hi = bounds
    cfg = PlannerConfig(initial_tp=start, min_tp=lo, max_tp=hi)
    state = initial(cfg)
    for kind, p in history:
        before = state
        state = observe(cfg, state, kind if kind != "standard" else "short", p)
        for k in ("short", "long"):
            tp = state.tp_for(k)
            assert lo <= tp <= hi and tp & (tp - 1) == 0
        other = "long" if kind == "long" else "short"
        untouched = "short" if other == "long" else "long"
        assert state.tp_for(untouched) == before.tp_for(untouched)
    assert replay(cfg, history) == state


@pytest.mark.parametrize(
    "kw",
    [
        {"initial_tp": 3},
        {"max_tp": 0},
        {"initial_tp": 16, "max_tp": 8},
        {"rise_factor": 0.9},
        {"calm_steps": 0},
        {"devices": 2, "max_tp": 4},
        {"devices": 6, "max_tp": 4},  # TP 4 would leave 2 of the 6 devices idle
        {"devices": -1},
        {"check_every": 0},
        {"reprofile_margin": 0},
        {"profile_batches": ()},
        {"profile_contexts": (16, 0)},
    ],
)
def test_bad_planner_config_is_named(kw: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match="planner"):
        PlannerConfig(**kw)  # type: ignore[arg-type]


def test_bad_observations_are_refused() -> None:
    with pytest.raises(ConfigError, match="preemptions"):
        observe(CFG, initial(CFG), "short", -1)
    with pytest.raises(ConfigError, match="round kind"):
        observe(CFG, initial(CFG), "medium", 1)
