"""The adaptive sandbox timeout (RollPacker section 4.3): one named test per invariant."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollpacker.core.errors import ConfigError
from rollpacker.core.timeout import AdaptiveTimeout, TimeoutConfig

runs = st.lists(
    st.tuples(st.sampled_from(["a/0", "a/1", "b/0"]), st.floats(0, 100, allow_nan=False), st.booleans()),
    max_size=60,
)


def test_the_papers_formula_and_defaults():
    t = AdaptiveTimeout()
    assert (t.config.lam, t.config.t_min_s, t.config.t_max_s) == (1.5, 2.0, 30.0)
    assert t.timeout_s("p/0") == 30.0  # no anchor yet: nothing is cut short
    t.observe("p/0", 0.4, passed=True)
    assert t.timeout_s("p/0") == 2.0  # floor
    t.observe("p/0", 4.0, passed=True)
    assert t.timeout_s("p/0") == pytest.approx(6.0)  # lambda * anchor
    t.observe("p/0", 25.0, passed=True)
    assert t.timeout_s("p/0") == 30.0  # ceiling
    assert t.timeout_s("p/1") == 30.0  # anchors are per case


@given(runs)
def test_timeout_stays_within_floor_and_ceiling(events):
    t = AdaptiveTimeout(TimeoutConfig(lam=1.5, t_min_s=2.0, t_max_s=30.0))
    for case, s, ok in events:
        t.observe(case, s, ok)
        for c in ("a/0", "a/1", "b/0", "never"):
            assert 2.0 <= t.timeout_s(c) <= 30.0


@given(runs)
def test_anchor_is_the_slowest_correct_run_and_only_grows(events):
    t = AdaptiveTimeout()
    for case, s, ok in events:
        before = t.anchor_s(case)
        t.observe(case, s, ok)
        after = t.anchor_s(case)
        if before is not None:
            assert after is not None and after >= before
    for case in ("a/0", "a/1", "b/0"):
        correct = [s for c, s, ok in events if c == case and ok]
        assert t.anchor_s(case) == (max(correct) if correct else None)


def test_failed_runs_never_move_the_anchor():
    t = AdaptiveTimeout()
    t.observe("x/0", 1.0, passed=True)
    t.observe("x/0", 50.0, passed=False)
    assert t.anchor_s("x/0") == 1.0


def test_a_response_as_fast_as_a_correct_one_is_never_cut():
    t = AdaptiveTimeout(TimeoutConfig(lam=1.0, t_min_s=0.001, t_max_s=100))
    t.observe("x/0", 3.0, passed=True)
    assert t.timeout_s("x/0") >= 3.0


@given(runs)
def test_json_round_trip_is_exact(events):
    t = AdaptiveTimeout(TimeoutConfig(lam=2.0, t_min_s=0.5, t_max_s=10.0))
    for case, s, ok in events:
        t.observe(case, s, ok)
    back = AdaptiveTimeout.from_json(t.to_json())
    assert back == t and back.config == t.config


def test_fixed_mode_always_gives_the_ceiling():
    t = AdaptiveTimeout(TimeoutConfig(adaptive=False, t_max_s=30.0))
    t.observe("x/0", 0.1, passed=True)
    assert t.timeout_s("x/0") == 30.0


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"lam": 0.5}, "lam"),
        ({"t_min_s": 0}, "t_min_s"),
        ({"t_min_s": 40.0}, "floor must not exceed"),
        ({"t_max_s": float("inf")}, "t_max_s"),
    ],
)
def test_bad_config_names_the_key(kw, match):
    with pytest.raises(ConfigError, match=match):
        TimeoutConfig(**kw)


def test_corrupt_state_is_rejected_with_what_to_do():
    with pytest.raises(ConfigError, match="restore it"):
        AdaptiveTimeout.from_json('{"anchors": {}}')
    with pytest.raises(ConfigError, match="finite"):
        AdaptiveTimeout(anchors={"a/0": float("nan")})
    with pytest.raises(ConfigError, match="non-empty"):
        AdaptiveTimeout().observe("", 1.0, True)
