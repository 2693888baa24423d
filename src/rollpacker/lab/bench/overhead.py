"""Where a KFP task's seconds go before and after a stage does its work (``rollpacker lab bench overhead``).

Every task of an RL step on ``kfp.local`` is a fresh Python process. This benchmark times, on this
machine, each piece such a process pays, one by one, each the median of ``repeats`` fresh runs:

- ``python``: a bare interpreter start (``python -c pass``);
- ``kfp_task``: one no-op lightweight component through ``kfp.local`` (process start, the KFP
  executor, its input and output files, the orchestrator), per task of a chain of ``tasks``;
- ``import_edge``: importing ``rollpacker.stages.edge`` (what every task imports);
- ``import_mlflow``: importing MLflow (no task does since the tracking service; for reference);
- ``ray_connect``: joining the running Ray cluster (``ray.init(address=...)``), when one is up;
- ``ray_exit_implicit`` / ``ray_exit_explicit``: leaving it through Ray's exit hook (what a task
  paid before) or by ``ray.shutdown()`` (what a task does now).

The floor of a step's overhead is ``tasks_per_step * (kfp_task + import_edge + ray_connect +
ray_exit_explicit)`` minus what the pipeline overlaps with the services' work (docs/pipeline.md).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rollpacker.lab.bench.tables import legend

_KFP_CHAIN = """
import sys, time
from kfp import dsl, local

@dsl.component(base_image="python:3.11", packages_to_install=[], install_kfp_package=False)
def noop(x: str) -> str:
    return x

N = int(sys.argv[1])

@dsl.pipeline(name="overhead")
def chain(x: str = "a"):
    t = noop(x=x).set_caching_options(False)
    for _ in range(N - 1):
        t = noop(x=t.output).set_caching_options(False)

local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=sys.argv[2])
t0 = time.perf_counter()
chain()
print("SECONDS", time.perf_counter() - t0)
"""

_RAY = """
import sys, time
t0 = time.perf_counter()
import ray
ray.init(address=sys.argv[1], namespace="rollpacker-bench-overhead", log_to_driver=False,
         logging_level="ERROR")
print("CONNECT", time.perf_counter() - t0, flush=True)
if sys.argv[2] == "explicit":
    t1 = time.perf_counter()
    ray.shutdown()
    print("SHUTDOWN", time.perf_counter() - t1, flush=True)
"""


def _time(argv: list[str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    return time.perf_counter() - t0, out.stdout + out.stderr


def _value(text: str, tag: str) -> float:
    for line in text.splitlines():
        if line.strip().startswith(tag):
            return float(line.split()[-1])
    raise RuntimeError(f"no {tag} line in the output:\n{text[-2000:]}")


def measure(repeats: int = 5, tasks: int = 6, ray_address: str = "") -> dict[str, Any]:
    """The pieces, each the median seconds of ``repeats`` fresh processes (see the module doc)."""
    py = sys.executable
    med = statistics.median
    out: dict[str, Any] = {"repeats": repeats, "tasks": tasks}
    out["python"] = med(_time([py, "-c", "pass"])[0] for _ in range(repeats))
    base = med(_time([py, "-c", "import rollpacker"])[0] for _ in range(repeats))
    out["import_edge"] = max(
        0.0, med(_time([py, "-c", "import rollpacker.stages.edge"])[0] for _ in range(repeats)) - base
    )
    out["import_mlflow"] = max(0.0, med(_time([py, "-c", "import mlflow"])[0] for _ in range(repeats)) - base)
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "chain.py"
        script.write_text(_KFP_CHAIN)
        per = []
        for _ in range(max(1, repeats // 2)):
            _, text = _time([py, str(script), str(tasks), str(Path(tmp) / "root")])
            per.append(_value(text, "SECONDS") / tasks)
        out["kfp_task"] = med(per)
        if ray_address:
            script = Path(tmp) / "ray_client.py"
            script.write_text(_RAY)
            implicit, explicit, connect, shutdown = [], [], [], []
            for _ in range(repeats):
                wall, text = _time([py, str(script), ray_address, "implicit"])
                implicit.append(wall - _value(text, "CONNECT"))
                connect.append(_value(text, "CONNECT"))
                wall, text = _time([py, str(script), ray_address, "explicit"])
                explicit.append(wall - _value(text, "CONNECT"))
                shutdown.append(_value(text, "SHUTDOWN"))
            out["ray_connect"] = med(connect)
            # what is left of the process after the connect: Ray's exit hook, or shutdown + exit
            out["ray_exit_implicit"] = med(implicit)
            out["ray_exit_explicit"] = med(explicit)
            out["ray_shutdown_call"] = med(shutdown)
    per_task = (
        out["kfp_task"] + out["import_edge"] + out.get("ray_connect", 0.0) + out.get("ray_exit_explicit", 0.0)
    )
    out["per_task_floor"] = per_task
    out["step_floor_sequential"] = per_task * tasks
    return out


def render(m: dict[str, Any]) -> str:
    rows = [
        ("bare Python start", "python"),
        ("one kfp.local task (no-op component)", "kfp_task"),
        ("import rollpacker.stages.edge", "import_edge"),
        ("import mlflow (no task does)", "import_mlflow"),
        ("ray.init to the running cluster", "ray_connect"),
        ("exit through Ray's exit hook", "ray_exit_implicit"),
        ("ray.shutdown() + exit", "ray_exit_explicit"),
        ("  of which the ray.shutdown() call", "ray_shutdown_call"),
        ("a task's floor (kfp + import + connect + shutdown)", "per_task_floor"),
        (f"{m['tasks']} tasks one after another", "step_floor_sequential"),
    ]
    lines = [f"{'piece':<52} {'seconds':>8}", "-" * 61]
    for label, key in rows:
        if key in m:
            lines.append(f"{label:<52} {m[key]:8.3f}")
    return "\n".join(
        lines
        + legend(
            (
                ("piece", "what a KFP task's process pays outside the stage's work, one thing at a time"),
                (
                    "seconds",
                    f"wall seconds, each the median over fresh processes ({m['repeats']} per piece; the "
                    f"kfp.local task is timed in chains of {m['tasks']} tasks)",
                ),
            )
        )
    )


def main(out: Path, repeats: int, tasks: int, ray_address: str) -> dict[str, Any]:
    m = measure(repeats, tasks, ray_address)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(m, indent=2))
    return m
