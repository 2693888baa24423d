"""The pure records of a scale-down at runtime (``rollpacker.core.scaledown``): the trainer's
device timeline and the round's outcome, one named test per invariant."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollpacker.core.errors import ConfigError
from rollpacker.core.scaledown import DeviceTimeline, ScaleDownConfig, ScaleDownOutcome


@st.composite
def _timelines(draw: st.DrawFn) -> tuple[DeviceTimeline, float]:
    t = DeviceTimeline(draw(st.integers(0, 4)))
    now = 0.0
    for _ in range(draw(st.integers(0, 6))):
        now += draw(st.floats(0.0, 5.0))
        t = t.at(now, draw(st.integers(0, 4)))
    return t, now + draw(st.floats(0.0, 5.0))


@given(_timelines())
def test_invariant_the_mean_lies_between_the_smallest_and_largest_count(
    tl: tuple[DeviceTimeline, float],
) -> None:
    t, end = tl
    counts = [t.initial, *(n for _, n in t.changes)]
    assert min(counts) - 1e-9 <= t.mean(end) <= max(counts) + 1e-9


@given(st.integers(0, 8), st.floats(0.0, 100.0))
def test_invariant_an_unchanged_timeline_has_its_initial_mean(n: int, end: float) -> None:
    assert DeviceTimeline(n).mean(end) == n


@given(_timelines())
def test_invariant_held_s_counts_exactly_the_seconds_with_devices(tl: tuple[DeviceTimeline, float]) -> None:
    t, end = tl
    pts = t.series(end)
    held = sum(b[0] - a[0] for a, b in itertools.pairwise(pts) if a[1] > 0)
    assert t.held_s(end) == pytest.approx(held)


def test_timeline_of_one_lease() -> None:
    t = DeviceTimeline().at(2.0, 1).at(6.0, 0)
    assert t.mean(10.0) == pytest.approx(0.4) and t.held_s(10.0) == pytest.approx(4.0) and t.peak() == 1
    assert t.series(10.0) == ((0.0, 0), (2.0, 1), (6.0, 0), (10.0, 0))
    assert t.count(1.0) == 0 and t.count(2.0) == 1 and t.count(7.0) == 0
    with pytest.raises(ValueError, match="time order"):
        DeviceTimeline(0, ((3.0, 1), (1.0, 0)))


def test_invariant_the_decision_point_is_logged_only_when_the_round_scaled_down() -> None:
    off = ScaleDownOutcome(attempts=3, refused=3).logged()
    assert off["rollout/scaled_down"] == 0.0 and off["rollout/scale_down_refused"] == 3.0
    assert "rollout/scaled_down_at" not in off and "rollout/scaled_down_at_s" not in off
    on = ScaleDownOutcome(
        attempts=1,
        scaled_down=True,
        completed_fraction=0.25,
        at_s=1.5,
        freed_replicas=1,
        freed_devices=("1",),
    ).logged()
    assert on["rollout/scaled_down_at"] == 0.25 and on["rollout/scaled_down_at_s"] == 1.5
    assert on["rollout/devices_freed"] == 1.0


def test_enabled_is_off_by_default_and_must_be_a_bool() -> None:
    assert ScaleDownConfig().enabled is False
    with pytest.raises(ConfigError, match="enabled"):
        ScaleDownConfig(enabled="yes")  # type: ignore[arg-type]


def test_the_experiment_config_refuses_scale_down_without_replicas_or_a_stream_trainer() -> None:
    from rollpacker.core.config import config_from_text

    ok = config_from_text("rollout: {scale_down: {enabled: true}}\nplanner: {devices: 2, max_tp: 1}")
    assert ok.rollout.scale_down.enabled
    with pytest.raises(ConfigError, match=r"planner\.devices >= 2"):
        config_from_text("rollout: {scale_down: {enabled: true}}")
    with pytest.raises(ConfigError, match=r"train\.stream: true"):
        config_from_text(
            "rollout: {scale_down: {enabled: true}}\nplanner: {devices: 2, max_tp: 1}\n"
            "train: {stream: false, mini_batches: 1}"
        )
    with pytest.raises(ConfigError, match=r"rollout\.scale_down\.enabld"):
        config_from_text("rollout: {scale_down: {enabld: true}}")
