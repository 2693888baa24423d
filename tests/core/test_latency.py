"""The latency predictor and PAT's switch decision, on a recorded CPU profile and on synthetic
profiles whose trade-off is known."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollpacker.core.latency import (
    Layout,
    LayoutProfile,
    Predictor,
    ProfileError,
    ProfilePoint,
    ProfileTable,
    ReplicaLoad,
    TrajectoryStep,
    best_layout,
    choose_layout,
    distribute,
    layouts_for,
    redistribute,
    trajectory_error,
)

RECORDED = Path(__file__).parents[1] / "data" / "profile_cpu_tiny.json"
A, B = Layout(1, 2), Layout(2, 1)


def recorded() -> ProfileTable:
    return ProfileTable.from_json(RECORDED.read_text(), str(RECORDED))


def synthetic(
    tp1_step: float = 0.010, tp2_step: float = 0.006, per_req: float = 0.001, tp2_per_req: float = 0.002
) -> ProfileTable:
    """TP 2 has the lower fixed cost per step but pays more per request: it wins on a small
    (tail) batch and loses on a full one, which is the trade-off PAT exploits."""

    def pts(step: float, per: float) -> tuple[ProfilePoint, ...]:
        return tuple(
            ProfilePoint(
                batch=b,
                context=ln,
                tokens=float(b * (ln + 8)),
                prefill_s=1e-5 * b * ln,
                decode_s=step + per * b + 1e-7 * b * (ln + 8),
            )
            for b in (1, 4, 16, 64)
            for ln in (16, 128, 512)
        )

    return ProfileTable(
        model="m",
        hardware="synthetic",
        kv_bytes_per_token=4096,
        migration_bandwidth_bps=1e9,
        layouts=(
            LayoutProfile(A, pts(tp1_step, per_req), 100_000),
            LayoutProfile(B, pts(tp2_step, tp2_per_req), 100_000),
        ),
    )


def test_layouts_are_powers_of_two_within_the_node() -> None:
    assert layouts_for(8) == (Layout(1, 8), Layout(2, 4), Layout(4, 2), Layout(8, 1))
    assert layouts_for(2) == (A, B)
    assert layouts_for(8, max_tp=2) == (Layout(1, 8), Layout(2, 4))


def test_recorded_profile_round_trips_and_predicts_its_points_exactly() -> None:
    t = recorded()
    assert ProfileTable.from_json(t.to_json()) == t
    pr = Predictor(t)
    for lp in t.layouts:
        for p in lp.points:
            assert pr.decode_step_s(lp.layout, p.batch, p.tokens) == pytest.approx(
                max(p.decode_s, min(q.decode_s for q in lp.points))
            )
            assert pr.prefill_s(lp.layout, p.batch, p.context) == pytest.approx(p.prefill_s)


def test_interpolation_between_batches_lies_between_its_neighbours() -> None:
    pr = Predictor(synthetic())
    lo, hi = pr.decode_step_s(A, 4, 4 * 136), pr.decode_step_s(A, 16, 4 * 136)
    mid = pr.decode_step_s(A, 10, 4 * 136)
    assert lo < mid < hi
    # linear between profiled batch sizes at the same T
    assert mid == pytest.approx(lo + (hi - lo) * (10 - 4) / (16 - 4))


@given(st.integers(1, 64), st.floats(10, 40_000), st.floats(1, 5_000))
@settings(max_examples=60, deadline=None)
def test_decode_latency_is_monotone_in_tokens_where_the_profile_is(b: int, t: float, dt: float) -> None:
    pr = Predictor(synthetic())
    assert pr.decode_step_s(A, b, t + dt) >= pr.decode_step_s(A, b, t) - 1e-12


def test_missing_layout_names_what_the_table_has() -> None:
    with pytest.raises(ProfileError, match=r"no tp4dp1 \(it has tp1dp2, tp2dp1\)"):
        Predictor(recorded()).decode_step_s(Layout(4, 1), 1, 10)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda d: d.pop("layouts"), "lacks 'layouts'"),
        (lambda d: d.update(version=99), "profile version 99"),
        (lambda d: d["layouts"][0]["points"][0].update(decode_s=0), r"layouts\[0\]\.points\[0\]"),
        (lambda d: d["layouts"][1]["points"][2].pop("tokens"), r"layouts\[1\]\.points\[2\] lacks 'tokens'"),
        (lambda d: d.update(migration_bandwidth_bps=0), "migration_bandwidth_bps"),
    ],
)
def test_bad_profiles_are_refused_with_the_field(mutate, match) -> None:
    d = json.loads(RECORDED.read_text())
    mutate(d)
    with pytest.raises(ProfileError, match=match):
        ProfileTable.from_dict(d, "p.json")


def test_recompute_uses_the_rms_length_per_replica() -> None:
    t = synthetic()
    pr = Predictor(t)
    lengths = [100, 200, 300, 400]
    # one replica: all four as a batch of 4 at the RMS length
    rms = math.sqrt(sum(x * x for x in lengths) / 4)
    assert pr.recompute_s(B, lengths) == pytest.approx(pr.prefill_s(B, 4, rms))
    # two replicas: the slower of the two halves
    parts = distribute(lengths, 2)
    expect = max(pr.prefill_s(A, len(p), math.sqrt(sum(x * x for x in p) / len(p))) for p in parts)
    assert pr.recompute_s(A, lengths) == pytest.approx(expect)


def test_migration_time_follows_the_kv_volume_per_source_rank() -> None:
    pr = Predictor(synthetic())
    # eq. 1-2: sum(L) * bytes/token / tp_src / bandwidth
    assert pr.migrate_s(2, [1000, 3000]) == pytest.approx(4000 * 4096 / 2 / 1e9)
    # vLLM cannot migrate KV: the switch pays recompute unless kv_migration is declared
    lengths = [4000] * 8
    assert pr.switch_s(A, B, lengths) == pytest.approx(pr.recompute_s(B, lengths))
    pm = Predictor(synthetic(), kv_migration=True, switch_overhead_s=0.5)
    assert pm.switch_s(A, B, lengths) == pytest.approx(0.5 + pm.migrate_s(1, lengths))


def test_remaining_time_walks_the_shrinking_batch() -> None:
    pr = Predictor(synthetic())
    # one request 10 tokens from the bound: 10 steps at batch 1
    one = pr.remaining_s(B, [ReplicaLoad((100,), (90,))], 100)
    assert one == pytest.approx(sum(pr.decode_step_s(B, 1, 100 + k) for k in range(10)), rel=1e-6)
    # two requests 5 and 10 from the bound: 5 steps at batch 2, then 5 at batch 1
    two = pr.remaining_s(B, [ReplicaLoad((100, 50), (95, 90))], 100)
    expect = sum(pr.decode_step_s(B, 2, 150 + 2 * k) for k in range(5)) + sum(
        pr.decode_step_s(B, 1, 55 + k) for k in range(5)
    )
    assert two == pytest.approx(expect, rel=1e-6)
    # replicas run side by side: the slowest one counts
    both = pr.remaining_s(A, [ReplicaLoad((100,), (90,)), ReplicaLoad((100,), (50,))], 100)
    assert both == pytest.approx(pr.remaining_s(A, [ReplicaLoad((100,), (50,))], 100))


def test_redistribute_keeps_every_request_and_balances_counts() -> None:
    loads = [ReplicaLoad((5, 6, 7), (1, 2, 3)), ReplicaLoad((8,), (4,))]
    for dp in (1, 2, 3):
        parts = redistribute(loads, dp)
        assert len(parts) == dp
        got = sorted(p for ld in parts for p in zip(ld.contexts, ld.generated, strict=True))
        assert got == sorted([(5, 1), (6, 2), (7, 3), (8, 4)])
        sizes = [len(ld.contexts) for ld in parts]
        assert max(sizes) - min(sizes) <= 1


def test_algorithm1_keeps_a_full_batch_and_switches_in_the_tail() -> None:
    pr = Predictor(synthetic())
    full = [ReplicaLoad((64,) * 64, (0,) * 64), ReplicaLoad((64,) * 64, (0,) * 64)]
    d = choose_layout(pr, A, full, 512)
    assert not d.switch and d.target == A and d.current_s < dict(d.per_layout_s)["tp2dp1"]
    tail = [ReplicaLoad((600,), (100,)), ReplicaLoad((), ())]
    d = choose_layout(pr, A, tail, 512)
    assert d.switch and d.target == B
    assert d.best_s < d.current_s and d.switch_s > 0
    # and back when many requests come (here: a full batch on TP 2)
    d = choose_layout(pr, B, [ReplicaLoad((64,) * 128, (0,) * 128)], 512)
    assert d.switch and d.target == A


def test_algorithm1_does_not_switch_when_the_switch_eats_the_gain() -> None:
    tail = [ReplicaLoad((600,), (500,)), ReplicaLoad((), ())]  # 12 steps left
    cheap = choose_layout(Predictor(synthetic()), A, tail, 512)
    assert cheap.switch
    gain = cheap.current_s - (cheap.best_s - cheap.switch_s)
    costly = choose_layout(Predictor(synthetic(), switch_overhead_s=gain * 1.01), A, tail, 512)
    assert not costly.switch and costly.target == A
    # a required margin works the same way
    assert not choose_layout(Predictor(synthetic()), A, tail, 512, min_gain_s=gain).switch


@given(
    st.lists(st.tuples(st.integers(16, 600), st.integers(0, 511)), min_size=0, max_size=40),
    st.sampled_from([A, B]),
    st.floats(0.0, 2.0),
)
@settings(max_examples=80, deadline=None)
def test_algorithm1_switches_only_to_something_predicted_faster(reqs, current, overhead) -> None:
    pr = Predictor(synthetic(), switch_overhead_s=overhead)
    loads = redistribute([ReplicaLoad(tuple(c for c, _ in reqs), tuple(g for _, g in reqs))], current.dp)
    d = choose_layout(pr, current, loads, 512)
    if d.switch:
        assert d.best_s < d.current_s
        assert d.best_s == pytest.approx(dict(d.per_layout_s)[d.target.name])
    else:
        assert d.target == current
        # staying is the least predicted time of every candidate considered
        assert d.current_s <= min(t for _, t in d.per_layout_s) + 1e-12


def test_best_layout_is_the_least_predicted_time_for_a_full_batch() -> None:
    pr = Predictor(synthetic())
    # a full batch: data parallel wins on the synthetic trade-off; a lone request: TP 2
    assert best_layout(pr, 128, 64, 256) == A
    assert best_layout(pr, 1, 64, 256) == B
    rec = Predictor(recorded())
    times = {
        lay: rec.remaining_s(lay, redistribute([ReplicaLoad((64,) * 128, (0,) * 128)], lay.dp), 256)
        for lay in rec.candidates
    }
    assert best_layout(rec, 128, 64, 256) == min(times, key=lambda k: times[k])


def test_trajectory_error_compares_windows_and_steps() -> None:
    pr = Predictor(synthetic())
    steps = [
        TrajectoryStep(((4, 4 * 136.0), (4, 4 * 136.0)), pr.decode_step_s(A, 4, 4 * 136)) for _ in range(32)
    ]
    e = trajectory_error(pr, A, steps, window=16)
    assert e.windows == 2 and e.window_mape == pytest.approx(0.0) and e.total_error == pytest.approx(0.0)
    slow = [TrajectoryStep(s.loads, s.seconds * 1.25) for s in steps]
    e = trajectory_error(pr, A, slow, window=16)
    assert e.window_mape == pytest.approx(0.2) and e.step_mape == pytest.approx(0.2)
    with pytest.raises(ProfileError):
        trajectory_error(pr, A, [])


def test_algorithm1_never_moves_requests_onto_a_layout_that_cannot_hold_them() -> None:
    t = synthetic()
    small_b = dataclasses.replace(
        t, layouts=(t.layouts[0], dataclasses.replace(t.layouts[1], kv_capacity_tokens=500))
    )
    tail = [ReplicaLoad((600,), (100,)), ReplicaLoad((), ())]
    assert choose_layout(Predictor(t), A, tail, 512).target == B
    d = choose_layout(Predictor(small_b), A, tail, 512)
    assert not d.switch and "tp2dp1" not in dict(d.per_layout_s)
