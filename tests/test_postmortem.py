"""Why a test worker died (tests/postmortem.py): a worker that hangs past the timeout, segfaults or
is SIGKILLed under pytest-xdist is named with its cause and its stacks, the run's timeline keeps
its real span, and the run's OOM kills are counted and their victims named."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.budget import BUDGET_ENV
from tests.postmortem import TIMELINE_ENV, MemoryWatch, memory_line, oom_kills, oom_victims, trace_path

pytest_plugins = ["pytester"]
ROOT = Path(__file__).resolve().parents[1]

DYING = """
import ctypes, os, signal, time

def test_hangs():
    time.sleep(60)

def test_segfaults():
    ctypes.string_at(0)

def test_is_killed():
    os.kill(os.getpid(), signal.SIGKILL)

def test_lives():
    pass
"""


def _run(pytester: pytest.Pytester, timeline: Path, test: str) -> pytest.RunResult:
    pytester.makeconftest('pytest_plugins = ["tests.postmortem", "tests.budget"]\n')
    path = os.environ.get("PYTHONPATH", "")
    pytester._monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, (str(ROOT), path))))
    pytester._monkeypatch.setenv(BUDGET_ENV, "600")
    pytester._monkeypatch.setenv(TIMELINE_ENV, str(timeline))
    pytester.makepyfile(test_it=DYING)
    return pytester.runpytest_subprocess(
        "-q", "-p", "xdist", "-n", "1", "-p", "timeout", "-o", "timeout_method=thread", "--timeout", "4",
        f"test_it.py::{test}", "test_it.py::test_lives",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("test", "cause", "frame"),
    [
        (
            "test_hangs",
            "timeout: test_it.py::test_hangs ran past pytest-timeout's 4 s*",
            "*test_it.py*line 4 in test_hangs",
        ),
        ("test_segfaults", "Fatal Python error: Segmentation fault*", "*test_it.py*line 7 in test_segfaults"),
        ("test_is_killed", "no trace: the worker was killed by a signal it cannot catch (SIGKILL)*", None),
    ],
)
def test_a_dead_worker_is_named_with_its_cause_and_stacks(
    pytester: pytest.Pytester, tmp_path: Path, test: str, cause: str, frame: str | None
) -> None:
    """xdist alone says "worker 'gw0' crashed"; and its report of the dead test has no times (0, 0),
    which once made the timeline's span "1795894313 s" (now minus the epoch)."""
    timeline = tmp_path / "build" / "timeline.json"
    result = _run(pytester, timeline, test)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    out = result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "timeline: * of * s from the first test to the last)",
            "memory: least available * GiB of * GiB at *; OOM *",
            f"*worker gw0 died in test_it.py::{test}*",
            cause,
            *([frame] if frame else []),
        ]
    )
    assert "1 passed" in out  # the worker xdist started in its place ran the rest
    data = json.loads(timeline.read_text())
    assert data["crashed"] == [["gw0", f"test_it.py::{test}"]]
    assert 0 <= data["span_s"] < 120, data["span_s"]
    assert data["memory"]["least_available_gib"] <= data["memory"]["total_gib"]
    if frame:
        assert trace_path(str(timeline), "gw0").read_text().count("Thread") >= 1  # every thread's stack


KERNEL_LOG = """
[ 812.1] python invoked oom-killer: gfp_mask=0x140cca(GFP_HIGHUSER_MOVABLE|__GFP_COMP), order=0
[ 812.2] Out of memory: Killed process 4242 (ray::RolloutSer) total-vm:9000kB, anon-rss:8000kB
[ 950.0] Out of memory: Killed process 5151 (python) total-vm:12000kB, anon-rss:11000kB
"""


def test_the_oom_kills_of_the_run_are_counted_and_their_victims_named(tmp_path: Path) -> None:
    vmstat = tmp_path / "vmstat"
    vmstat.write_text("nr_free_pages 1\noom_kill 7\nfoo 2\n")
    assert oom_kills(str(vmstat)) == 7
    assert oom_kills(str(tmp_path / "none")) is None
    assert oom_victims(KERNEL_LOG) == ["4242 (ray::RolloutSer)", "5151 (python)"]

    kills = iter([3, 4])
    avail = iter([(24.0, 20.0), (24.0, 1.5), (24.0, 9.0), (24.0, 12.0)])
    watch = MemoryWatch(
        every_s=3600, available=lambda: next(avail), kills=lambda: next(kills), log=lambda: KERNEL_LOG
    )
    watch.sample()  # the least, 1.5 GiB
    watch.sample()
    memory = watch.summary()
    assert memory["oom_kills"] == 1 and memory["oom_victims"] == ["5151 (python)"]  # this run's only
    assert memory["least_available_gib"] == 1.5 and memory["total_gib"] == 24.0
    line = memory_line(memory, ["gw1: tests/experiment/test_chaos.py::test_x"])
    assert (
        "least available 1.5 GiB of 24.0 GiB" in line
        and "gw1: tests/experiment/test_chaos.py::test_x" in line
    )
    assert line.endswith("OOM kills during the run: 1 (5151 (python))")

    uncounted = MemoryWatch(every_s=3600, available=lambda: (8.0, 4.0), kills=lambda: None, log=str)
    assert memory_line(uncounted.summary(), []).endswith("OOM kills: not counted by this kernel")
