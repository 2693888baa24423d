"""The reward-tail benchmark's workload (the sandbox runs are measured, not tested, here)."""

from __future__ import annotations

import pytest

from rollpacker.core.config import config_from_text
from rollpacker.core.errors import ConfigError
from rollpacker.lab.bench.reward_tail import _config_text, _kind, make_steps
from rollpacker.tasks import synthetic_code as sc

TEXT = "experiment: t\ntask: {name: synthetic_code, num_examples: 40}\n"
TEXT += "rollout: {prompts_per_step: 4, responses_per_prompt: 3}\n"
SHARES = {"doomed": 0.2, "wrong": 0.3, "slow": 0.1, "correct": 0.4}


def test_kinds_follow_the_shares():
    assert [_kind(u, SHARES) for u in (0.0, 0.19, 0.21, 0.49, 0.51, 0.59, 0.61, 0.99)] == [
        "doomed",
        "doomed",
        "wrong",
        "wrong",
        "slow",
        "slow",
        "correct",
        "correct",
    ]


def test_steps_are_fresh_prompts_in_arrival_order_with_whole_groups():
    cfg = config_from_text(TEXT)
    steps = make_steps(cfg, 3, 2.0, SHARES, (0.01, 0.02), seed=1)
    again = make_steps(cfg, 3, 2.0, SHARES, (0.01, 0.02), seed=1)
    # seeded (slow programs' loop counts are calibrated to this machine's speed, so not their text)
    assert [[(r.request_id, r.kind, r.arrive_s) for r in s] for s in again] == [
        [(r.request_id, r.kind, r.arrive_s) for r in s] for s in steps
    ]
    seen: set[str] = set()
    for step in steps:
        ids = {r.example.example_id for r in step}
        assert len(ids) == 4 and not ids & seen and len(step) == 12
        seen |= ids
        times = [r.arrive_s for r in step]
        assert times == sorted(times) and times[0] > 0 and times[-1] == pytest.approx(2.0)
        for r in step:
            if r.kind == "doomed":
                assert sc.nonterminating_variant(r.example) in r.text
            elif r.kind == "wrong":
                assert sc.wrong_variant(r.example) in r.text
    with pytest.raises(ConfigError, match="need 44 examples"):
        make_steps(cfg, 11, 2.0, SHARES, (0.01, 0.02), seed=1)


def test_arms_differ_only_in_reference_anchors():
    on = config_from_text(_config_text(TEXT, "t", True))
    off = config_from_text(_config_text(TEXT, "t", False))
    assert on.reward.sandbox.reference_anchors and not off.reward.sandbox.reference_anchors
    assert on.reward.measure_sync_stage and off.reward.measure_sync_stage
    assert on.task == off.task and on.rollout == off.rollout
