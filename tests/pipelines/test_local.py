"""rl-experiment through kfp.local with stand-in stages: one console line per task, the profiling
condition, the chain of steps, and a failing task reported by name with its log."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rollpacker.core.errors import RollpackerError
from rollpacker.pipeline_local import run_arm_kfp, task_kind

pytestmark = pytest.mark.e2e

FAKE = Path(__file__).with_name("fake_stages.py")


@pytest.fixture
def fake_stages_in_tasks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Task subprocesses import tests/pipelines/fake_stages.py as ``rollpacker.stages.edge`` (and as
    ``rollpacker.tasks.prepare``, the prepare-model task's edge)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('rollpacker.stages.edge', {str(FAKE)!r})\n"
        "mod = importlib.util.module_from_spec(spec)\n"
        "sys.modules['rollpacker.stages.edge'] = mod\n"
        "sys.modules['rollpacker.tasks.prepare'] = mod\n"
        "spec.loader.exec_module(mod)\n"
    )
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    state = tmp_path / "step"
    monkeypatch.setenv("FAKE_STAGES_STATE", str(state))
    return state


def test_three_steps_run_in_order_with_one_line_per_task(
    fake_stages_in_tasks: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines: list[str] = []
    records = run_arm_kfp("steps: 3\n", "sync", 3, tmp_path / "root", echo=lines.append)
    assert fake_stages_in_tasks.read_text() == "3"  # three commits, each after its own plan
    by_step = {s: [task_kind(r.task) for r in records if r.step == s] for s in (1, 2, 3)}
    assert [r.step for r in records] == sorted(r.step for r in records)
    for step, kinds in by_step.items():
        # kfp.local runs the two reward siblings one after the other, in either order
        middle = {"judge", "sandbox-reward"}
        head = ["controller-plan", "profiling", "rollout"] if step == 1 else ["controller-plan", "rollout"]
        assert kinds[: len(head)] == head, kinds  # the fake plan asks for a profile on step 1 only
        assert set(kinds[len(head) : len(head) + 2]) == middle, kinds
        assert kinds[len(head) + 2 :] == ["training", "controller-commit"], kinds
    assert all(r.status == "SUCCESS" and r.seconds >= 0 for r in records)
    assert sum("profiling" in line and "skipped" in line for line in lines) == 2
    assert len(lines) == 3 + len(records) + 2  # header, first-plan notice, tasks, two skips, done
    assert sum("running" in line for line in lines) == 1
    # kfp.local's own output went to the log file, not to the console
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""
    (log,) = (tmp_path / "root" / "logs").glob("sync-*.log")
    assert "Executing task" in log.read_text()
    (run,) = (tmp_path / "root").glob("rl-experiment-*")
    commit = json.loads((run / "controller-commit-3" / "executor_output.json").read_text())
    assert commit["artifacts"]["metrics"]["artifacts"][0]["metadata"] == {
        "rollout/time_s": 1.5,
        "train/loss": 0.25,
    }


def test_a_failing_task_is_named_with_its_step_and_log(fake_stages_in_tasks: Path, tmp_path: Path) -> None:
    lines: list[str] = []
    with pytest.raises(RollpackerError) as info:
        run_arm_kfp("steps: 2\nfail: train\n", "tail_batching", 2, tmp_path / "root", echo=lines.append)
    msg = str(info.value)
    assert msg.startswith(
        "arm 'tail_batching': task 'training' failed in step 1/2: RuntimeError: planted failure in train"
    )
    (log,) = (tmp_path / "root" / "logs").glob("tail_batching-*.log")
    assert f"Full log: {log}" in msg
    (run,) = (tmp_path / "root").glob("rl-experiment-*")
    assert f"task outputs under {run / 'training'}" in msg
    assert "planted failure in train" in log.read_text()
    assert any("training" in line and "FAILURE" in line for line in lines)
    assert not any("controller-commit" in line for line in lines)
    assert not fake_stages_in_tasks.exists()  # nothing committed


def test_zero_steps_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RollpackerError, match="at least one step"):
        run_arm_kfp("", "sync", 0, tmp_path)


def test_a_step_past_the_arms_last_runs_only_its_plan(fake_stages_in_tasks: Path, tmp_path: Path) -> None:
    lines: list[str] = []
    records = run_arm_kfp("steps: 1\n", "sync", 2, tmp_path / "root", echo=lines.append)
    assert fake_stages_in_tasks.read_text() == "1"  # one commit: the second plan found the arm done
    assert [task_kind(r.task) for r in records if r.step == 2] == ["controller-plan"]
    assert sum("all committed" in line and "skipped" in line for line in lines) == 1, lines
    assert not any("profiling" in line and "skipped" in line and "step 2/" in line for line in lines)
