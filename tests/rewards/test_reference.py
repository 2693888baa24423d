"""Reference anchors: reference solutions timed in the real sandbox as the first timeout anchors."""

from __future__ import annotations

import dataclasses
import logging
import time

import pytest

from rollpacker.core.tasks import RewardKind, TaskExample
from rollpacker.core.timeout import AdaptiveTimeout, TimeoutConfig
from rollpacker.rewards.base import RewardRequest, RewardStatus
from rollpacker.rewards.code import CodeReward
from rollpacker.rewards.reference import BadReference, ReferenceStats, reference_response
from rollpacker.rewards.sandbox import Sandbox, SandboxLimits
from rollpacker.tasks import synthetic_code as sc

EX = sc.generate(sc.SyntheticCodeSpec(num_examples=8), seed=11)
T_MIN, T_MAX = 0.5, 3.0


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(SandboxLimits(wall_s=20, cpu_s=20))


def _timeouts(**kw):
    return AdaptiveTimeout(TimeoutConfig(**{"t_min_s": T_MIN, "t_max_s": T_MAX, **kw}))


def _with_solution(ex: TaskExample, solution: object) -> TaskExample:
    return dataclasses.replace(ex, metadata={**ex.metadata, "solution": solution})


def test_reference_response_sources():
    ex = EX[0]
    assert reference_response(ex) == sc.reference_solution(ex)  # synthetic code: metadata["solution"]
    he = TaskExample(
        "HE/1",
        "def f():\n",
        RewardKind.CODE,
        tests=("assert f() == 1",),
        metadata={"canonical_solution": "  return 1\n"},
    )
    assert reference_response(he) == "  return 1\n"
    bare = TaskExample("c", "p", RewardKind.CODE, tests=("assert True",))
    assert reference_response(bare) is None
    with pytest.raises(BadReference, match=r"example 'c'.*metadata\['solution'\].*int"):
        reference_response(_with_solution(bare, 42))


def test_reference_anchors_are_set_before_the_first_correct_response(sandbox):
    """No correct response ever comes: the doomed one is still cut at the reference's limit (the
    floor, T_MIN: the reference runs in milliseconds), not at T_MAX, and every case is anchored."""
    ex = EX[0]
    t = _timeouts()
    with CodeReward(sandbox, t, workers=2, references=True) as cr:
        hang = cr.submit(RewardRequest("hang", ex, sc.nonterminating_variant(ex))).result()
        stats = cr.reference_stats()
    assert hang.status is RewardStatus.TIMEOUT and hang.cut_at_s == T_MIN, hang
    assert hang.elapsed_s < T_MAX - 1.0, hang
    assert set(t.anchors()) == set(ex.case_keys())
    assert all(0 < v < T_MIN for v in t.anchors().values())
    assert (stats.runs, stats.failed, stats.errors) == (1, 0, 0) and stats.seconds > 0


def test_without_references_the_doomed_response_runs_to_t_max(sandbox):
    """The baseline of the test above: the tail the reference anchors remove."""
    ex = EX[0]
    t = _timeouts()
    with CodeReward(sandbox, t, workers=2) as cr:
        hang = cr.submit(RewardRequest("hang", ex, sc.nonterminating_variant(ex))).result()
        assert cr.reference_stats() == ReferenceStats()
    assert hang.status is RewardStatus.TIMEOUT and hang.cut_at_s == 0.0  # the ceiling is not a cut
    assert hang.elapsed_s >= T_MAX - 0.1 and len(t) == 0


def test_a_reference_is_timed_once_and_merges_with_anchors_by_max(sandbox):
    ex = EX[1]
    k0, k1 = ex.case_keys()
    t = _timeouts(t_max_s=5.0)
    t.observe(k0, 0.25, passed=True)  # a slower correct run already anchors case 0
    with CodeReward(sandbox, t, workers=1, references=True) as cr:
        for i in range(3):
            cr.submit(RewardRequest(f"w{i}", ex, sc.wrong_variant(ex))).result()
        assert cr.reference_stats().runs == 1
    assert t.anchor_s(k0) == 0.25  # the max: the reference's milliseconds do not lower it
    assert t.anchor_s(k1) is not None and t.anchor_s(k1) < 0.25
    # every case anchored (e.g. restored from the committed state): nothing to time
    with CodeReward(sandbox, t, workers=1, references=True) as cr:
        cr.submit(RewardRequest("w", ex, sc.wrong_variant(ex))).result()
        assert cr.reference_stats() == ReferenceStats()


def test_a_failing_reference_gives_no_anchor_warns_and_counts(sandbox, caplog):
    ex = _with_solution(EX[2], sc.wrong_variant(EX[2]))
    t = _timeouts(t_max_s=2.0)
    with (
        caplog.at_level(logging.WARNING, logger="rollpacker.rewards.reference"),
        CodeReward(sandbox, t, workers=2, references=True) as cr,
    ):
        hang = cr.submit(RewardRequest("hang", ex, sc.nonterminating_variant(ex))).result()
        cr.submit(RewardRequest("again", ex, sc.wrong_variant(ex))).result()
        stats = cr.reference_stats()
        assert ex.example_id in cr.references.failures()
    assert len(t) == 0  # no anchor from a wrong reference
    assert hang.status is RewardStatus.TIMEOUT and hang.elapsed_s >= 1.9 and hang.cut_at_s == 0.0  # T_max
    assert (stats.runs, stats.failed) == (0, 1)  # failed once, never run again
    msgs = [r.getMessage() for r in caplog.records if r.name == "rollpacker.rewards.reference"]
    assert len(msgs) == 1, msgs
    assert repr(ex.example_id) in msgs[0] and "test case 0" in msgs[0] and "failed" in msgs[0]


def test_a_reference_past_t_max_falls_back_the_same_way(sandbox, caplog):
    ex = _with_solution(EX[3], sc.nonterminating_variant(EX[3]))
    t = _timeouts(t_max_s=1.0)
    with (
        caplog.at_level(logging.WARNING, logger="rollpacker.rewards.reference"),
        CodeReward(sandbox, t, workers=1, references=True) as cr,
    ):
        ok = cr.submit(RewardRequest("ok", ex, sc.reference_solution(ex))).result()
        stats = cr.reference_stats()
    assert ok.correct  # the response is judged as ever; its own correct run anchors the cases
    assert stats.failed == 1 and stats.runs == 0
    assert set(t.anchors()) == set(ex.case_keys()) and all(v < 0.5 for v in t.anchors().values())
    msg = next(r.getMessage() for r in caplog.records if r.name == "rollpacker.rewards.reference")
    assert repr(ex.example_id) in msg and "timeout" in msg and "t_max_s = 1 s" in msg


def test_an_unusable_solution_field_is_named_and_not_run(sandbox, caplog):
    ex = _with_solution(EX[4], ["not", "source"])
    t = _timeouts()
    with (
        caplog.at_level(logging.WARNING, logger="rollpacker.rewards.reference"),
        CodeReward(sandbox, t, workers=1, references=True) as cr,
    ):
        cr.score(RewardRequest("w", ex, sc.wrong_variant(ex)))
        assert cr.reference_stats().failed == 1 and cr.reference_stats().seconds == 0.0
    assert "metadata['solution']" in caplog.text and repr(ex.example_id) in caplog.text


def test_fixed_timeouts_time_no_reference(sandbox):
    t = _timeouts(adaptive=False)
    with CodeReward(sandbox, t, workers=1, references=True) as cr:
        cr.score(RewardRequest("w", EX[5], sc.wrong_variant(EX[5])))
        assert cr.reference_stats() == ReferenceStats() and len(t) == 0


def test_humaneval_canonical_solutions_become_anchors(sandbox):
    from rollpacker.tasks.humaneval import load_humaneval

    problems = load_humaneval()[:3]
    t = AdaptiveTimeout(TimeoutConfig(t_min_s=2.0, t_max_s=10.0))
    with CodeReward(sandbox, t, workers=2, references=True) as cr:
        futs = [cr.submit(RewardRequest(p.example_id, p, "    pass\n")) for p in problems]
        assert all(not f.result().correct for f in futs)
        deadline = time.monotonic() + 20
        while cr.reference_stats().runs < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert cr.reference_stats().runs == 3 and cr.reference_stats().failed == 0
    assert set(t.anchors()) == {k for p in problems for k in p.case_keys()}
