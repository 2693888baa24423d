"""``rollpacker run`` / ``make run-experiment``: every arm of an experiment through the RL-step
pipeline, then the side-by-side comparison.

1. the local services (S3, MLflow, Ray) are started when the config points at them and none
   answers (and stopped at the end: only what this run started, by PID);
2. the store, MLflow and Ray are checked before any step, naming the setting to fix;
3. each arm runs its remaining steps (``steps`` minus what its committed state already holds:
   an interrupted experiment continues from its last committed step) through ``kfp.local``, or
   ``--runner inline`` calls the same stages in this process;
4. after each arm its services are stopped (the next arm's engine needs the memory);
5. ``rollpacker compare`` prints the table and logs it to MLflow.

A failed step (a crashed stage) leaves the committed state on the previous step; ``retries``
re-runs the arm from there before giving up.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollpacker.core.config import ExperimentConfig
from rollpacker.core.errors import ConfigError, RollpackerError


@dataclass
class ArmOutcome:
    arm: str
    steps_run: int
    failures: int
    seconds: float
    committed_step: int


@dataclass
class ExperimentOutcome:
    experiment: str
    arms: list[ArmOutcome] = field(default_factory=list)
    compare_table: str = ""
    tracking_uri: str = ""


def remaining_steps(cfg: ExperimentConfig, arm: str) -> tuple[int, int]:
    """(committed step, steps left) of an arm from its committed state."""
    from rollpacker.store.objstore import ObjectStore
    from rollpacker.store.state_store import StateStore

    latest = StateStore(ObjectStore.from_config(cfg.store), cfg.experiment, arm).latest()
    done = latest.step if latest is not None else -1
    return done, max(0, cfg.steps - (done + 1))


def preflight(cfg: ExperimentConfig, runner: str) -> None:
    """Fail before any step when a store, MLflow or Ray setting is wrong."""
    from rollpacker.store.objstore import ObjectStore
    from rollpacker.tracking import ExperimentTracker

    ObjectStore.from_config(cfg.store).check()
    ExperimentTracker(cfg.tracking_uri, cfg.experiment).check()
    if runner == "kfp":
        from rollpacker.services.registry import connect_ray

        connect_ray(cfg.services.ray_address, cfg.services.namespace)


def run_experiment(
    config_path: Path,
    runner: str = "kfp",
    arms: Sequence[str] | None = None,
    retries: int = 1,
    pipeline_root: Path = Path("build/kfp"),
    start_services: bool = True,
    echo: Callable[[str], None] | None = None,
    fresh: bool = False,
) -> ExperimentOutcome:
    from rollpacker.loop.runner import load_config

    err = sys.stderr  # bound now: kfp.local's run redirects sys.stderr into its log
    say = echo or (lambda s: print(s, file=err, flush=True))
    if runner not in ("kfp", "inline"):
        raise ConfigError(f"--runner {runner!r}: use 'kfp' (kfp.local) or 'inline' (one process)")
    text = Path(config_path).read_text() if Path(config_path).is_file() else None
    if text is None:
        raise ConfigError(f"config file {config_path} does not exist; see configs/experiment.yaml")
    cfg = load_config(config_path)
    chosen = list(arms) if arms else cfg.arm_names
    for a in chosen:
        if a not in cfg.arm_names:
            raise ConfigError(f"--arm {a!r}: not in the config's arms {cfg.arm_names}")
    started: Any = None
    if start_services and _is_local(cfg):
        started = _local_up(cfg, say)
    saved_mode = os.environ.get("ROLLPACKER_SERVICES")
    os.environ["ROLLPACKER_SERVICES"] = "ray" if runner == "kfp" else "inline"
    try:
        preflight(cfg, runner)
        if fresh:
            reset_arms(cfg, chosen, say)
        out = ExperimentOutcome(cfg.experiment, tracking_uri=cfg.tracking_uri)
        for arm in chosen:
            out.arms.append(_run_arm(cfg, text, arm, runner, retries, pipeline_root, say))
        from rollpacker.tracking import compare, log_compare

        report = compare(cfg.tracking_uri, cfg.experiment)
        log_compare(report, cfg.tracking_uri, cfg.experiment)
        out.compare_table = report.render()
        return out
    finally:
        _disconnect_ray()
        if saved_mode is None:
            os.environ.pop("ROLLPACKER_SERVICES", None)
        else:
            os.environ["ROLLPACKER_SERVICES"] = saved_mode
        if runner == "inline":
            from rollpacker.services.registry import ServiceRegistry

            ServiceRegistry.close_inline()
        if started is not None:
            from rollpacker import devservices

            devservices.down(started.root, names=started.started)
            say("[services] stopped the local services this run started")


def _run_arm(
    cfg: ExperimentConfig,
    text: str,
    arm: str,
    runner: str,
    retries: int,
    root: Path,
    say: Callable[[str], None],
) -> ArmOutcome:
    from rollpacker.services.registry import ServiceRegistry

    t0 = time.perf_counter()
    failures = 0
    ran = 0
    registry = ServiceRegistry.for_config(text, cfg, arm)
    try:
        while True:
            done, left = remaining_steps(cfg, arm)
            if left == 0:
                say(f"[{arm}] all {cfg.steps} steps committed")
                return ArmOutcome(arm, ran, failures, time.perf_counter() - t0, done)
            say(f"[{arm}] committed through step {done}; running {left} more step(s) ({runner})")
            try:
                if runner == "kfp":
                    from rollpacker.pipeline_local import run_arm_kfp

                    run_arm_kfp(text, arm, left, root, echo=say)
                else:
                    from rollpacker.stages import run_step_inline

                    for _ in range(left):
                        out = run_step_inline(text, arm)
                        say(f"[{arm}] {_brief(out.metrics)}")
                ran += left
            except RollpackerError as e:
                failures += 1
                after, _ = remaining_steps(cfg, arm)
                ran += after - done
                if failures > retries:
                    raise
                say(f"[{arm}] a step failed ({str(e).splitlines()[0]}); re-running from step {after + 1}")
    finally:
        registry.kill_all()


def _disconnect_ray() -> None:
    """Leave the Ray cluster this process joined: a driver still connected when the cluster goes
    away (``make down``, a test's teardown) is exited by Ray itself."""
    if "ray" not in sys.modules:
        return
    import ray

    if ray.is_initialized():
        ray.shutdown()


def _brief(m: dict[str, float]) -> str:
    keys = ("step/time_s", "rollout/time_s", "reward/mean", "val/accuracy")
    return " ".join(f"{k}={m[k]:.3g}" for k in keys if k in m)


def _is_local(cfg: ExperimentConfig) -> bool:
    host = cfg.store.endpoint.split(":")[0]
    return host in ("127.0.0.1", "localhost") and not os.environ.get("RAY_ADDRESS")


def _local_up(cfg: ExperimentConfig, say: Callable[[str], None]) -> Any:
    """Start the local services unless they already run; returns what was started (to stop)."""
    from rollpacker import devservices

    svc = devservices.up()
    fresh = [n for n in svc.started] if getattr(svc, "started", None) else []
    if fresh:
        say(f"[services] started {', '.join(fresh)} (S3 {svc.s3_endpoint}, MLflow {svc.tracking_uri})")
        return svc
    say(f"[services] reusing the running local services (MLflow {svc.tracking_uri})")
    return None


def reset_arms(cfg: ExperimentConfig, arms: Sequence[str], say: Callable[[str], None]) -> None:
    """``--fresh``: delete the arms' committed states, blobs and checkpoints, and their MLflow runs."""
    from rollpacker.store.objstore import ObjectStore
    from rollpacker.store.state_store import StateStore
    from rollpacker.tracking import ExperimentTracker

    store = ObjectStore.from_config(cfg.store)
    tracker = ExperimentTracker(cfg.tracking_uri, cfg.experiment)
    for a in arms:
        n = StateStore(store, cfg.experiment, a).reset()
        run = tracker.find_arm_run(a)
        if run is not None:
            tracker.client.delete_run(run)  # the arm starts a new MLflow run
        say(f"[{a}] --fresh: deleted {n} objects and the arm's MLflow run")
