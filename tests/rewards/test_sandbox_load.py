"""The sandbox under load (``rollpacker.lab.bench.sandbox_load``): concurrent runs with every attack of
the hostile suite among them, no escape, nothing left running; and a jail weakened on purpose (host
network, the host's environment, no PID namespace) is caught by the same checks."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator

import psutil
import pytest

from rollpacker.lab.bench import sandbox_load
from rollpacker.lab.bench.sandbox_load import CANARY_ENV, HOSTILE, render, run_sandbox_load
from rollpacker.rewards.sandbox import Sandbox, SandboxLimits, SandboxResult, SandboxStatus


def test_load_with_every_attack_has_no_escape_and_no_leftover() -> None:
    # 34 runs, half hostile: each of the 17 attacks once among 17 benign runs, 8 in flight
    report = run_sandbox_load(runs=2 * len(HOSTILE), concurrency=8, hostile_share=0.5, wall_s=10.0)
    assert report["workload"]["hostile"] + report["workload"]["benign"] == 2 * len(HOSTILE)
    assert sorted(report["by_attack"]) == sorted(a.name for a in HOSTILE)
    assert report["escapes"] == 0, {k: v["why"] for k, v in report["by_attack"].items() if v["escapes"]}
    assert report["leftovers_total"] == 0, report["leftovers"]
    assert report["benign_misjudged"] == [], report["benign_misjudged"]
    assert report["throughput_runs_per_s"] > 0 and report["overhead_idle"]["jail_trivial_s"] > 0
    assert os.environ.get(CANARY_ENV) is None  # the bait is cleaned up
    json.dumps(report)
    text = render(report)
    assert "escapes: 0" in text and "leftovers: 0" in text


class _LeakyJail(Sandbox):
    """A misconfigured jail: the host's network and environment, no PID namespace of its own."""

    def _argv(self, results_fd: int, log_fd: int, time_limit_s: int) -> list[str]:
        argv = super()._argv(results_fd, log_fd, time_limit_s)
        leak = ["-N", "--disable_clone_newpid", "-E", f"{CANARY_ENV}={os.environ.get(CANARY_ENV, '')}"]
        return argv[:2] + leak + argv[2:]


@pytest.fixture
def kill_tagged() -> Iterator[list[str]]:
    """Tags of daemons a weakened jail let out, killed after the test (they are this test's)."""
    tags: list[str] = []
    yield tags
    for p in psutil.process_iter(["cmdline"]):
        if any(t in a for t in tags for a in (p.info.get("cmdline") or [])):
            os.kill(p.pid, signal.SIGKILL)


def test_a_weakened_jail_is_caught(monkeypatch: pytest.MonkeyPatch, kill_tagged: list[str]) -> None:
    names = {"network", "environment", "daemon"}
    monkeypatch.setattr(sandbox_load, "HOSTILE", tuple(a for a in HOSTILE if a.name in names))
    real_bait = sandbox_load._Bait

    def bait() -> sandbox_load._Bait:
        b = real_bait()
        kill_tagged.append(f"60.{b.host.tag}")
        return b

    monkeypatch.setattr(sandbox_load, "_Bait", bait)
    leaky = _LeakyJail(SandboxLimits(wall_s=10.0))
    # one run at a time: jails without PID namespaces of their own interfere. Three at once, the
    # network and environment runs ended "without a report" beside the daemon run that was killed
    # (1 test in 8, 4 loads in 40), their attacks then not passing, and the network run's
    # connection was charged to whichever hostile run's check read the listener first
    report = run_sandbox_load(runs=6, concurrency=1, hostile_share=0.5, sandbox=leaky)
    why = {k: v["why"] for k, v in report["by_attack"].items()}
    assert report["by_attack"]["network"]["escapes"] == 1, why
    assert report["by_attack"]["environment"]["escapes"] == 1, why
    assert report["escapes"] >= 2
    assert report["leftovers"]["tagged_processes"], report["leftovers"]  # the daemon outlived its run
    assert report["leftovers_total"] >= 1


def _result(status: SandboxStatus, stdout: str = "", exec_s: float = 0.1) -> SandboxResult:
    return SandboxResult(status, (), exec_s, stdout, "", "")


def test_each_host_check_counts_an_escape() -> None:
    bait = sandbox_load._Bait()
    try:
        jobs = {j.name: j for j in sandbox_load.make_jobs(len(HOSTILE), 1.0, 0, bait.host)}
        ok = _result(SandboxStatus.FAILED)
        assert all(bait.check(j, ok, 10.0, 100) == "" for j in jobs.values())
        assert "passed" in bait.check(jobs["dns"], _result(SandboxStatus.PASSED), 10.0, 100)
        assert bait.check(jobs["daemon"], _result(SandboxStatus.PASSED), 10.0, 100) == ""  # host-judged
        assert "canary" in bait.check(
            jobs["environment"], _result(SandboxStatus.FAILED, bait.host.canary), 10, 100
        )
        assert "wall limit" in bait.check(
            jobs["swallow timer"], _result(SandboxStatus.TIMEOUT, exec_s=30.0), 10, 100
        )
        assert "cap" in bait.check(jobs["output flood"], _result(SandboxStatus.FAILED, "y" * 101), 10.0, 100)
        bait.outside.write_text("x")
        assert "written" in bait.check(jobs["write outside"], ok, 10.0, 100)
        bait.outside.unlink()
        bait.victim.kill()
        bait.victim.wait()
        assert "killed" in bait.check(jobs["kill host"], ok, 10.0, 100)
    finally:
        bait.close()
