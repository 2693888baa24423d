"""The reward benchmark end to end on the real sandbox, scaled down (short timeouts)."""

from __future__ import annotations

import json

import pytest

from rollpacker.lab.bench.reward import make_workload, render, run_reward_bench


def test_workload_is_seeded_and_has_every_kind():
    a = make_workload(6, 8, 0.2, 0.3, (0.01, 0.05), seed=1)
    b = make_workload(6, 8, 0.2, 0.3, (0.01, 0.05), seed=1)
    assert [(s.sample_id, s.kind, s.response) for s in a] == [(s.sample_id, s.kind, s.response) for s in b]
    assert {s.kind for s in a} == {"correct", "wrong", "doomed"}
    assert len(a) == 48 and len({s.sample_id for s in a}) == 48


@pytest.mark.slow
@pytest.mark.alone  # the adaptive timeouts are learned from measured run times
def test_adaptive_cuts_doomed_runs_and_keeps_correct_verdicts():
    r = run_reward_bench(
        problems=3,
        responses=4,
        epochs=2,
        doomed_share=0.25,
        wrong_share=0.25,
        case_s=(0.01, 0.05),
        lam=1.5,
        t_min_s=0.5,
        t_max_s=3.0,
        seed=2,
        progress=False,
    )
    json.dumps(r)  # the report is JSON
    fixed, adaptive = r["modes"]["fixed"], r["modes"]["adaptive"]
    n = r["workload"]["kinds"]
    assert n["doomed"] > 0 and n["correct"] > 0
    # every doomed response times out in both modes; fixed waits t_max for each
    assert fixed["timeouts"] == adaptive["timeouts"] == 2 * n["doomed"]
    assert fixed["mean_scoring_s"]["doomed"] >= 3.0
    assert adaptive["mean_scoring_s"]["doomed"] < 2.0
    assert r["no_correct_misjudged"], (adaptive["misjudged_correct"], r["verdicts_differ"])
    assert r["speedup"] == pytest.approx(fixed["reward_stage_s"] / adaptive["reward_stage_s"])
    assert "speedup (fixed / adaptive)" in render(r)
