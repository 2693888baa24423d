"""The reward service with reference anchors, on the real sandbox: metrics, the tail, the anchors a
drain reports and the next ``begin`` restores, and the synchronous-stage measurement."""

from __future__ import annotations

import dataclasses
import logging
import time

import pytest

from rollpacker.core.types import Completion, FinishReason, Group, Prompt
from rollpacker.services.reward import RewardService
from rollpacker.tasks import synthetic_code as sc
from rollpacker.tasks.jsonl import dump_jsonl

T_MIN, T_MAX = 0.5, 3.0
EX = sc.generate(sc.SyntheticCodeSpec(num_examples=4), seed=3)


class _Trainer:
    def __init__(self) -> None:
        self.groups: list[str] = []

    def submit(self, attempt, prompt_id, samples) -> None:
        self.groups.append(prompt_id)


class _Peers:
    def __init__(self) -> None:
        self.t = _Trainer()

    def trainer(self):
        return self.t

    def cast_failure(self, attempt):
        return None

    def refresh(self) -> None:
        pass


@pytest.fixture()
def task_file(tmp_path):
    """The four examples as a JSONL code task; example 3's solution fails its own tests."""
    exs = list(EX)
    exs[3] = dataclasses.replace(exs[3], metadata={**exs[3].metadata, "solution": sc.wrong_variant(exs[3])})
    p = tmp_path / "code.jsonl"
    dump_jsonl(exs, p)
    return p


def _service(task_file, references: bool, sync: bool = False) -> RewardService:
    text = (
        f"experiment: t\ntask: {{name: {task_file}}}\n"
        f"reward: {{measure_sync_stage: {str(sync).lower()}, sandbox: {{workers: 2, t_min_s: {T_MIN}, "
        f"t_max_s: {T_MAX}, reference_anchors: {str(references).lower()}}}}}\n"
    )
    svc = RewardService(text, "sync")
    svc.bind(_Peers())
    return svc


def _group(ex, texts: list[str], attempt: str, svc: RewardService, score_first: bool = True) -> None:
    """Score each response as it 'finishes', then hand the group over."""
    comps = []
    for j, text in enumerate(texts):
        rid = f"{attempt}/{ex.example_id}/r{j}"
        if score_first:
            svc.score(attempt, rid, ex.example_id, text)
        comps.append(Completion(rid, ex.example_id, j, (1,), (0.0,), FinishReason.STOP))
    svc.group(attempt, Group(Prompt(ex.example_id, (1,)), tuple(comps)), tuple(texts))


def _doomed_step(svc: RewardService, attempt: str, anchors, exs):
    """A step whose groups have no correct response: one never-terminating, one wrong each."""
    svc.begin(attempt, anchors)
    for ex in exs:
        _group(ex, [sc.nonterminating_variant(ex), sc.wrong_variant(ex)], attempt, svc)
    end = time.time()
    return svc.drain(attempt, tuple(ex.example_id for ex in exs), end)


def test_the_tail_shrinks_and_reference_anchors_go_to_the_state_and_back(task_file):
    off, on = _service(task_file, False), _service(task_file, True)
    try:
        r_off = _doomed_step(off, "a0", (), EX[:1])
        r_on = _doomed_step(on, "a0", (), EX[:1])
        # no correct sibling: without references the doomed response ran to T_MAX after rollout
        assert r_off.metrics["reward/tail_s"] >= T_MAX - 0.2, r_off.metrics
        assert r_on.metrics["reward/tail_s"] < T_MAX - 1.5, r_on.metrics
        assert r_off.timeout_anchors == () and "reward/reference_runs" not in r_off.metrics
        assert (r_off.metrics["reward/timeouts"], r_off.metrics["reward/cut"]) == (1.0, 0.0)
        assert (r_on.metrics["reward/timeouts"], r_on.metrics["reward/cut"]) == (1.0, 1.0)
        assert r_on.metrics["reward/reference_runs"] == 1.0 and r_on.metrics["reward/reference_failed"] == 0
        # the drain reports the reference anchors (what the successor state commits) ...
        assert {k for k, _ in r_on.timeout_anchors} == set(EX[0].case_keys())
        # ... and the next attempt's begin restores them: no re-timing, the doomed one cut at once
        r2 = _doomed_step(on, "a1", r_on.timeout_anchors, EX[:1])
        assert r2.metrics["reward/reference_runs"] == 0.0 and r2.metrics["reward/cut"] == 1.0
        assert r2.timeout_anchors == r_on.timeout_anchors
        # a re-run from empty committed anchors times the reference again (anchors are state only)
        r3 = _doomed_step(on, "a2", (), EX[:1])
        assert r3.metrics["reward/reference_runs"] == 1.0
    finally:
        off.close()
        on.close()


def test_a_failing_reference_falls_back_to_t_max_with_a_warning_and_a_metric(task_file, caplog):
    svc = _service(task_file, True)
    try:
        with caplog.at_level(logging.WARNING, logger="rollpacker.rewards.reference"):
            r = _doomed_step(svc, "a0", (), [EX[3]])
    finally:
        svc.close()
    assert r.metrics["reward/reference_failed"] == 1.0 and r.metrics["reward/reference_runs"] == 0.0
    assert r.metrics["reward/tail_s"] >= T_MAX - 0.2 and r.metrics["reward/cut"] == 0.0
    assert r.timeout_anchors == ()
    assert repr(EX[3].example_id) in caplog.text and "test case 0" in caplog.text


def test_sync_stage_rescores_trained_responses_from_the_begin_anchors(task_file):
    """The synchronous stage re-scores only grouped responses, from the anchors the step began
    with (so the references are timed again there), and leaves the step's anchors as they were."""
    svc = _service(task_file, True, sync=True)
    try:
        svc.begin("a0", ())
        # a response of a prompt the round then deferred: scored, never grouped (wasted)
        svc.score("a0", "a0/wasted", EX[2].example_id, sc.reference_solution(EX[2]))
        for ex in EX[:2]:
            _group(ex, [sc.nonterminating_variant(ex), sc.reference_solution(ex)], "a0", svc)
        r = svc.drain("a0", tuple(ex.example_id for ex in EX[:2]), time.time())
        timer = svc._reference_timer()
        assert timer is not None
        # 3 references in the step (EX 0, 1, 2), then 2 in the stage: EX 0 and 1 from the begin
        # anchors (none), and not EX 2, whose response was not trained
        assert timer.stats().runs == 5
        again = svc.drain("a0", tuple(ex.example_id for ex in EX[:2]), time.time())
    finally:
        svc.close()
    m = r.metrics
    assert (m["reward/samples"], m["reward/wasted"], m["reward/reference_runs"]) == (4.0, 1.0, 3.0)
    # the 4 trained responses again: both doomed ones cut at T_MIN (the references), not at T_MAX
    assert T_MIN <= m["reward/sync_stage_s"] < T_MAX - 0.5, m
    keys = {k for k, _ in r.timeout_anchors}
    assert set(EX[0].case_keys()) | set(EX[1].case_keys()) | set(EX[2].case_keys()) == keys
    # the second drain measured the stage again; the anchors it reports are still the step's
    assert again.timeout_anchors == r.timeout_anchors


class _FailingTrainerPeers(_Peers):
    """A trainer whose fire-and-forget ``submit`` was recorded as failed for attempt ``a-bad``."""

    def cast_failure(self, attempt):
        return (
            "service t.sync.trainer: submit (fire and forget) failed: the service died"
            if attempt == "a-bad"
            else None
        )


def test_a_drain_fails_at_once_when_a_hand_off_to_the_trainer_failed(task_file):
    svc = RewardService(f"experiment: t\ntask: {{name: {task_file}}}\n", "sync")
    svc.bind(_FailingTrainerPeers())
    try:
        svc.begin("a-bad", ())
        t0 = time.monotonic()
        # a group that never arrives: without the check the drain would wait services.call_timeout_s
        with pytest.raises(Exception, match=r"drain of attempt a-bad cannot finish: .*trainer.*died"):
            svc.drain("a-bad", (EX[0].example_id,), time.time())
        assert time.monotonic() - t0 < 5
    finally:
        svc.close()
