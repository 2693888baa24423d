"""Run the ``rl-experiment`` pipeline of one arm on this machine through ``kfp.local``.

``kfp.local`` (SubprocessRunner, ``use_venv=False``) runs every task as a subprocess of this
interpreter, one after another, and prints everything: the executor input, the task's own output,
its outputs. ``run_arm_kfp`` sends all of that to a log file under ``pipeline_root/logs/`` and
prints one line per task instead (status and seconds). When a task fails it raises a
``RollpackerError`` naming the task, its step and the log file, with the end of the task's output.

Facts about kfp.local 2.17.0 this relies on (see pipelines/rl_step.py for the DAG side):
- tasks write to ``pipeline_root/<pipeline>-<time>/<task name>/``; the compiler names the tasks of
  step k's sub-pipeline ``<task>-k`` (``rollout-2``), so no step overwrites another's outputs;
- a condition that cannot be resolved evaluates to false silently, so the run checks that every
  step reached ``controller-commit``, or that its plan reported the arm done (``skip``: the DAG
  then runs nothing after the plan);
- a task's outputs are in ``<task dir>/executor_output.json`` once it finished (the plan's
  ``skip`` is read from there);
- the two conditions of ``rl-step`` are both logged as ``condition-1``: a skipped one is the
  arm-done gate when the step's plan reported ``skip``, else the profiling condition.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import re
import textwrap
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TextIO

from rollpacker import logs
from rollpacker.core.environ import environ_set
from rollpacker.core.errors import RollpackerError

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_START = re.compile(r"Executing task '([^']+)'")
_END = re.compile(r"Task '([^']+)' finished with status (\w+)")
_SKIP = re.compile(r"Skipping conditional task (\S+)")
_ERROR_LINE = re.compile(r"^\s*[\w.]*(Error|Exception|Exit|Interrupt)\b.*")
_SUFFIX = re.compile(r"-\d+$")  # step k's tasks are named <task>-k
PLAN_TASK = "controller-plan"
COMMIT_TASK = "controller-commit"
TAIL_LINES = 30


@dataclass
class TaskRecord:
    step: int
    task: str
    status: str
    seconds: float


def task_kind(task: str) -> str:
    """``rollout-3`` -> ``rollout``: the component a (possibly step-suffixed) task name runs."""
    return _SUFFIX.sub("", task)


class _Console(io.TextIOBase):
    """A stand-in for stdout/stderr during the run: everything to the log, one line per task to echo."""

    def __init__(
        self, log: TextIO, echo: Callable[[str], None], steps: int, arm: str, root: Path | None = None
    ) -> None:
        super().__init__()
        self.log, self.echo, self.steps, self.arm, self.root = log, echo, steps, arm, root
        self.done_steps: set[int] = set()  # steps whose plan found the arm done (nothing else runs)
        self.step = 0
        self.current: str | None = None
        self.started = 0.0
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)  # the running (or last) task's output
        self.records: list[TaskRecord] = []
        self._partial = ""

    def _arm_done(self, plan_task: str) -> bool:
        """Whether the plan task that just finished reported ``skip`` (its newest output file)."""
        if self.root is None:
            return False
        found = list(self.root.glob(f"*/{plan_task}/executor_output.json"))
        if not found:
            return False
        newest = max(found, key=lambda p: p.stat().st_mtime)
        try:
            return bool(json.loads(newest.read_text())["parameterValues"]["skip"])
        except (OSError, ValueError, KeyError, TypeError):
            return False

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        self.log.write(s)
        self._partial += s
        *lines, self._partial = self._partial.split("\n")
        for line in lines:
            self._line(_ANSI.sub("", line))
        return len(s)

    def flush(self) -> None:
        self.log.flush()

    def _line(self, line: str) -> None:
        if m := _START.search(line):
            self.current, self.started = m.group(1), time.monotonic()
            self.tail.clear()
            if task_kind(self.current) == PLAN_TASK:
                self.step += 1
                if self.step == 1:
                    self.echo(
                        f"[kfp] {self.arm} step 1/{self.steps} controller-plan running (an arm's first "
                        "plan also starts its services: engine start, validation)"
                    )
        elif m := _END.search(line):
            rec = TaskRecord(self.step, m.group(1), m.group(2), time.monotonic() - self.started)
            self.records.append(rec)
            self.current = None
            if task_kind(rec.task) == PLAN_TASK and rec.status == "SUCCESS" and self._arm_done(rec.task):
                self.done_steps.add(rec.step)
            where = f"step {rec.step}/{self.steps}" if rec.step else "setup"  # prepare-model: before step 1
            self.echo(
                f"[kfp] {self.arm} {where} {task_kind(rec.task):<18} {rec.status:<7} {rec.seconds:6.1f} s"
            )
        elif m := _SKIP.search(line):
            head = f"[kfp] {self.arm} step {self.step}/{self.steps}"
            if self.step in self.done_steps:  # the gate after the plan
                self.echo(f"{head} {'the other stages':<18} skipped (the arm's steps are all committed)")
            else:  # the profiling condition
                what = "profiling" if m.group(1).startswith("condition") else m.group(1)
                self.echo(f"{head} {what:<18} skipped (not needed)")
        elif self.current is not None and line.strip():
            self.tail.append(line)


class _ToConsole(logging.Handler):
    def __init__(self, console: _Console) -> None:
        super().__init__(logging.INFO)
        self.console = console
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.console.write(self.format(record) + "\n")


@contextlib.contextmanager
def _captured(console: _Console) -> Iterator[None]:
    """Route stdout, stderr and the root logger to ``console`` (kfp.local logs through all three)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    root.handlers[:] = [_ToConsole(console)]
    root.setLevel(logging.INFO)
    try:
        with contextlib.redirect_stdout(console), contextlib.redirect_stderr(console):
            yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def run_arm_kfp(
    config_text: str,
    arm: str,
    steps: int,
    pipeline_root: Path,
    *,
    echo: Callable[[str], None] | None = None,
) -> list[TaskRecord]:
    """Run ``steps`` chained RL steps of ``arm`` (a rollout policy) through ``kfp.local``.

    ``config_text`` is the experiment YAML; task outputs go under ``pipeline_root``, the full kfp
    log to ``pipeline_root/logs/<arm>-<time>.log``. ``echo`` gets one line per task (default:
    stderr). Returns the task records; raises RollpackerError when a task fails.
    """
    from kfp import local

    from rollpacker.pipeline_compile import build_pipelines

    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise RollpackerError(f"steps = {steps!r}: run at least one step")
    out = logs.console()  # the terminal, also while the libraries' output goes to a log file
    say = echo or (lambda s: print(s, file=out, flush=True))
    pipeline = build_pipelines(steps)["rl_experiment"]
    pipeline_root = pipeline_root.resolve()
    log_path = pipeline_root / "logs" / f"{arm}-{datetime.now().strftime('%Y%m%d-%H%M%S-%f')}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(pipeline_root))
    say(f"[kfp] {arm}: {steps} step(s) through kfp.local; full log: {log_path}")
    with log_path.open("w", encoding="utf-8") as log:
        console = _Console(log=log, echo=say, steps=steps, arm=arm, root=pipeline_root)
        t0 = time.monotonic()
        try:
            with _captured(console), _task_temp_dir(), warnings.catch_warnings():
                # kfp.local warns on every task that the image name does not say "python"
                warnings.filterwarnings("ignore", message=".*non-Python base image", category=RuntimeWarning)
                # ... and that the Kubernetes settings (pipelines/platform.py) do nothing locally
                warnings.filterwarnings(
                    "ignore", message=".*no effect in the current local runner", category=UserWarning
                )
                pipeline(config=config_text, arm=arm)
        except Exception as e:
            console.flush()
            raise RollpackerError(_failure_message(console, e, log_path, pipeline_root)) from e
        finally:
            log.flush()
    commits = sum(1 for r in console.records if task_kind(r.task) == COMMIT_TASK and r.status == "SUCCESS")
    if commits + len(console.done_steps) != steps:
        raise RollpackerError(
            f"kfp.local finished arm {arm!r} but only {commits} of {steps} step(s) reached "
            f"{COMMIT_TASK} ({len(console.done_steps)} found the arm done); read {log_path} for "
            "skipped or missing tasks"
        )
    say(f"[kfp] {arm}: {steps} step(s) done in {time.monotonic() - t0:.1f} s")
    return console.records


@contextlib.contextmanager
def _task_temp_dir() -> Iterator[None]:
    """The tasks' temporary files in a directory of this run, removed after it: kfp.local writes
    each task's component source to a ``mktemp -d`` directory it never deletes (one per task)."""
    import shutil
    import tempfile

    tmp = tempfile.mkdtemp(prefix="kfp-tasks-")
    try:
        with environ_set({"TMPDIR": tmp}):
            yield
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _failure_message(console: _Console, e: Exception, log_path: Path, root: Path) -> str:
    failed = [r for r in console.records if r.status != "SUCCESS"]
    runs = sorted(root.glob("rl-experiment-*"), key=lambda p: p.stat().st_mtime)
    task = failed[-1].task if failed else console.current
    outputs = f"; task outputs under {runs[-1] / (task or '')}" if runs else ""
    if failed:
        where = f"task {task_kind(failed[-1].task)!r} failed in step {failed[-1].step}/{console.steps}"
    elif console.current is not None:
        where = f"kfp.local stopped in task {console.current!r} in step {console.step}/{console.steps}"
    else:
        where = "kfp.local failed before any task ran"
    tail = textwrap.indent(textwrap.dedent("\n".join(console.tail)), "    ")
    errors = [line.strip() for line in console.tail if _ERROR_LINE.match(line)]
    detail = errors[-1] if errors else (_ANSI.sub("", str(e)) or type(e).__name__)
    return f"arm {console.arm!r}: {where}: {detail}\nFull log: {log_path}{outputs}" + (
        f"\nLast lines of the task's output:\n{tail}" if tail else ""
    )
