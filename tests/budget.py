"""The suite's time budget, a pytest plugin (registered in tests/conftest.py).

`make test` sets ``ROLLPACKER_TEST_BUDGET_S`` (1800: CI gives a submission 90 minutes in all, and
the suite must leave room for set-up and the tests still to come). When the whole run took longer,
the session fails after its last test, naming the slowest tests (setup, call and teardown added up,
so a slow module fixture is charged to the test that started it) and the budget's setting. Without
the variable (a `pytest -k ...` by hand) nothing is checked.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict

import pytest

BUDGET_ENV = "ROLLPACKER_TEST_BUDGET_S"
SHOWN = 15


class Budget:
    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s
        self.start = time.monotonic()
        self.spent: defaultdict[str, float] = defaultdict(float)

    def record(self, report: pytest.TestReport) -> None:
        self.spent[report.nodeid] += report.duration

    def verdict(self, elapsed_s: float) -> str | None:
        """The failure message when the run went over budget; None when it kept to it."""
        if elapsed_s <= self.budget_s:
            return None
        slowest = sorted(self.spent.items(), key=lambda kv: -kv[1])[:SHOWN]
        lines = [
            f"the test run took {elapsed_s / 60:.1f} min, over its budget of {self.budget_s / 60:.1f} min "
            f"({BUDGET_ENV}); make the slowest tests cheaper (share a service or an engine, merge runs "
            "that cover one path) before adding more. The slowest:",
            *(f"  {s:7.1f} s  {nodeid}" for nodeid, s in slowest),
        ]
        return "\n".join(lines)


def budget_from_env(environ: dict[str, str] | os._Environ[str] = os.environ) -> Budget | None:
    raw = environ.get(BUDGET_ENV, "").strip()
    if not raw:
        return None
    try:
        budget_s = float(raw)
    except ValueError:
        raise pytest.UsageError(f"{BUDGET_ENV} = {raw!r} is not a number of seconds (e.g. 1800)") from None
    if budget_s <= 0:
        raise pytest.UsageError(
            f"{BUDGET_ENV} = {raw!r} must be positive (seconds), or unset to check nothing"
        )
    return Budget(budget_s)


_budget: Budget | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _budget
    _budget = budget_from_env()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _budget is not None:
        _budget.record(report)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _budget is None:
        return
    message = _budget.verdict(time.monotonic() - _budget.start)
    if message is None:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_sep("=", "over the time budget", red=True)
        reporter.write_line(message)
    if session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
