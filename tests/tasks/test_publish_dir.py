"""A cache entry built by two processes at once (the suite's two workers, or pods sharing a cache
volume) is built once: the second waits for the first's lock and takes its result
(``tasks/tiny_model.py``, ``publish_dir``); it never replaces a published entry under a reader."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from rollpacker.tasks.tiny_model import publish_dir


def _marker(d: Path) -> bool:
    return (d / "done.json").is_file()


def test_concurrent_builds_of_one_entry_build_it_once(tmp_path: Path) -> None:
    out = tmp_path / "models" / "warm-x-123"
    builds: list[int] = []
    started = threading.Event()

    def build(tmp: Path) -> None:
        builds.append(threading.get_ident())
        started.set()
        time.sleep(0.5)  # the second caller arrives while this one trains
        (tmp / "weights").write_text("w")
        (tmp / "done.json").write_text("{}")

    results: list[Path] = []
    first = threading.Thread(target=lambda: results.append(publish_dir(out, build, _marker)))
    first.start()
    assert started.wait(10)
    inode_seen = []

    def second() -> None:
        results.append(publish_dir(out, build, _marker))
        inode_seen.append((out / "weights").stat().st_ino)

    t2 = threading.Thread(target=second)
    t2.start()
    first.join(10)
    t2.join(10)
    assert results == [out, out]
    assert len(builds) == 1, "the entry was built twice"
    assert inode_seen == [(out / "weights").stat().st_ino]  # the published entry was not replaced
    assert sorted(p.name for p in out.parent.iterdir()) == ["warm-x-123", "warm-x-123.lock"]  # no temp left


def test_an_incomplete_entry_is_built_again_and_none_means_rebuild(tmp_path: Path) -> None:
    out = tmp_path / "e"
    out.mkdir()
    (out / "weights").write_text("half")  # a directory without its marker (not ours: no rename)
    calls: list[str] = []

    def build(tmp: Path) -> None:
        calls.append("b")
        (tmp / "done.json").write_text("{}")

    publish_dir(out, build, _marker)
    assert calls == ["b"] and _marker(out) and not (out / "weights").exists()
    publish_dir(out, build, _marker)  # complete: taken as it is
    assert calls == ["b"]
    publish_dir(out, build)  # no completeness check (force): built again
    assert calls == ["b", "b"]


KILLED_BUILDER = """
import sys, time
from pathlib import Path
from rollpacker.tasks.tiny_model import publish_dir

def build(tmp):
    (tmp / "weights").write_text("half")
    print("building", flush=True)
    time.sleep(60)

publish_dir(Path(sys.argv[1]), build, lambda d: (d / "done.json").is_file())
"""


def test_a_killed_builders_temporary_is_removed_by_the_next_build_of_its_entry_only(tmp_path: Path) -> None:
    out = tmp_path / "models" / "warm-x-123"
    other = tmp_path / "models" / "warm-x-1234.tmp-abc"  # another entry's name: not this one's leftover
    other.mkdir(parents=True)
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_BUILDER, str(out)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "building"
        os.kill(proc.pid, signal.SIGKILL)  # mid-build: no cleanup runs
    finally:
        proc.wait(30)
    (left,) = [p.name for p in out.parent.glob("warm-x-123.tmp-*")]  # what a killed warm-up leaves

    def build(tmp: Path) -> None:
        (tmp / "done.json").write_text("{}")

    assert publish_dir(out, build, _marker) == out and _marker(out)
    assert sorted(p.name for p in out.parent.iterdir()) == sorted(
        ["warm-x-123", "warm-x-123.lock", other.name]
    ), left
