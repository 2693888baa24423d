"""The chaos suite's schedule, fault specs, recovery accounting and verdict (``rollpacker.lab.bench.chaos``);
the run itself is tests/experiment/test_chaos.py. And the fault hooks' controller requests and
sandbox hang (``rollpacker.testing.faults``) against real files and a real process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from rollpacker.core.errors import ConfigError
from rollpacker.lab.bench.chaos import KINDS, Controller, Fault, _outcomes, by_kind, ok, render, schedule
from rollpacker.testing import faults

ALL = list(KINDS)


def test_the_schedule_is_a_function_of_the_seed() -> None:
    a = schedule(7, 30, 12, ["sync", "tail_batching"], ALL)
    assert a == schedule(7, 30, 12, ["sync", "tail_batching"], ALL)
    assert a != schedule(8, 30, 12, ["sync", "tail_batching"], ALL)


@pytest.mark.parametrize("seed", range(20))
def test_every_kind_once_before_any_twice_one_fault_per_arm_and_step(seed: int) -> None:
    arms = ["sync", "tail_batching"]
    plan = schedule(seed, 30, 12, arms, ALL)
    assert len(plan) == 12
    kinds = Counter(f.kind for f in plan)
    assert set(kinds) == set(ALL)  # 12 faults, 8 kinds: each at least once
    assert max(kinds.values()) <= 2
    slots = [(f.arm, f.step) for f in plan]
    assert len(set(slots)) == len(slots)
    assert all(1 <= f.step <= 28 for f in plan)  # never the arm's start nor its last step
    assert all(f.point in KINDS[f.kind][0] for f in plan)
    assert Counter(f.arm for f in plan) == {"sync": 6, "tail_batching": 6}


def test_too_many_faults_for_the_steps_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"--faults 9: .* offer 8; raise --steps"):
        schedule(0, 6, 9, ["sync", "tail_batching"], ALL)
    with pytest.raises(ConfigError, match="no fault kind"):
        schedule(0, 6, 1, ["sync"], [])


def test_fault_specs_are_what_the_stage_hook_parses() -> None:
    assert Fault("a", 3, "stage", "commit").spec == "commit@3"
    assert Fault("a", 2, "reward-actor", "reward").spec == "reward:RewardService@2"
    assert Fault("a", 5, "s3-restart", "train").spec == "train:s3-restart@5"
    assert faults.mark_name("train:s3-restart@5") == "train-s3-restart-at-5"


def _run(complete: bool, failures: list[float]) -> dict:
    return {
        "complete": complete,
        "error": "",
        "failures": [{"t": t, "line": "a step failed"} for t in failures],
    }


def test_recovery_is_the_first_later_commit_and_failures_go_to_the_latest_fault(tmp_path: Path) -> None:
    f1, f2 = Fault("tb", 1, "stage", "rollout"), Fault("tb", 3, "stage", "commit")
    for f, t in ((f1, 100.0), (f2, 200.0)):
        (tmp_path / faults.mark_name(f.spec)).write_text("pid 1\n")
        os.utime(tmp_path / faults.mark_name(f.spec), (t, t))
    ctl = Controller(None, None, 0, 0.0)
    # step 0 committed at 90; the rollout kill at 100 fails step 1 (at 101), re-run commits it at 130;
    # step 3 was committed just before the commit kill at 200 (the poller saw it at 200.5): recovered
    # when step 4 commits
    ctl.commits["tb"] = [(50.0, -1), (90.0, 0), (130.0, 1), (160.0, 2), (200.5, 3), (240.0, 4)]
    rows = _outcomes([f1, f2], _run(True, [101.0, 201.0, 205.0]), ctl, tmp_path)
    assert [r["recover_s"] for r in rows] == [30.0, 40.0]
    assert [r["reruns"] for r in rows] == [1, 2]
    assert all(r["recovered"] for r in rows)
    # an arm that gave up recovered nothing; a fault that never fired is reported as such
    lost = _outcomes([f1, Fault("tb", 2, "stage", "train")], _run(False, []), ctl, tmp_path)
    assert [r["fired"] for r in lost] == [True, False] and not any(r["recovered"] for r in lost)


def _report(fired: bool = True, lost: int = 0, sync_ids: bool = True, procs: list[str] | None = None) -> dict:
    f = {"arm": "sync", "step": 1, "kind": "stage", "point": "commit", "spec": "commit@1", "fired": fired}
    f.update(recovered=fired, recover_s=12.0 if fired else None, reruns=1)
    comp = {
        "chain_problems": [],
        "prompts_lost": lost,
        "trained_twice": 0,
        "prompts_trained": 20,
        "deterministic_fields_equal": True,
        "deterministic_diffs": [],
        "identities_equal": sync_ids,
        "identities_equal_through_step": 4 if sync_ids else 1,
    }
    d = {
        "steps": 6,
        "seed": 0,
        "arms": ["sync"],
        "task": "t",
        "faults": [f],
        "arm_runs": {"sync": {"complete": True, "committed_step": 5, "seconds": 60.0, "failures": []}},
        "comparison": {"sync": comp},
        "leftovers": {"processes": procs or [], "ports": [], "temp_files": []},
        "reference_step_s": 5.0,
        "wall_s": 100.0,
    }
    d["by_kind"] = by_kind(d["faults"])
    d["ok"] = ok(d)
    return d


def test_the_verdict_fails_on_any_broken_promise() -> None:
    assert _report()["ok"]
    assert not _report(fired=False)["ok"]
    assert not _report(lost=1)["ok"]
    assert not _report(sync_ids=False)["ok"]  # sync's state is deterministic: identities must match
    assert not _report(procs=["weed mini"])["ok"]
    text = render(_report())
    assert "stage" in text and "12.0 / 12.0" in text and "verdict: PASS" in text
    assert "verdict: FAIL" in render(_report(lost=1))


def test_a_controlled_fault_is_requested_acknowledged_and_mlflow_comes_back_a_step_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hook asks, waits for the acknowledgement; a later step's first hook asks for MLflow back."""
    monkeypatch.setenv("ROLLPACKER_FAULT", "commit:mlflow-down@2")
    monkeypatch.setenv("ROLLPACKER_FAULT_MARK", str(tmp_path))
    req = tmp_path / "requests"

    def controller() -> None:
        for _ in range(200):
            for r in req.glob("*.json") if req.is_dir() else []:
                r.with_suffix(".ack").write_text("down")
            time.sleep(0.02)

    t = threading.Thread(target=controller, daemon=True)
    t.start()
    faults.kill_at("commit", 2)
    doc = json.loads((req / "commit-mlflow-down-at-2.json").read_text())
    assert doc["action"] == "mlflow-down" and doc["step"] == 2
    faults.kill_at("commit", 2)  # the same step again (a re-run): nothing new
    assert not (req / "mlflow-up-2.json").exists()
    faults.kill_at("rollout", 3)
    assert json.loads((req / "mlflow-up-2.json").read_text())["action"] == "mlflow-up"
    faults.kill_at("rollout", 4)  # asked once only
    assert sorted(p.name for p in req.glob("*.json")) == ["commit-mlflow-down-at-2.json", "mlflow-up-2.json"]


def test_an_unacknowledged_request_fails_the_hook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLPACKER_FAULT", "rollout:s3-restart@1")
    monkeypatch.setenv("ROLLPACKER_FAULT_MARK", str(tmp_path))
    monkeypatch.setattr(faults, "ACK_TIMEOUT_S", 0.3)
    with pytest.raises(RuntimeError, match="no fault controller acknowledged rollout:s3-restart@1"):
        faults.kill_at("rollout", 1)


def test_kills_are_limited_to_the_services_ray_session(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the services directory named, a process outside its Ray session is never a target."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        (tmp_path / "pids").mkdir()
        (tmp_path / "pids" / "ray.json").write_text(json.dumps({"sid": proc.pid}))
        monkeypatch.setenv(faults.SERVICES_ENV, str(tmp_path))
        assert faults._in_session([proc.pid, 1]) == [proc.pid]
        (tmp_path / "pids" / "ray.json").write_text(json.dumps({"sid": 1}))
        assert faults._in_session([proc.pid]) == []
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def test_an_engine_core_is_killed_when_it_next_works_not_while_it_idles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine-core fault's watcher: a core that waits on its socket uses no CPU and is spared;
    it is SIGKILLed once it computes (a stand-in process: idle 1 s, then busy)."""
    busy_from = tmp_path / "busy-from"
    ready = tmp_path / "ready"
    code = (
        f"import time\nopen({str(ready)!r}, 'w').close()\ntime.sleep(1.0)\n"
        f"open({str(busy_from)!r}, 'w').write(repr(time.time()))\nwhile True:\n    pass\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        while not ready.exists():  # the interpreter's own start-up works too: not the idle part
            time.sleep(0.01)
        monkeypatch.setattr(faults, "engine_core_pids", lambda: [proc.pid] if proc.poll() is None else [])
        faults._kill_busy_core(str(tmp_path), "rollout:EngineCore@1", wait_s=20.0)
        assert proc.wait(timeout=5) == -signal.SIGKILL
        doc = json.loads((tmp_path / faults.mark_name("rollout:EngineCore@1")).read_text())
        assert doc["killed"] and doc["pids"] == [proc.pid]
        # killed once it worked, never while it idled (a bound on when would be a bound on the load)
        assert doc["t_kill"] >= float(busy_from.read_text()) and doc["waited_s"] > 0.9, doc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # the run's accounting starts the fault at the kill, not at the hook that armed the watcher
    f = Fault("tb", 1, "engine-core", "rollout")
    ctl = Controller(None, None, 0, 0.0)
    ctl.commits["tb"] = [(10.0, 0), (doc["t_kill"] + 7.0, 1)]
    (row,) = _outcomes([f], _run(True, []), ctl, tmp_path)
    assert row["fired"] and row["recover_s"] == pytest.approx(7.0) and row["t_stop"] == doc["t_kill"]
    assert row["in_its_step"]  # killed before its step committed: in the step's own round
    ctl.commits["tb"] = [(10.0, 0), (doc["t_kill"] - 1.0, 1), (doc["t_kill"] + 7.0, 2)]
    (late,) = _outcomes([f], _run(True, []), ctl, tmp_path)
    assert not late["in_its_step"]  # step 1 had committed: the kill hit a later step


def test_a_core_that_never_works_is_not_killed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", f"import time; open({str(ready)!r}, 'w'); time.sleep(30)"])
    try:
        while not ready.exists():  # the interpreter's own start-up works: not the idle part
            time.sleep(0.01)
        monkeypatch.setattr(faults, "engine_core_pids", lambda: [proc.pid])
        faults._kill_busy_core(str(tmp_path), "rollout:EngineCore@2", wait_s=1.5)
        assert proc.poll() is None
        doc = json.loads((tmp_path / faults.mark_name("rollout:EngineCore@2")).read_text())
        assert doc == {"spec": "rollout:EngineCore@2", "killed": False}
        (row,) = _outcomes(
            [Fault("tb", 2, "engine-core", "rollout")],
            _run(True, []),
            Controller(None, None, 0, 0.0),
            tmp_path,
        )
        assert not row["fired"] and not row["recovered"]
    finally:
        proc.kill()
        proc.wait()


def test_bad_devices_and_an_engine_core_without_layouts_are_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    from rollpacker.lab.bench.chaos import run_chaos

    n = len(os.sched_getaffinity(0))
    with pytest.raises(ConfigError, match=rf"--devices {n + 1}: this machine offers {n} CPU devices"):
        run_chaos(30, 12, 0, tmp_path / "a", devices=n + 1)
    with pytest.raises(ConfigError, match=r"--kinds engine-core: .* add --devices 1"):
        run_chaos(30, 12, 0, tmp_path / "b", kinds=["engine-core"])
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # nothing started
