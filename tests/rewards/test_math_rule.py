from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait

import psutil
import pytest

from rollpacker.core.errors import ConfigError
from rollpacker.core.tasks import RewardKind, TaskExample
from rollpacker.rewards.base import RewardRequest, RewardStatus
from rollpacker.rewards.math_rule import MathReward, extract_answer, score_math
from rollpacker.tasks import synthetic_math
from rollpacker.tasks.synthetic_math import SyntheticMathSpec

OK, WRONG_FORMAT, TIMEOUT, ERROR = (
    RewardStatus.OK,
    RewardStatus.WRONG_FORMAT,
    RewardStatus.TIMEOUT,
    RewardStatus.ERROR,
)
SLOW = "Answer: 9**9**9**9"  # parses at once; sympy then evaluates a tower of powers for ever


def _math(reference: str, example_id: str = "m") -> TaskExample:
    return TaskExample(example_id, "q", RewardKind.MATH, reference=reference)


def _workers() -> list[psutil.Process]:
    """This process's live pool workers (the spawn helpers; not the resource tracker)."""
    return [
        p
        for p in psutil.Process().children(recursive=True)
        if p.is_running() and p.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(p.cmdline())
    ]


def _assert_no_workers_left(pids: set[int]) -> None:
    assert pids, "the test should have seen the workers"
    assert multiprocessing.active_children() == []
    alive = {p.pid for p in _workers()}
    assert not pids & alive, f"workers still running after close(): {pids & alive}"


CASES = [
    # (response, reference, status, reward)
    ("Answer: 7", "7", OK, 1.0),
    ("Answer: 07", "7", OK, 1.0),  # decided: numeric equality, leading zeros do not matter
    ("Answer: 7.0", "7", OK, 1.0),
    ("Answer: \\boxed{7}", "7", OK, 1.0),
    ("Answer: x = 7", "7", OK, 1.0),
    ("Answer:7", "7", OK, 1.0),
    ("Answer: 8", "7", OK, 0.0),
    ("Answer: -7", "7", OK, 0.0),
    ("Answer: 7, not 8", "7", OK, 0.0),  # math-verify reads the last number of plain text
    ("Answer: 8\nwait, no.\nAnswer: 7", "7", OK, 1.0),  # the last "Answer:" counts
    ("Answer: 7\nAnswer: 8", "7", OK, 0.0),
    ("1: 3+4=7\nso it is 7", "7", OK, 1.0),  # no "Answer:": the whole response
    ("answer: 7", "7", OK, 1.0),  # no "Answer:" (case-sensitive): whole response, still the last number
    ("Answer: 1,000", "1000", OK, 1.0),
    ("Answer: 0.5", "\\frac{1}{2}", OK, 1.0),  # a bare LaTeX reference is read as LaTeX
    ("Answer: x^2+1", "x^2+1", WRONG_FORMAT, 0.0),  # but the response is not: x^2+1 needs $...$
    ("Answer: $x^2+1$", "x^2+1", OK, 1.0),
    ("Answer: seven", "7", WRONG_FORMAT, 0.0),
    ("Answer:", "7", WRONG_FORMAT, 0.0),
    ("no idea, sorry", "7", WRONG_FORMAT, 0.0),
    ("", "7", WRONG_FORMAT, 0.0),
    ("Answer: 3", "seven", ERROR, 0.0),  # the reference itself does not parse: a dataset error
]


@pytest.mark.parametrize(("response", "reference", "status", "reward"), CASES)
def test_score_math_rules(response, reference, status, reward) -> None:
    r = score_math(response, reference, timeout_s=5.0, sample_id="s")
    assert (r.status, r.reward, r.correct, r.sample_id) == (status, reward, reward == 1.0, "s"), r.detail
    assert 0 <= r.elapsed_s < 5


def test_extract_answer() -> None:
    assert extract_answer("1: 1+1=2\nAnswer: 2") == " 2"
    assert extract_answer("Answer: 1 Answer: 2") == " 2"
    assert extract_answer("no marker") == "no marker"


def test_score_math_timeout_in_main_thread_restores_signals() -> None:
    before = signal.getsignal(signal.SIGALRM)
    t0 = time.perf_counter()
    r = score_math(SLOW, "7", timeout_s=0.2)
    assert r.status is TIMEOUT and r.reward == 0.0 and not r.correct
    assert 0.2 <= r.elapsed_s < 3.0 and time.perf_counter() - t0 < 4.0
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) is before
    assert score_math("Answer: 7", "7", timeout_s=0.2).status is OK  # still works after a timeout


def test_score_math_threads() -> None:
    with ThreadPoolExecutor(1) as ex:
        with pytest.raises(RuntimeError, match="main thread"):
            ex.submit(score_math, "Answer: 7", "7", 1.0).result()
        assert ex.submit(score_math, "Answer: 7", "7", None).result().reward == 1.0  # no limit: any thread


def test_many_concurrent_submits_resolve_and_close_leaves_no_worker() -> None:
    exs = synthetic_math.generate(SyntheticMathSpec(num_examples=200), seed=0)
    reward = MathReward(workers=2, timeout_s=5.0)
    assert multiprocessing.active_children() == []  # lazy: nothing starts before the first submit
    reqs = []
    for ex in exs:
        right = synthetic_math.reference_solution(ex)
        wrong = right.rsplit("Answer:", 1)[0] + f"Answer: {(int(ex.reference) + 1) % 10}"
        reqs += [
            RewardRequest(f"{ex.example_id}/ok", ex, right),
            RewardRequest(f"{ex.example_id}/no", ex, wrong),
        ]
    reqs += [RewardRequest(f"junk{i}", exs[i], "I refuse to answer.") for i in range(20)]

    def submit_all(part: list[RewardRequest]) -> list:
        return [reward.submit(r) for r in part]

    with ThreadPoolExecutor(4) as tp:  # submitted from 4 threads at once
        futures = [f for fs in tp.map(submit_all, [reqs[i::4] for i in range(4)]) for f in fs]
    _, not_done = wait(futures, timeout=60)
    assert not not_done
    by_id = {f.result().sample_id: f.result() for f in futures}
    assert len(by_id) == len(reqs) == 420
    for ex in exs:
        ok, no = by_id[f"{ex.example_id}/ok"], by_id[f"{ex.example_id}/no"]
        assert (ok.status, ok.reward, ok.correct) == (OK, 1.0, True), ok
        assert (no.status, no.reward, no.correct) == (OK, 0.0, False), no
    assert {by_id[f"junk{i}"].status for i in range(20)} == {WRONG_FORMAT}
    pids = {p.pid for p in _workers()}
    assert len(pids) == 2
    with pytest.raises(ConfigError, match="not 'math'"):
        reward.submit(RewardRequest("c", TaskExample("c", "p", RewardKind.JUDGE), "x"))
    reward.close()
    _assert_no_workers_left(pids)
    reward.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        reward.submit(RewardRequest("late", exs[0], "Answer: 1"))


def test_timeout_then_the_pool_keeps_working() -> None:
    with MathReward(workers=1, timeout_s=0.2) as reward:
        slow = reward.submit(RewardRequest("slow", _math("7"), SLOW))
        after = reward.submit(RewardRequest("after", _math("7"), "Answer: 7"))
        r = slow.result(timeout=30)
        assert (r.sample_id, r.status, r.reward) == ("slow", TIMEOUT, 0.0)
        assert 0.2 <= r.elapsed_s < 3.0, r
        assert "more than 0.2 s" in r.detail
        assert after.result(timeout=10).status is OK and after.result().reward == 1.0
        pids = {p.pid for p in _workers()}
        # close() with work queued: every future still resolves
        pending = [reward.submit(RewardRequest(f"p{i}", _math("7"), SLOW)) for i in range(3)]
    assert all(f.done() for f in pending)
    assert {f.result().status for f in pending} <= {TIMEOUT, ERROR}
    assert reward.worker_deaths == 0
    _assert_no_workers_left(pids)


def test_dead_worker_gives_error_and_the_pool_is_recreated() -> None:
    # the hard CPU limit (below the soft limit here) kills the worker: a BrokenProcessPool
    with MathReward(workers=1, timeout_s=10.0, hard_cpu_s=0.3) as reward:
        r = reward.submit(RewardRequest("doomed", _math("7"), SLOW)).result(timeout=30)
        assert (r.sample_id, r.status, r.reward) == ("doomed", ERROR, 0.0)
        assert "worker process died" in r.detail
        assert reward.worker_deaths == 1
        assert reward.submit(RewardRequest("next", _math("7"), "Answer: 7")).result(timeout=30).reward == 1.0
        pids = {p.pid for p in _workers()}
    _assert_no_workers_left(pids)


def test_samples_in_flight_when_a_worker_is_killed_are_retried_alone() -> None:
    with MathReward(workers=2, timeout_s=0.8) as reward:
        reward.submit(RewardRequest("warm", _math("7"), "Answer: 7")).result(timeout=30)
        a = reward.submit(RewardRequest("a", _math("7"), SLOW))
        b = reward.submit(RewardRequest("b", _math("7"), SLOW))
        time.sleep(0.2)  # both are being scored now (each would time out at 0.8 s)
        victims = _workers()
        assert len(victims) == 2
        os.kill(victims[0].pid, signal.SIGKILL)
        ra, rb = a.result(timeout=30), b.result(timeout=30)
        # both innocent: rerun one at a time on a new pool, each reaching its own time limit
        assert (ra.status, rb.status) == (TIMEOUT, TIMEOUT), (ra, rb)
        assert reward.worker_deaths == 1
        assert not ({p.pid for p in victims} & {p.pid for p in _workers()})  # a fresh pool
        pids = {p.pid for p in _workers()}
    _assert_no_workers_left(pids)


def test_constructor_checks_and_lazy_import() -> None:
    with pytest.raises(ConfigError, match="workers = 0"):
        MathReward(workers=0)
    with pytest.raises(ConfigError, match="timeout_s"):
        MathReward(timeout_s=0)
    r = MathReward()
    assert r.kind is RewardKind.MATH and r.hard_cpu_s == 10.0
    r.close()  # closing a never-used reward starts nothing
    assert multiprocessing.active_children() == []
    assert threading.active_count() >= 1
