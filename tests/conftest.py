"""Shared fixtures: small traces and prompt helpers; the session's checkpoint downloads removed at
its end."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from rollpacker.core.trace import TraceRecord, to_prompts
from rollpacker.core.types import Prompt

pytest_plugins = ["tests.postmortem", "tests.budget"]  # the time budget, why a worker died (`make test`)

# The property tests draw the same examples on every run of the suite ("gate"), so a property that
# fails fails on every run, not once in a while in CI. `--hypothesis-profile=explore` draws new ones
# (pin what it finds with @example). Neither profile fails on time (a deadline, a slow data
# generation): the suite runs on a loaded machine, and a timing is not a property.
settings.register_profile(
    "gate", derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "explore", derandomize=False, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("hypothesis_profile", None) is None:
        settings.load_profile("gate")


# `make test` runs the suite on two pytest-xdist workers (`-n 2 --dist loadscope`, with the
# scheduler below). A test module goes to one worker whole (its module and session fixtures start
# once). The modules with a slow test (real engines, Ray, servers, whole runs) form two units of
# work, each run one module after another on one worker, side by side: "serial-sandbox" holds every
# module that runs the code sandbox (its leak check looks at every jailed process on the machine, so
# no other sandbox may run beside it: the rewards' modules and any module that names the sandbox or a
# code task) and, for balance, the modules of BESIDE_SANDBOX; "serial" holds the rest. A slow module
# measured at about one busy core (docs/testing.md), two of them side by side fill the machine's two
# cores. The fast modules are units of their own and fill the gaps. Also serial: the modules that
# start Ray or the local services from fast tests. A test whose check depends on the machine's speed
# (a profile, a predicted trajectory, a timed probe) is marked `alone`: it holds the CPU lock
# exclusively, so the other worker's slow tests wait for it (every slow test holds the lock shared;
# `cpu_lock` below). The grouping is by the module's source, read by the controller, which collects
# nothing itself; xdist's own `xdist_group` marks are not used: under pytest 9.2 they group nothing
# (seen: a module's marked tests on both workers).
SERIAL_ALWAYS = (
    "tests/rewards/",
    "tests/services/test_placement.py",
    "tests/experiment/test_experiment_preflight.py",
)
SERIAL = "serial"
SANDBOX_UNIT = "serial-sandbox"
# whole runs and service tests that do not run the sandbox, placed beside the sandbox's users so
# that the two units take about as long (1,497 s and 1,469 s of module time in the last measured run)
BESIDE_SANDBOX = (
    "tests/experiment/test_pipeline_faults.py",
    "tests/experiment/test_inline_runner.py",
    "tests/store/",
    "tests/test_secrets.py",
    "tests/services/test_fail_fast.py",
)
_RUNS_SANDBOX = re.compile(r"sandbox|synthetic_code|humaneval|mixed", re.IGNORECASE)


def serial_module(path: str, source: str) -> bool:
    """Whether the test module at ``path`` (relative to the repository) runs in a serial unit."""
    return path.startswith(SERIAL_ALWAYS) or "pytest.mark.slow" in source


def unit_of(path: str, source: str) -> str | None:
    """The serial unit of the test module at ``path``, or None for a fast module (its own unit)."""
    if not serial_module(path, source):
        return None
    if path.startswith(("tests/rewards/", *BESIDE_SANDBOX)) or _RUNS_SANDBOX.search(source):
        return SANDBOX_UNIT
    return SERIAL


def run_order(items: list[pytest.Item]) -> list[pytest.Item]:
    """The collected tests in the order a unit runs them (collection order; the order is kept
    within each part): first every module that holds an ``alone`` test, then the rest, then the
    modules with an ``e2e`` test (whole runs, minutes each). An ``alone`` test waits for whatever
    test the other unit runs at that moment; early, that is a short one. Measured: one waited 235 s
    for the chaos run the other unit had started 2 s before (and 371 s of waits in an earlier run,
    with the ``alone`` tests late in their units)."""

    def part(item: pytest.Item) -> int:
        module = item.nodeid.split("::", 1)[0]
        return 0 if module in alone else 2 if module in e2e else 1

    alone = {item.nodeid.split("::", 1)[0] for item in items if item.get_closest_marker("alone")}
    e2e = {item.nodeid.split("::", 1)[0] for item in items if item.get_closest_marker("e2e")}
    return sorted(items, key=part)


# A whole run (``e2e``) may first build its task's warm-up on an empty model cache (CI's machine,
# every time): seen on a fresh clone, the chaos run built the code task's warm-up in 549 s beside
# the other worker's tests, then ran its two runs, ~15 min in all, the default timeout
# (pyproject.toml). Its hang is caught after this instead; every other test keeps the default.
E2E_TIMEOUT_S = 1800


def e2e_timeouts(items: list[pytest.Item]) -> None:
    """``E2E_TIMEOUT_S`` for each whole run that sets no timeout of its own."""
    for item in items:
        if item.get_closest_marker("e2e") is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(E2E_TIMEOUT_S))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items[:] = run_order(items)
    e2e_timeouts(items)


def scope_of(nodeid: str, root: Path, cache: dict[str, str]) -> str:
    """The unit of work a test belongs to: a serial unit's name, or its module's path."""
    path = nodeid.split("::", 1)[0]
    if path not in cache:
        try:
            source = (root / path).read_text()
        except OSError:
            source = ""
        cache[path] = unit_of(path, source) or path
    return cache[path]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Under ``--dist loadscope``: xdist's scope scheduler, its scopes the units above."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    root, cache = Path(config.rootpath), {}

    class SerialSlowScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid, root, cache)

    return SerialSlowScheduling(config, log)


class CpuLock:
    """A readers-writer lock between the suite's worker processes, on two files: every slow test
    holds ``cpu`` shared, a test marked ``alone`` holds it exclusively. A writer first takes ``gate``
    and keeps it until it is done, and a reader passes through ``gate`` before it takes ``cpu``, so a
    waiting writer is never starved by a stream of readers (flock itself queues nobody)."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.gate_path, self.cpu_path = directory / "gate.lock", directory / "cpu.lock"

    @contextlib.contextmanager
    def hold(self, exclusive: bool) -> Iterator[None]:
        with open(self.gate_path, "a") as gate, open(self.cpu_path, "a") as cpu:
            fcntl.flock(gate, fcntl.LOCK_EX)
            try:
                fcntl.flock(cpu, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            finally:
                if not exclusive:
                    fcntl.flock(gate, fcntl.LOCK_UN)
            try:
                yield
            finally:
                fcntl.flock(cpu, fcntl.LOCK_UN)
                if exclusive:
                    fcntl.flock(gate, fcntl.LOCK_UN)


_CPU_LOCK: list[CpuLock | None] = []  # this worker's, made at its first slow test


def _cpu_lock_of(config: pytest.Config) -> CpuLock | None:
    """The run's CPU lock (its files beside the workers' temporary directories), or None in one
    process (no xdist: nothing runs beside)."""
    if not _CPU_LOCK:
        if not hasattr(config, "workerinput"):
            _CPU_LOCK.append(None)
        else:
            base = config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
            _CPU_LOCK.append(CpuLock(base.parent / "cpu-lock"))
    return _CPU_LOCK[0]


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """A slow test holds the CPU lock shared, an ``alone`` test exclusively (see ``CpuLock``), for
    its whole protocol: the set-up of the module fixtures it starts (engines, servers) and the
    teardown of those it ends included (a function fixture took it only after them: a test timed
    by an ``alone`` test ran beside the other worker's engines starting). Outside pytest-timeout's
    timer (``tryfirst``: the outer wrapper), so the wait for the lock is not charged to the test."""
    alone = item.get_closest_marker("alone") is not None
    lock = _cpu_lock_of(item.config) if alone or item.get_closest_marker("slow") is not None else None
    if lock is None:
        yield
        return
    with lock.hold(exclusive=alone):
        yield


def make_prompts(lens: list[list[int]], prefix: str = "p") -> list[Prompt]:
    recs = [
        TraceRecord(prompt_id=f"{prefix}{i:03d}", prompt_len=4 + i % 5, response_lens=tuple(ls))
        for i, ls in enumerate(lens)
    ]
    return to_prompts(recs, vocab_size=259)


@pytest.fixture(scope="session", autouse=True)
def _checkpoint_downloads_of_this_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The services keep the checkpoints they download in ``$ROLLPACKER_CACHE/checkpoints`` (for a
    user's next run); the suite's end-to-end runs put ~1 GB there each time (measured: 47 entries,
    1.0 GB after two runs), which would fill a machine's disk run by run. The session downloads
    into a directory of its own instead (``$ROLLPACKER_CHECKPOINT_CACHE``, inherited by the stage
    processes and forwarded to the services), removed at its end: removing what appeared in the
    shared directory during the session also removed the downloads of another session running
    at the same time, mid-read. The warmed-up models stay in the shared cache."""
    from rollpacker.services.base import CHECKPOINT_CACHE_ENV

    root = tmp_path_factory.mktemp("checkpoints")
    before = os.environ.get(CHECKPOINT_CACHE_ENV)
    os.environ[CHECKPOINT_CACHE_ENV] = str(root)
    yield
    if before is None:
        os.environ.pop(CHECKPOINT_CACHE_ENV, None)
    else:
        os.environ[CHECKPOINT_CACHE_ENV] = before
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def prompts_factory():
    return make_prompts
