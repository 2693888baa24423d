"""The suite's time budget (tests/budget.py): a run over ``ROLLPACKER_TEST_BUDGET_S`` fails after
its last test and names the slowest tests; within it, or without the variable, nothing changes."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tests.budget import (
    BUDGET_ENV,
    MAX_STRETCH,
    REFERENCE_S,
    TIMELINE_ENV,
    Budget,
    budget_from_env,
    probe,
    stretch,
)

pytest_plugins = ["pytester"]
ROOT = Path(__file__).resolve().parents[1]  # where the inner run imports tests.budget from

SLOW_AND_FAST = """
import time

def test_slow():
    time.sleep(0.3)

def test_fast():
    pass
"""


def _run(pytester: pytest.Pytester, budget: str | None, timeline: Path | None = None) -> pytest.RunResult:
    pytester.makeconftest('pytest_plugins = ["tests.budget"]\n')
    path = os.environ.get("PYTHONPATH", "")
    pytester._monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, (str(ROOT), path))))
    pytester.makepyfile(test_it=SLOW_AND_FAST)
    if budget is None:
        pytester._monkeypatch.delenv(BUDGET_ENV, raising=False)
    else:
        pytester._monkeypatch.setenv(BUDGET_ENV, budget)
    if timeline is None:
        pytester._monkeypatch.delenv(TIMELINE_ENV, raising=False)
    else:
        pytester._monkeypatch.setenv(TIMELINE_ENV, str(timeline))
    return pytester.runpytest_subprocess("-q")


def test_a_run_over_its_budget_fails_naming_the_slowest_test(pytester: pytest.Pytester) -> None:
    result = _run(pytester, "0.1")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        ["*over the time budget*", "*over its budget of 0.0 min*", "*s  test_it.py::test_slow"]
    )
    out = result.stdout.str()
    assert out.index("test_it.py::test_slow") < out.index("test_it.py::test_fast")  # slowest first
    assert "2 passed" in out


@pytest.mark.parametrize("budget", ["600", None])
def test_a_run_within_its_budget_or_without_one_passes(pytester: pytest.Pytester, budget: str | None) -> None:
    result = _run(pytester, budget)
    assert result.ret == pytest.ExitCode.OK
    assert "over the time budget" not in result.stdout.str()


def test_the_timeline_has_every_phase_of_every_test_with_its_worker_and_times(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    path = tmp_path / "out" / "timeline.json"
    result = _run(pytester, "600", timeline=path)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(
        [f"timeline: {path} (master busy * s of * s from the first test to the last)"]
    )
    data = json.loads(path.read_text())
    phases = {(p["nodeid"], p["when"]): p for p in data["phases"]}
    assert set(phases) == {
        (f"test_it.py::{t}", w) for t in ("test_slow", "test_fast") for w in ("setup", "call", "teardown")
    }
    slow = phases[("test_it.py::test_slow", "call")]
    assert slow["worker"] == "master" and slow["outcome"] == "passed"
    assert 0.3 <= slow["stop"] - slow["start"] < 30
    assert phases[("test_it.py::test_fast", "setup")]["start"] >= slow["stop"]  # in the order run
    assert data["busy_s"]["master"] >= 0.3 and data["span_s"] >= data["busy_s"]["master"] - 1e-6


def test_a_bad_budget_is_refused_by_name() -> None:
    assert budget_from_env({}) is None
    assert isinstance(budget_from_env({BUDGET_ENV: "1800"}), Budget)
    for bad in ("soon", "-5", "0"):
        with pytest.raises(pytest.UsageError, match=BUDGET_ENV):
            budget_from_env({BUDGET_ENV: bad})


def test_a_slower_machine_gets_proportionally_more_time_and_a_faster_one_no_less() -> None:
    ref = Budget(1800, probe_s=REFERENCE_S)
    assert ref.verdict(1799) is None
    message = ref.verdict(1801)
    assert message is not None and "over its budget of 30.0 min" in message and "x1.00" in message
    slow = Budget(1800, probe_s=1.4 * REFERENCE_S)  # 42 min for a tree that takes 30 here
    assert slow.verdict(2510) is None and slow.verdict(2530) is not None
    assert Budget(1800, probe_s=0.5 * REFERENCE_S).verdict(1801) is not None  # never shrunk
    assert Budget(1800, probe_s=10 * REFERENCE_S).verdict(1800 * MAX_STRETCH + 1) is not None
    # a machine that slowed down during the run: the probe at the end counts
    assert ref.verdict(2510, probe_s=1.4 * REFERENCE_S) is None


def test_the_probe_is_a_stable_measure() -> None:
    """Best of 3 runs of a fixed workload: two probes on one machine agree within a factor 2 (it
    stretches the budget; noise in it would turn the budget into a coin). Measured in CPU time: this
    test runs beside the suite's other worker, whose load moves the wall clock (seen: 0.47 s against
    0.21 s at load 14); the budget's own probes run before the first test and after the last."""
    a, b = probe(time.process_time), probe(time.process_time)
    assert a > 0 and 0.5 < a / b < 2.0
    assert stretch(a) >= 1.0
    assert probe() >= 0.9 * min(a, b)  # the wall clock never runs slower than the CPU's
