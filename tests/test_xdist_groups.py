"""The suite's units of work under pytest-xdist (`make test` runs two workers with the scheduler
of tests/conftest.py): a module goes to one worker whole; every module with a slow test (or one that
starts real services from fast tests, or runs the sandbox) is in one of two serial units, every
module that runs the sandbox in the same one; the fast modules are units of their own. A test marked
``alone`` holds the CPU lock exclusively, every slow test holds it shared."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import (
    BESIDE_SANDBOX,
    E2E_TIMEOUT_S,
    SANDBOX_UNIT,
    SERIAL,
    CpuLock,
    e2e_timeouts,
    run_order,
    scope_of,
    serial_module,
    unit_of,
)

ROOT = Path(__file__).resolve().parents[1]
pytest_plugins = ["pytester"]


def test_a_module_with_a_slow_test_is_serial_and_a_fast_one_is_its_own_unit(tmp_path: Path) -> None:
    (tmp_path / "tests" / "a").mkdir(parents=True)
    (tmp_path / "tests/a/test_slow.py").write_text("import pytest\n@pytest.mark.slow\ndef test_x(): pass\n")
    (tmp_path / "tests/a/test_fast.py").write_text("def test_y(): pass\n")
    cache: dict[str, str] = {}
    assert scope_of("tests/a/test_slow.py::test_x[p1]", tmp_path, cache) == SERIAL
    assert scope_of("tests/a/test_fast.py::test_y", tmp_path, cache) == "tests/a/test_fast.py"
    assert scope_of("tests/a/test_fast.py::Cls::test_z", tmp_path, cache) == "tests/a/test_fast.py"


def test_the_sandbox_and_the_fast_modules_that_start_services_are_serial() -> None:
    assert serial_module("tests/rewards/test_sandbox.py", "")
    assert serial_module("tests/services/test_placement.py", "")
    assert not serial_module("tests/core/test_serde.py", "def test(): pass")


def test_every_module_that_runs_the_sandbox_is_in_the_sandbox_unit(tmp_path: Path) -> None:
    slow = "import pytest\n@pytest.mark.slow\ndef test_x(): pass\n"
    assert unit_of("tests/rewards/test_new.py", "def test_x(): pass\n") == SANDBOX_UNIT
    assert unit_of("tests/x/test_a.py", slow + "cfg = 'task: {name: synthetic_code}'\n") == SANDBOX_UNIT
    assert unit_of("tests/x/test_b.py", slow + "from rollpacker.rewards import sandbox\n") == SANDBOX_UNIT
    assert unit_of("tests/x/test_c.py", slow + "cfg = 'task: {name: mixed}'\n") == SANDBOX_UNIT
    assert unit_of("tests/x/test_d.py", slow) == SERIAL
    assert unit_of("tests/x/test_e.py", "def test_x(): pass\n") is None


def test_the_real_tree_splits_the_slow_modules_into_the_two_units() -> None:
    cache: dict[str, str] = {}
    for nodeid, unit in (
        ("tests/experiment/test_chaos.py::test_faults", SANDBOX_UNIT),  # its sandbox-hang fault
        ("tests/experiment/test_dynamic_sampling_run.py::test_x", SANDBOX_UNIT),
        ("tests/lab/bench/test_reward_bench.py::test_x", SANDBOX_UNIT),
        ("tests/experiment/test_inline_runner.py::test_x", SANDBOX_UNIT),  # BESIDE_SANDBOX
        ("tests/experiment/test_two_nodes.py::test_x", SERIAL),
        ("tests/trainers/megatron/test_gang.py::test_x", SERIAL),
        ("tests/engines/test_layout.py::test_x", SERIAL),
    ):
        assert scope_of(nodeid, ROOT, cache) == unit, nodeid
    assert scope_of("tests/core/test_serde.py::test_x", ROOT, cache) == "tests/core/test_serde.py"
    for entry in BESIDE_SANDBOX:  # no stale entry: each names a slow module or a folder of some
        assert (ROOT / entry).exists(), entry
        paths = [ROOT / entry] if entry.endswith(".py") else sorted((ROOT / entry).glob("test_*.py"))
        assert any(serial_module(entry, p.read_text()) for p in paths), entry


class _Item:
    def __init__(self, nodeid: str, *marks: str) -> None:
        self.nodeid, self.marks = nodeid, marks

    def get_closest_marker(self, name: str) -> object | None:
        return object() if name in self.marks else None


def test_the_alone_modules_run_first_the_whole_runs_last_and_the_order_is_kept_otherwise() -> None:
    items = [
        _Item("tests/a/test_1.py::test_x"),
        _Item("tests/w/test_run.py::test_whole_run", "e2e", "slow"),
        _Item("tests/b/test_2.py::test_y"),
        _Item("tests/c/test_3.py::test_before"),
        _Item("tests/c/test_3.py::test_timed", "alone"),
        _Item("tests/d/test_4.py::test_z"),
        _Item("tests/v/test_run.py::test_other_run", "e2e"),
        _Item("tests/e/test_5.py::test_timed[p]", "alone"),
    ]
    ordered = [i.nodeid for i in run_order(items)]  # type: ignore[arg-type]
    assert ordered == [
        "tests/c/test_3.py::test_before",  # the whole module moves, its own order kept
        "tests/c/test_3.py::test_timed",
        "tests/e/test_5.py::test_timed[p]",
        "tests/a/test_1.py::test_x",
        "tests/b/test_2.py::test_y",
        "tests/d/test_4.py::test_z",
        "tests/w/test_run.py::test_whole_run",
        "tests/v/test_run.py::test_other_run",
    ]


def test_an_alone_test_waits_for_the_shared_holders_and_is_not_starved(tmp_path: Path) -> None:
    lock, events, lock_events = CpuLock(tmp_path / "lock"), [], threading.Lock()

    def note(e: str) -> None:
        with lock_events:
            events.append(e)

    first_release, writer_release = threading.Event(), threading.Event()

    # "out" is noted while the lock is still held: noted after the release, another holder's "in"
    # could come first (seen once in a suite run) although the lock kept them apart
    def reader(name: str, release: threading.Event | None) -> None:
        with lock.hold(exclusive=False):
            note(f"{name} in")
            if release is not None:
                release.wait(10)
            note(f"{name} out")

    def writer() -> None:
        with lock.hold(exclusive=True):
            note("alone in")
            writer_release.wait(10)
            note("alone out")

    r1 = threading.Thread(target=reader, args=("r1", first_release))
    r1.start()
    while "r1 in" not in events:
        time.sleep(0.01)
    w = threading.Thread(target=writer)
    w.start()
    time.sleep(0.3)
    r2 = threading.Thread(target=reader, args=("r2", None))  # arrives while the alone test waits
    r2.start()
    time.sleep(0.3)
    assert events == ["r1 in"]  # the alone test waits for r1; r2 waits behind the alone test
    first_release.set()
    while "alone in" not in events:
        time.sleep(0.01)
    time.sleep(0.3)
    assert "r2 in" not in events  # nothing shared runs beside the alone test
    writer_release.set()
    for t in (r1, w, r2):
        t.join(10)
    assert events.index("alone out") < events.index("r2 in")


_LOCKED_CONFTEST = """
from tests.conftest import pytest_runtest_protocol  # noqa: F401 - the suite's CPU lock

def pytest_configure(config):
    config.addinivalue_line("markers", "slow: slow")
    config.addinivalue_line("markers", "alone: alone")
"""
_ENGINES = """
import os, time, pytest

@pytest.fixture(scope="module")
def engines():
    t0 = time.time()
    time.sleep(1.5)  # engines starting
    open(os.path.join(os.environ["OUT"], "engines"), "w").write(f"{t0} {time.time()}")
    yield

@pytest.mark.slow
def test_with_engines(engines):
    pass
"""
_TIMED = """
import os, time, pytest

@pytest.fixture(scope="module")
def late():
    time.sleep(0.5)  # the other worker's engines have begun to start
    yield

@pytest.mark.slow
@pytest.mark.alone
def test_timed(late):
    t0 = time.time()
    time.sleep(0.5)
    open(os.path.join(os.environ["OUT"], "alone"), "w").write(f"{t0} {time.time()}")
"""


def test_an_alone_test_never_runs_beside_another_workers_module_fixtures(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """The lock is held from a test's first fixture to its last teardown: a module fixture that
    starts engines for a slow test counts as that test's work (with the lock taken in a function
    fixture, after the module's, the timed test ran beside the engines starting)."""
    pytester.makeconftest(_LOCKED_CONFTEST)
    pytester.makepyfile(test_engines=_ENGINES, test_timed=_TIMED)
    path = os.environ.get("PYTHONPATH", "")
    pytester._monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, (str(ROOT), path))))
    pytester._monkeypatch.setenv("OUT", str(tmp_path))
    result = pytester.runpytest_subprocess("-q", "-n", "2", "--dist", "loadfile", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    (e0, e1), (a0, a1) = (map(float, (tmp_path / f).read_text().split()) for f in ("engines", "alone"))
    assert a1 <= e0 or a0 >= e1, f"the alone test ran {a0:.2f}-{a1:.2f} beside the fixture {e0:.2f}-{e1:.2f}"


def test_a_whole_run_gets_the_longer_timeout_and_keeps_its_own(pytester: pytest.Pytester) -> None:
    """A whole run may build a warm-up first (~9 min on an empty cache beside the other worker):
    it gets ``E2E_TIMEOUT_S``; one that sets its own keeps it; the rest keep the default (none)."""
    items = pytester.getitems(
        "import pytest\n"
        "@pytest.mark.e2e\ndef test_run(): pass\n"
        "@pytest.mark.e2e\n@pytest.mark.timeout(60)\ndef test_own(): pass\n"
        "def test_fast(): pass\n"
    )
    e2e_timeouts(items)
    got = {i.name: [m.args for m in i.iter_markers("timeout")] for i in items}
    assert got == {"test_run": [(E2E_TIMEOUT_S,)], "test_own": [(60,)], "test_fast": []}
    assert E2E_TIMEOUT_S > 900
