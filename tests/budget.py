"""The suite's time budget, a pytest plugin (registered in tests/conftest.py).

`make test` sets ``ROLLPACKER_TEST_BUDGET_S`` (2400: CI gives a submission 90 minutes in all, and
the suite must leave room for set-up and the tests still to come; the target is 25 minutes). When
the whole run took longer, the session fails after its last test, naming the slowest tests (setup,
call and teardown added up, so a slow module fixture is charged to the test that started it) and
the budget's setting. Without the variable (a `pytest -k ...` by hand) nothing is checked.

The budget is wall time on a machine as fast as the one it was set on (2 cores, the project's
kind). The same tree has taken 1.4x longer on another machine of that kind, so a slower machine
gets proportionally more: a fixed CPU-bound probe is timed at the start and at the end of the run,
and the budget is stretched by how much slower the slower of the two ran than ``REFERENCE_S``
(never shrunk, at most ``MAX_STRETCH``x). A suite that grows fails on any machine; a slow machine
alone does not fail it.

With ``ROLLPACKER_TEST_TIMELINE`` set to a path (`make test`: build/test-timeline.json) the run also
writes every test phase's worker, start and stop there, and prints each worker's busy time: where
a worker sat idle, waited on the CPU lock or ran the run's last test alone shows there. It also
prints the machine's memory over the run and, for a worker that died, why (tests/postmortem.py).
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from collections.abc import Callable

import pytest

from tests.postmortem import TIMELINE_ENV, MemoryWatch, crash_report, memory_line

BUDGET_ENV = "ROLLPACKER_TEST_BUDGET_S"
SHOWN = 15
REFERENCE_S = 0.195  # `probe()` on the machine the budget was set on (idle: 0.187-0.204 s)
MAX_STRETCH = 1.5


def probe(clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds of a fixed single-threaded CPU workload (best of 3), by ``clock``: wall time for the
    budget (it runs before the first test and after the last, when only the machine's own load
    weighs on it), ``time.process_time`` for the workload alone (what the suite's own load, beside
    a test that probes, cannot move)."""
    best = float("inf")
    for _ in range(3):
        t0 = clock()
        sum(i * i for i in range(5_000_000))
        best = min(best, clock() - t0)
    return best


def stretch(probe_s: float, reference_s: float = REFERENCE_S) -> float:
    """How much more time a machine that ran the probe in ``probe_s`` gets: 1 to ``MAX_STRETCH``."""
    return min(MAX_STRETCH, max(1.0, probe_s / reference_s))


class Budget:
    def __init__(self, budget_s: float, probe_s: float | None = None) -> None:
        self.budget_s = budget_s
        self.start = time.monotonic()
        self.probe_s = probe_s if probe_s is not None else probe()
        self.spent: defaultdict[str, float] = defaultdict(float)
        self.phases: list[dict[str, object]] = []

    def record(self, report: pytest.TestReport) -> None:
        self.spent[report.nodeid] += report.duration
        gateway = getattr(getattr(report, "node", None), "gateway", None)  # xdist's worker
        phase: dict[str, object] = {
            "nodeid": report.nodeid,
            "when": report.when,
            "worker": getattr(gateway, "id", "master"),
            "start": getattr(report, "start", 0.0),  # a crashed worker's report has no times
            "stop": getattr(report, "stop", 0.0),
            "outcome": report.outcome,
        }
        if report.failed and not getattr(report, "start", 0.0):
            phase["longrepr"] = str(report.longrepr)[-500:]
        self.phases.append(phase)

    def timed(self) -> list[dict[str, object]]:
        """The phases that ran: a worker's crash is reported as a phase with no times (0, 0)."""
        return [p for p in self.phases if float(p["start"]) > 0]  # type: ignore[arg-type]

    def crashed(self) -> list[tuple[str, str]]:
        """(worker, test) for each test whose worker died under it (pytest-xdist's report)."""
        return [
            (str(p["worker"]), str(p["nodeid"]))
            for p in self.phases
            if float(p["start"]) <= 0 and "crashed while running" in str(p.get("longrepr", ""))  # type: ignore[arg-type]
        ]

    def running_at(self, t: float) -> list[str]:
        """'<worker>: <test>' for each phase under way at ``t`` (epoch seconds)."""
        return [
            f"{p['worker']}: {p['nodeid']}"
            for p in self.timed()
            if float(p["start"]) <= t <= float(p["stop"])  # type: ignore[arg-type]
        ]

    def timeline(self, path: str, memory: dict[str, object] | None = None) -> str:
        """Writes the phases (and ``memory``, ``MemoryWatch.summary``) to ``path`` (JSON); returns
        a line of each worker's busy seconds and the workers that crashed."""
        busy: defaultdict[str, float] = defaultdict(float)
        timed = self.timed()
        for phase in timed:
            busy[str(phase["worker"])] += float(phase["stop"]) - float(phase["start"])  # type: ignore[arg-type]
        starts = [float(p["start"]) for p in timed]  # type: ignore[arg-type]
        stops = [float(p["stop"]) for p in timed]  # type: ignore[arg-type]
        span = (max(stops) - min(starts)) if timed else 0.0
        crashed = self.crashed()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            doc = {
                "span_s": span,
                "busy_s": dict(busy),
                "crashed": crashed,
                "memory": memory,
                "phases": self.phases,
            }
            json.dump(doc, f)
        workers = ", ".join(f"{w} busy {s:.0f} s" for w, s in sorted(busy.items()))
        return f"timeline: {path} ({workers} of {span:.0f} s from the first test to the last)"

    def verdict(self, elapsed_s: float, probe_s: float | None = None) -> str | None:
        """The failure message when the run went over budget; None when it kept to it.
        ``probe_s``: the probe's time at the end of the run (the slower of the two counts)."""
        factor = stretch(max(self.probe_s, probe_s or 0.0))
        allowed_s = self.budget_s * factor
        if elapsed_s <= allowed_s:
            return None
        slowest = sorted(self.spent.items(), key=lambda kv: -kv[1])[:SHOWN]
        lines = [
            f"the test run took {elapsed_s / 60:.1f} min, over its budget of {allowed_s / 60:.1f} min "
            f"({BUDGET_ENV} = {self.budget_s:g} s, x{factor:.2f} for this machine's speed); make the "
            "slowest tests cheaper (share a service or an engine, merge runs that cover one path) "
            "before adding more. The slowest:",
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
_memory: MemoryWatch | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _budget, _memory
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: the controller keeps the budget
        return
    _budget = budget_from_env()
    if _budget is not None and os.environ.get(TIMELINE_ENV, "").strip():
        _memory = MemoryWatch()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _budget is not None:
        _budget.record(report)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _budget is None:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    timeline_path = os.environ.get(TIMELINE_ENV, "").strip()
    if timeline_path and reporter is not None:
        memory = _memory.summary() if _memory is not None else None
        reporter.write("\n")
        reporter.write_line(_budget.timeline(timeline_path, memory))
        if memory is not None:
            reporter.write_line(memory_line(memory, _budget.running_at(float(memory["least_at"]))))  # type: ignore[arg-type]
        for worker, nodeid in _budget.crashed():
            reporter.write_sep("=", f"worker {worker} died in {nodeid}", red=True)
            reporter.write_line(crash_report(worker, timeline_path, memory))
    message = _budget.verdict(time.monotonic() - _budget.start, probe())
    if message is None:
        return
    if reporter is not None:
        reporter.write_sep("=", "over the time budget", red=True)
        reporter.write_line(message)
    if session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
