"""The soak (``rollpacker.lab.bench.soak``): growth measured per 100 steps after a warm-up, processes and
the store sampled, and (slow) a short real soak through the one step path."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from rollpacker.lab.bench.soak import (
    ProcSample,
    SoakReport,
    StepSample,
    growth_table,
    render,
    sample_processes,
    service_processes,
    slope,
    store_growth,
    store_usage,
    thread_names,
    threads_changed,
)
from rollpacker.store.local import FileStore


def _report(rss: list[float], ckpt: list[int], warmup: int = 2) -> SoakReport:
    r = SoakReport("cfg", "inline", len(rss), warmup, 5.0)
    for i, (m, c) in enumerate(zip(rss, ckpt, strict=True)):
        procs = (ProcSample("driver", 1, m, 10, 20),)
        r.samples.append(
            StepSample(i, 1.0, procs, {"ckpt": 2, "state": i + 1}, {"ckpt": c, "state": 100 * i}, 50)
        )
    return r


def _row(rows: list[dict], measure: str) -> dict:
    return next(r for r in rows if r["process"] == "driver" and r["measure"] == measure)


def test_slope_is_growth_per_step() -> None:
    assert slope([0, 1, 2, 3], [5, 5, 5, 5]) == 0.0
    assert slope([0, 1, 2, 3], [1, 3, 5, 7]) == pytest.approx(2.0)
    assert slope([1], [3]) == 0.0


def test_a_flat_series_holds_and_a_growing_one_does_not() -> None:
    flat = _report([900.0, 1000.0] + [1000.0] * 40, [10] * 42)
    row = _row(growth_table(flat), "rss_mb")
    assert row["per_100"] == pytest.approx(0.0) and row["change_pct"] == pytest.approx(0.0) and row["holds"]
    assert _row(growth_table(flat), "threads")["holds"]
    # +1 MB per step over 40 steps after the warm-up: 100 MB per 100 steps, ~+4 % change (holds)
    slow = _report([1000.0 + i for i in range(42)], [10] * 42)
    row = _row(growth_table(slow), "rss_mb")
    assert row["per_100"] == pytest.approx(100.0) and row["holds"]
    leak = _report([1000.0 + 5 * i for i in range(42)], [10] * 42)
    row = _row(growth_table(leak), "rss_mb")
    assert row["per_100"] == pytest.approx(500.0) and not row["holds"], row
    assert "GROWS" in render(leak.to_dict())


def test_one_noisy_sample_at_the_end_does_not_decide() -> None:
    spike = _report([1000.0] * 41 + [1200.0], [10] * 42)
    assert _row(growth_table(spike), "rss_mb")["holds"]


def test_threads_are_counted_by_name_and_the_change_names_them() -> None:
    """A thread named by the kernel (PR_SET_NAME) is counted under its name while it lives; other
    threads of the test process may come and go meanwhile, so only its own name is compared."""
    import ctypes
    import threading

    libc = ctypes.CDLL(None, use_errno=True)
    named, stop = threading.Event(), threading.Event()

    def run() -> None:
        libc.prctl(15, b"soak-probe", 0, 0, 0)  # PR_SET_NAME: this thread's comm
        named.set()
        stop.wait()

    before = thread_names(os.getpid())
    t = threading.Thread(target=run)
    t.start()
    try:
        assert named.wait(10)
        during = thread_names(os.getpid())
    finally:
        stop.set()
        t.join()
    assert before.get("soak-probe", 0) == 0 and during["soak-probe"] == 1
    assert threads_changed(before, during)["soak-probe"] == 1
    # gone with the thread: join() returns when Python is done with it, a moment before the OS
    # thread has left /proc/<pid>/task (seen under load)
    deadline = time.monotonic() + 10
    while thread_names(os.getpid()).get("soak-probe", 0) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert thread_names(os.getpid()).get("soak-probe", 0) == 0
    assert threads_changed({"a": 2, "b": 1}, {"a": 2, "c": 1}) == {"b": -1, "c": 1}
    r = _report([1000.0] * 12, [10] * 12)
    for i, s in enumerate(r.samples):  # two more "grpc" threads from step 6 on
        p = s.procs[0]
        n = {"main": 1, "grpc": 2 if i < 6 else 4}
        r.samples[i] = dataclasses.replace(
            s, procs=(dataclasses.replace(p, threads=sum(n.values()), thread_names=n),)
        )
    row = _row(growth_table(r), "threads")
    assert row["names_changed"] == {"grpc": 2} and not row["holds"]
    assert "grpc +2" in render(r.to_dict())


def test_store_parts_bounded_or_not() -> None:
    ok = store_growth(_report([1.0] * 10, [10, 12, 12, 11, 12, 12, 12, 12, 12, 12]))
    assert ok["ckpt"]["bounded"] and ok["state"]["bytes_per_step"] == pytest.approx(100.0)
    assert "bounded" not in ok["state"]  # kept by design: reported per step, not judged
    grows = store_growth(_report([1.0] * 10, [10 * (i + 1) for i in range(10)]))
    assert not grows["ckpt"]["bounded"]
    assert "NO" in render(_report([1.0] * 10, [10 * (i + 1) for i in range(10)]).to_dict())


def test_processes_are_sampled_by_role() -> None:
    child = subprocess.Popen(["sleep", "30"])
    try:
        procs = service_processes("inline")
        assert procs[0].pid == psutil.Process().pid
        assert child.pid in {p.pid for p in procs}
        samples = {s.pid: s for s in sample_processes(procs)}
        me = samples[psutil.Process().pid]
        assert me.name == "driver" and me.rss_mb > 10 and me.threads >= 1 and me.fds >= 3
        assert samples[child.pid].name == "sleep"
    finally:
        child.kill()
        child.wait()


def test_store_usage_by_part(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    store.put_bytes("e/a/state/step-000000.json", b"x" * 10)
    store.put_bytes("e/a/ckpt/step-000000/model.bin", b"y" * 100)
    store.put_bytes("e/a/steps/step-000000/groups.json", b"z" * 7)
    store.put_bytes("e/a/profile.json", b"p")
    store.put_bytes("e/other/state/step-000000.json", b"not this arm")
    objects, size = store_usage(store, "e/a/")
    assert size == {"state": 10, "steps": 7, "ckpt": 100, "batches": 0, "buffers": 0, "other": 1}
    assert objects["ckpt"] == 1 and sum(objects.values()) == 4


@pytest.mark.slow
def test_a_short_soak_through_the_cli(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    cmd = [sys.executable, "-m", "rollpacker", "lab", "soak", "--steps", "4", "--warmup", "1"]
    cmd += ["--max-growth-pct", "1000", "--out-dir", str(tmp_path / "soak"), "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    d = json.loads(out.read_text())
    assert [s["step"] for s in d["samples"]] == [0, 1, 2, 3]
    assert {r["measure"] for r in d["growth"] if r["process"] == "driver"} == {
        "rss_mb",
        "threads",
        "fds",
        "py_objects",
    }
    assert d["store"]["ckpt"]["bounded"] and d["store"]["state"]["objects_last"] == 6  # step -1 .. 3, LATEST
    assert "per 100" in res.stdout and "state document" in res.stdout
