"""The suite's time budget (tests/budget.py): a run over ``ROLLPACKER_TEST_BUDGET_S`` fails after
its last test and names the slowest tests; within it, or without the variable, nothing changes."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.budget import BUDGET_ENV, MAX_STRETCH, REFERENCE_S, Budget, budget_from_env, probe, stretch

pytest_plugins = ["pytester"]
ROOT = Path(__file__).resolve().parents[1]  # where the inner run imports tests.budget from

SLOW_AND_FAST = """
import time

def test_slow():
    time.sleep(0.3)

def test_fast():
    pass
"""


def _run(pytester: pytest.Pytester, budget: str | None) -> pytest.RunResult:
    pytester.makeconftest('pytest_plugins = ["tests.budget"]\n')
    path = os.environ.get("PYTHONPATH", "")
    pytester._monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, (str(ROOT), path))))
    pytester.makepyfile(test_it=SLOW_AND_FAST)
    if budget is None:
        pytester._monkeypatch.delenv(BUDGET_ENV, raising=False)
    else:
        pytester._monkeypatch.setenv(BUDGET_ENV, budget)
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
