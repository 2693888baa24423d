"""Why a test worker died, a pytest plugin (registered in tests/conftest.py).

A pytest-xdist worker that dies leaves one line in the run's output: "worker 'gw1' crashed while
running <test>". Whatever the worker printed on its way out went to a stream nobody keeps, so a
crash in CI could not be told apart from a hang, a segfault or the OOM killer. Under `make test`
(``ROLLPACKER_TEST_TIMELINE`` set) each worker keeps a trace file of its own,
``<timeline's directory>/test-postmortem/<worker>.log``, written only when it dies:

- a test past pytest-timeout's limit (``timeout`` in pyproject.toml, the thread method): the test,
  the limit and every thread's stack, then the worker exits as pytest-timeout's own timer does;
- a fatal signal Python can trace (SIGSEGV, SIGABRT, SIGBUS, SIGILL, SIGFPE): ``faulthandler``'s
  report, every thread's stack;
- a SIGKILL leaves nothing: the OOM killer, or a test that killed a process it should not have.

The controller watches the machine's memory over the run (``MemoryWatch``: the least available,
when, and the kernel's OOM kills from ``/proc/vmstat`` with their victims from the kernel log) and,
for each worker that died, prints which of these it was (``crash_report``).
"""

from __future__ import annotations

import faulthandler
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import pytest

TIMELINE_ENV = "ROLLPACKER_TEST_TIMELINE"
VMSTAT = "/proc/vmstat"
TIMEOUT_HEAD = "timeout:"
SHOWN_LINES = 60  # of a dead worker's trace, in the run's output
_OOM_VICTIM = re.compile(r"Out of memory: Killed process (\d+) \(([^)]*)\)")


def postmortem_dir(timeline: str) -> Path:
    return Path(timeline).resolve().parent / "test-postmortem"


def trace_path(timeline: str, worker: str) -> Path:
    return postmortem_dir(timeline) / f"{worker}.log"


# -- the machine's memory ---------------------------------------------------------------------------


def oom_kills(vmstat: str = VMSTAT) -> int | None:
    """The kernel's count of OOM kills since boot (``oom_kill`` in /proc/vmstat); None where the
    kernel does not say."""
    try:
        with open(vmstat) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        return None
    return None


def oom_victims(kernel_log: str) -> list[str]:
    """'<pid> (<name>)' of each process the OOM killer took, from the kernel log's text."""
    return [f"{m.group(1)} ({m.group(2)})" for m in _OOM_VICTIM.finditer(kernel_log)]


def kernel_log() -> str:
    """``dmesg``'s text, or "" where it cannot be read (no permission, no dmesg)."""
    try:
        return subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _available_gib() -> tuple[float, float]:
    import psutil

    vm = psutil.virtual_memory()
    return vm.total / 2**30, vm.available / 2**30


class MemoryWatch:
    """The machine's available memory, sampled every ``every_s`` in a daemon thread of the
    controller, and the kernel's OOM kills from its start to ``summary``."""

    def __init__(
        self,
        every_s: float = 2.0,
        available: Callable[[], tuple[float, float]] | None = None,
        kills: Callable[[], int | None] = oom_kills,
        log: Callable[[], str] = kernel_log,
    ) -> None:
        self._available = available or _available_gib
        self._kills, self._log = kills, log
        self.kills0 = kills()
        self.total_gib, least = self._available()
        self.least: tuple[float, float] = (least, time.time())  # GiB available, when
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True, name="memory-watch")
        self._thread.start()

    def _run(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            self.sample()

    def sample(self) -> None:
        _, avail = self._available()
        if avail < self.least[0]:
            self.least = (avail, time.time())

    def summary(self) -> dict[str, Any]:
        """Stops the watch: the least available memory (GiB, when), the total, the OOM kills during
        the run (None where the kernel does not count them) and, when there were any, their
        victims as the kernel log names them."""
        self._stop.set()
        self._thread.join(timeout=10)
        self.sample()
        now = self._kills()
        kills = None if now is None or self.kills0 is None else now - self.kills0
        victims = oom_victims(self._log())[-kills:] if kills else []
        return {
            "total_gib": self.total_gib,
            "least_available_gib": self.least[0],
            "least_at": self.least[1],
            "oom_kills": kills,
            "oom_victims": victims,
        }


def memory_line(memory: dict[str, Any], running: list[str]) -> str:
    """The run's memory in a line: the least available, when, what ran then, the OOM kills."""
    at = time.strftime("%H:%M:%S", time.localtime(float(memory["least_at"])))
    line = (
        f"memory: least available {memory['least_available_gib']:.1f} GiB of {memory['total_gib']:.1f} GiB "
        f"at {at} ({'; '.join(running) or 'no test running'})"
    )
    kills = memory["oom_kills"]
    if kills is None:
        return line + "; OOM kills: not counted by this kernel"
    line += f"; OOM kills during the run: {kills}"
    if kills:
        victims = memory["oom_victims"]
        line += f" ({', '.join(victims) if victims else 'victims not in a readable kernel log'})"
    return line


# -- a dead worker's cause -------------------------------------------------------------------------


def crash_report(worker: str, timeline: str, memory: dict[str, Any] | None) -> str:
    """Why ``worker`` died, from its trace file and the run's OOM kills: the cause in a line, then
    the first ``SHOWN_LINES`` lines of the trace (the whole trace stays in the file)."""
    path = trace_path(timeline, worker)
    try:
        trace = path.read_text(errors="replace")
    except OSError:
        trace = ""
    kills = (memory or {}).get("oom_kills")
    oom = (
        f"; the OOM killer took {', '.join((memory or {}).get('oom_victims') or ['a process'])}"
        if kills
        else ""
    )
    lines = trace.splitlines()
    if trace.startswith(TIMEOUT_HEAD):
        cause = f"{lines[0]} (every thread's stack: {path})"
    elif "Fatal Python error" in trace:
        first = next(x for x in lines if "Fatal Python error" in x)
        cause = f"{first.strip()} (faulthandler's report: {path})"
    else:
        cause = "no trace: the worker was killed by a signal it cannot catch (SIGKILL)"
        if oom:
            return cause + oom
        if kills is None:
            return cause + "; this kernel does not count OOM kills"
        return cause + "; no OOM kill counted: a test killed a process of the suite's own?"
    return "\n".join([cause + oom, *_stacks_shown(lines[1:])])


def _stacks_shown(lines: list[str], per_thread: int = 25) -> list[str]:
    """The first ``SHOWN_LINES`` lines of a faulthandler dump, the thread that ran the test first
    (the one inside pytest's ``runtestprotocol``), each thread cut at ``per_thread`` frames."""
    blocks: list[list[str]] = []
    for line in lines:
        if line.startswith(("Thread 0x", "Current thread 0x")) or not blocks:
            blocks.append([])
        if line.strip():
            blocks[-1].append(line)
    blocks.sort(key=lambda b: not any("runtestprotocol" in x for x in b))
    shown = [x for b in blocks for x in b[: per_thread + 1]]
    if len(shown) > SHOWN_LINES:
        shown = [*shown[:SHOWN_LINES], "... (the whole dump in the trace file)"]
    return shown


# -- in each worker -------------------------------------------------------------------------------

_trace: list[IO[str]] = []  # the worker's open trace file (faulthandler keeps its descriptor)
_TIMER = pytest.StashKey[threading.Timer]()


def _worker_trace(config: pytest.Config) -> IO[str] | None:
    if _trace:
        return _trace[0]
    timeline = os.environ.get(TIMELINE_ENV, "").strip()
    workerinput = getattr(config, "workerinput", None)
    if not timeline or workerinput is None:
        return None
    path = trace_path(timeline, str(workerinput["workerid"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    _trace.append(open(path, "w"))  # noqa: SIM115 - open for the worker's whole life
    return _trace[0]


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    """A worker: fatal signals traced into its file (after pytest's own faulthandler set-up, which
    writes to a stderr nobody keeps under xdist). The controller: last run's traces removed."""
    timeline = os.environ.get(TIMELINE_ENV, "").strip()
    if not timeline:
        return
    if not hasattr(config, "workerinput"):
        for old in postmortem_dir(timeline).glob("*.log"):
            old.unlink(missing_ok=True)
        return
    f = _worker_trace(config)
    if f is not None:
        faulthandler.enable(file=f, all_threads=True)


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool | None:
    """pytest-timeout's thread method, with the stacks written to the worker's trace file first
    (pytest-timeout writes them to the worker's terminal, which xdist does not keep)."""
    f = _worker_trace(item.config)
    if f is None or settings.method != "thread" or not settings.timeout:
        return None  # pytest-timeout's own timer

    def expire() -> None:
        f.write(f"{TIMEOUT_HEAD} {item.nodeid} ran past pytest-timeout's {settings.timeout:g} s\n")
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.flush()
        sys.stderr.flush()
        os._exit(1)  # as pytest-timeout's thread method: the worker ends, xdist reports a crash

    timer = threading.Timer(settings.timeout, expire)
    timer.name = f"timeout {item.nodeid}"
    timer.daemon = True
    item.stash[_TIMER] = timer
    timer.start()
    return True


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> bool | None:
    timer = item.stash.get(_TIMER, None)
    if timer is None:
        return None
    timer.cancel()
    timer.join()
    del item.stash[_TIMER]
    return True
