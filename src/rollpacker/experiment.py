"""The runners of the one RL step (``stages``): ``rollpacker run`` / ``make run-experiment`` (every
arm through the pipeline, then the comparison) and ``rollpacker train`` (one arm, in this process).

``run_experiment``:

1. the local services (S3, MLflow, Ray) are started when the config points at them and none
   answers (and stopped at the end: only what this run started, by PID);
2. the store, MLflow and Ray are checked before any step, naming the setting to fix, and so are
   the Ray cluster's GPUs against one arm's services (core/placement.py);
3. each arm in turn (one after another, whatever ``services.arms`` says) runs its remaining steps
   (``steps`` minus what its committed state already holds: an interrupted experiment continues
   from its last committed step) through ``kfp.local``, or ``--runner inline`` calls the same
   stages in this process;
4. after each arm its services are stopped (the next arm's engine needs the memory);
5. ``rollpacker compare`` prints the table and logs it to MLflow.

A failed step (a crashed stage) leaves the committed state on the previous step; ``retries``
re-runs the arm from there before giving up.

``train_arm`` (``rollpacker train``, ``bench learning``): the same stages and services in this
process, no KFP and no Ray; the state in the config's store, or in a local directory when the
config names none; MLflow at ``tracking_uri`` (a SQLite file by default).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rollpacker import devservices
from rollpacker.core.accounting import PromptAccount, StepPrompts, account_prompts
from rollpacker.core.config import (
    ArmSchedule,
    ExperimentConfig,
    RolloutConfig,
    apply_overrides,
    arm_config,
    config_from_text,
    load_config,
    resolve_config,
)
from rollpacker.core.environ import environ_set
from rollpacker.core.errors import ConfigError, RollpackerError, RunExistsError
from rollpacker.core.fidelity import COMPARE_KEYS
from rollpacker.core.placement import arm_gpus
from rollpacker.core.redact import redact_uri
from rollpacker.core.types import Runner, ServicesMode, parse_enum
from rollpacker.engines.gpus import check_machine
from rollpacker.logs import console
from rollpacker.pipeline_local import run_arm_kfp
from rollpacker.rewards.factory import judge_model_dir
from rollpacker.services.base import ServiceError
from rollpacker.services.registry import RegistrySpec, ServiceRegistry, connect_ray, plan_on_ray
from rollpacker.stages import hooks
from rollpacker.stages.context import StageContext
from rollpacker.stages.messages import GroupsLog
from rollpacker.stages.run import run_step
from rollpacker.store import open_store
from rollpacker.store.base import ObjectStore
from rollpacker.store.state_store import StateStore
from rollpacker.tasks.models import check_model, needs_toy_judge
from rollpacker.tasks.prepare import prepare_arm
from rollpacker.tracking import (
    LAG_KEY,
    OFF_POLICY_KEY,
    REWARD_KEY,
    STEP_KEY,
    ExperimentTracker,
    compare,
    log_compare,
)


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
    latest = StateStore(open_store(cfg.store), cfg.experiment, arm).latest()
    done = latest.step if latest is not None else -1
    return done, max(0, cfg.steps - (done + 1))


def ray_address(cfg: ExperimentConfig) -> str:
    """The Ray cluster this runner hands to the registry and to its KFP tasks: ``services.ray_address``,
    else $RAY_ADDRESS, else the local head ``rollpacker up`` recorded ("" when none); a
    ``ServiceError`` when that local head lost its raylet or GCS server (a client would hang)."""
    addr = cfg.services.ray_address or os.environ.get("RAY_ADDRESS", "") or devservices.local_ray_address()
    check_ray_head(addr)
    return addr


def check_ray_head(addr: str) -> None:
    """A ``ServiceError`` naming `make up` when ``addr`` is the local Ray head `rollpacker up` started
    and that head lost its raylet or GCS server (a client's ``ray.init`` there hangs instead of
    failing); nothing for any other address."""
    if addr and devservices.local_ray_head_broken(addr):
        raise ServiceError(
            f"services.ray_address = {addr!r}: the local Ray head that `rollpacker up` started has lost its "
            "raylet or GCS server (an interrupted run?) and would hang a client; `make up` stops and "
            "restarts it"
        )


def preflight(cfg: ExperimentConfig, runner: Runner, arms: Sequence[str] = (), address: str = "") -> None:
    """Fail before any step when a store, MLflow or Ray setting is wrong, or when the Ray cluster's
    GPUs cannot hold the arms' services (one arm at a time: this runner runs the arms one after
    another whatever ``services.arms`` says, which holds whatever ``disjoint`` holds); ``address``:
    the Ray cluster (default: ``ray_address(cfg)``)."""
    runner = parse_enum(Runner, runner, "--runner")
    open_store(cfg.store).check()
    ExperimentTracker(cfg.tracking_uri, cfg.experiment).check()
    if runner is Runner.KFP:
        address = address or ray_address(cfg)
        check_ray_head(address)
        connect_ray(address, cfg.services.namespace)
        arms = list(arms or cfg.arm_names)
        if any(arm_gpus(cfg, a).total for a in arms):
            one_at_a_time = replace(cfg, services=replace(cfg.services, arms=ArmSchedule.SEQUENTIAL))
            plan_on_ray(one_at_a_time, arms)


def check_experiment(
    config_path: Path, runner: Runner | str = Runner.KFP, arms: Sequence[str] | None = None
) -> tuple[Path, ExperimentConfig, list[str]]:
    """Every check of ``run_experiment`` that needs no service, store, warm-up or engine: the
    config, the arms, the model against each arm, and the machine where the engine runs here
    (``--runner inline``, or a Ray head on this machine). Returns the config's path, the config
    and the chosen arms. ``rollpacker run`` calls it before it opens its log."""
    runner = parse_enum(Runner, runner, "--runner")  # kfp (kfp.local) or inline (one process)
    config_path = resolve_config(config_path)
    cfg = load_config(config_path)
    text = config_path.read_text()
    chosen = list(arms) if arms else cfg.arm_names
    for a in chosen:
        if a not in cfg.arm_names:
            raise ConfigError(f"--arm {a!r}: not in the config's arms {cfg.arm_names}")
        arm_cfg = arm_config(text, a)
        check_model(arm_cfg)  # before the services, the store and any warm-up
        if runner is Runner.INLINE or _ray_here(cfg):
            check_machine(arm_cfg)
    return config_path, cfg, chosen


def _ray_here(cfg: ExperimentConfig) -> bool:
    """Whether the services' Ray cluster is the local head (its engines run on this machine)."""
    address = cfg.services.ray_address or os.environ.get("RAY_ADDRESS", "")
    host = address.removeprefix("ray://").split(":")[0]
    return host in ("", "localhost") or host.startswith("127.")


def run_experiment(
    config_path: Path,
    runner: Runner = Runner.KFP,
    arms: Sequence[str] | None = None,
    retries: int = 1,
    pipeline_root: Path = Path("build/kfp"),
    start_services: bool = True,
    echo: Callable[[str], None] | None = None,
    fresh: bool = False,
) -> ExperimentOutcome:
    err = console()  # bound now: kfp.local's run redirects sys.stderr into its log
    say = echo or (lambda s: print(s, file=err, flush=True))
    runner = parse_enum(Runner, runner, "--runner")
    config_path, cfg, chosen = check_experiment(config_path, runner, arms)
    text = config_path.read_text()
    started: Any = None
    if start_services and _is_local(cfg):
        started = _local_up(cfg, say)
    try:
        hooks.at("setup", -1)  # the interrupt tests' point (stages/hooks.py; a no-op otherwise)
        address = ray_address(cfg) if runner is Runner.KFP else ""
        preflight(cfg, runner, chosen, address)
        if fresh:
            reset_arms(cfg, chosen, say)
        out = ExperimentOutcome(cfg.experiment, tracking_uri=cfg.tracking_uri)
        for arm in chosen:
            out.arms.append(_run_arm(cfg, text, arm, runner, retries, pipeline_root, say, address))
        report = compare(cfg.tracking_uri, cfg.experiment)
        hooks.at("compare", -1)  # read, not yet logged
        log_compare(report, cfg.tracking_uri, cfg.experiment)
        out.compare_table = report.render()
        return out
    finally:
        _disconnect_ray()
        if runner is Runner.INLINE:
            ServiceRegistry.close_inline()
        if started is not None:
            devservices.down(started.root, names=started.started)
            say("[services] stopped the local services this run started")


def _run_arm(
    cfg: ExperimentConfig,
    text: str,
    arm: str,
    runner: Runner,
    retries: int,
    root: Path,
    say: Callable[[str], None],
    address: str = "",
) -> ArmOutcome:
    t0 = time.perf_counter()
    failures = 0
    ran = 0
    registry = ServiceRegistry(RegistrySpec.of(text, cfg, arm, runner.services_mode, address))
    try:
        while True:
            done, left = remaining_steps(cfg, arm)
            if left == 0:
                say(f"[{arm}] all {cfg.steps} steps committed")
                return ArmOutcome(arm, ran, failures, time.perf_counter() - t0, done)
            again = "" if done < 0 else "; --fresh would start it over"
            say(f"[{arm}] committed through step {done}; running {left} more step(s) ({runner}){again}")
            if done < 0:  # the model preparation: before the arm's first step, with its own bar
                prepare_models(arm_config(text, arm), open_store(cfg.store), arm, say=say)
            try:
                if runner is Runner.KFP:
                    # the KFP tasks are this process's children: they find Ray through $RAY_ADDRESS
                    with environ_set({"RAY_ADDRESS": address} if address else {}):
                        run_arm_kfp(text, arm, left, root, echo=say)
                else:
                    ctx = StageContext.create(text, arm, ServicesMode.INLINE)
                    for _ in range(left):
                        out = run_step(ctx)
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


def prepare_models(
    cfg: ExperimentConfig,
    store: ObjectStore,
    arm: str,
    quiet: bool = False,
    say: Callable[[str], None] | None = None,
) -> None:
    """The model preparation before ``arm``'s first step, in this process with its own progress:
    the start model into the store (``tasks.prepare``), and the toy judge's warm-up when the task
    has judge prompts (the judge service then finds it cached on this machine; on a cluster the
    judge's pod warms it up itself)."""
    prepare_arm(cfg, store, arm, quiet=quiet, say=say)
    if needs_toy_judge(cfg):
        judge_model_dir(cfg, quiet=quiet)


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
    svc = devservices.up()
    fresh = [n for n in svc.started] if getattr(svc, "started", None) else []
    if fresh:
        say(f"[services] started {', '.join(fresh)} (S3 {svc.s3_endpoint}, MLflow {svc.tracking_uri})")
        return svc
    say(f"[services] reusing the running local services (MLflow {svc.tracking_uri})")
    return None


def reset_arms(cfg: ExperimentConfig, arms: Sequence[str], say: Callable[[str], None]) -> None:
    """``--fresh``: delete the arms' committed states, blobs and checkpoints, and their MLflow runs."""
    store = open_store(cfg.store)
    tracker = ExperimentTracker(cfg.tracking_uri, cfg.experiment)
    for a in arms:
        n = StateStore(store, cfg.experiment, a).reset()
        run = tracker.find_arm_run(a)
        if run is not None:
            tracker.client.delete_run(run)  # the arm starts a new MLflow run
        say(f"[{a}] --fresh: deleted {n} objects" + (f" and MLflow run {run}" if run else ""))


# -- one arm in this process: `rollpacker train`, `bench learning` --------------------------------
@dataclass(frozen=True)
class TrainSummary:
    arm: str
    run_id: str
    steps: int  # committed steps
    steps_run: int  # of them, run by this call
    trained_samples: int
    val_accuracy: tuple[tuple[int, float], ...]  # (step, accuracy): step 0 is before any RL
    wall_s: float
    store_uri: str
    tracking_uri: str
    exactly_once: PromptAccount
    step_metrics: tuple[dict[str, float], ...] = field(default_factory=tuple)  # MLflow, step 1..N


def train_config(
    config_path: Path, overrides: dict[str, Any] | None = None, run_name: str = "", make_store: bool = True
) -> tuple[str, ExperimentConfig]:
    """The config text and config of a single-arm training run: the arm is ``rollout.policy``
    (with ``rollout.one_off``) named ``run_name`` (default ``<policy>[-one-off]-seed<seed>``); the
    state goes to ``<out_dir>/store`` when the config names no store (made here unless
    ``make_store`` is False: a command that checks several runs before any makes nothing)."""
    import yaml

    config_path = resolve_config(config_path)
    # validates first, naming the file, as the one arm the run trains (the file's own arms are not
    # run: a dynamic-sampling config is valid for tail batching only)
    one_arm = {"arms": [{"name": "train", "policy": _policy_of(config_path, overrides or {})}]}
    base = load_config(config_path, {**(overrides or {}), **one_arm})
    data = yaml.safe_load(config_path.read_text()) or {}
    apply_overrides(data, overrides or {}, str(config_path))
    policy = base.rollout.policy.value
    name = (
        run_name or base.run_name or f"{policy}{'-one-off' if base.rollout.one_off else ''}-seed{base.seed}"
    )
    data["arms"] = [{"name": name.lower().replace(".", "-"), "policy": policy}]
    root = Path(base.out_dir).resolve() / "store"
    if "store" not in data:
        data["store"] = {"endpoint": f"file://{root}"}
    text = yaml.safe_dump(data, sort_keys=False)
    cfg = config_from_text(text, where=f"{config_path} (as one training arm)")
    check_model(cfg)  # the model-dependent checks, before any warm-up, engine or store work
    check_machine(cfg)  # its engine and trainer run on this machine
    if make_store and cfg.store.endpoint == f"file://{root}":
        root.mkdir(parents=True, exist_ok=True)  # only for a config that passed every check
    return text, cfg


def _policy_of(config_path: Path, overrides: dict[str, Any]) -> str:
    """The rollout policy a training run of ``config_path`` with ``overrides`` trains (its arm)."""
    import yaml

    if "rollout.policy" in overrides:
        return str(overrides["rollout.policy"])
    default = RolloutConfig().policy.value
    try:
        data = yaml.safe_load(config_path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return default  # load_config says what is wrong with the file
    rollout = data.get("rollout") if isinstance(data, dict) else None
    return str(rollout.get("policy", default)) if isinstance(rollout, dict) else default


def train_arm(
    text: str,
    *,
    resume: bool = False,
    fresh: bool = False,
    progress: bool = True,
    say: Callable[[str], None] | None = None,
) -> TrainSummary:
    """Run the single arm of ``text`` to ``steps`` through the stages, services in this process."""
    from tqdm import tqdm

    cfg = config_from_text(text)
    (arm,) = cfg.arm_names
    say = say or (lambda s: print(s, file=console(), flush=True))
    store = open_store(cfg.store)
    store.check()
    states = StateStore(store, cfg.experiment, arm)
    tracker = ExperimentTracker(cfg.tracking_uri, cfg.experiment)
    tracker.check()
    if fresh:
        reset_arms(cfg, [arm], say)
    else:
        _check_rerun(states, tracker, resume, say)
    t0 = time.perf_counter()
    done, left = remaining_steps(cfg, arm)
    if done < 0:  # the model preparation, before the first step: the warm-up's own bar
        prepare_models(cfg, store, arm, quiet=not progress, say=say)
    ctx = StageContext.create(text, arm, ServicesMode.INLINE)
    bar = tqdm(
        total=cfg.steps, initial=done + 1, desc=f"RL {arm}", unit="step", disable=not progress, file=console()
    )
    try:
        for _ in range(left):
            out = run_step(ctx)
            bar.update(1)
            bar.set_postfix_str(_brief(out.metrics))
    finally:
        bar.close()
        ctx.services.kill_all()
    return summarize_arm(cfg, arm, steps_run=left, wall_s=time.perf_counter() - t0)


def _check_rerun(
    states: StateStore, tracker: ExperimentTracker, resume: bool, say: Callable[[str], None]
) -> None:
    """An arm that ran before goes on only as asked: its committed state with ``resume``; its MLflow
    run (one per arm: a new run would log into it) only when that run committed no step, and then
    saying so. An arm whose earlier start committed no step (it failed in its first step: only the
    initial state, step -1, is there) just starts over. Otherwise a ConfigError says what is there
    and what to pass."""
    arm, where = states.arm, f"experiment {states.experiment!r}"
    latest = states.latest()
    if latest is not None:
        if resume:
            return
        if latest.step < 0:  # an earlier start failed before its first commit: nothing to keep
            deleted = states.reset()
            run = tracker.find_arm_run(arm)
            if run is not None:
                tracker.client.delete_run(run)
            say(f"[{arm}] an earlier start committed no step: starting over (deleted {deleted} objects)")
            return
        n = latest.step + 1
        done = f"committed {n} step(s)" if n else "started (no step committed yet)"
        raise RunExistsError(
            f"arm {arm!r} of {where} already {done} in {states.store.uri(states.prefix)} (MLflow run "
            f"{latest.mlflow_run_id}): pass --resume to continue it or --fresh to start it over"
        )
    run = tracker.find_arm_run(arm)
    if run is None:
        return
    pointer = tracker.state_pointer(run)
    if pointer is None:
        say(f"[{arm}] reusing MLflow run {run}: an earlier start of this arm made it and committed no step")
        return
    raise RunExistsError(
        f"arm {arm!r} of {where} has MLflow run {run} (tracking_uri = "
        f"{redact_uri(tracker.tracking_uri)!r}) with "
        f"{pointer[1] + 1} committed step(s), but their state ({pointer[0]}) is not in this store "
        f"({states.store.uri(states.prefix)}), and a new start would log into that run: point `store` "
        "(or `out_dir`) at that state and pass --resume, or pass --fresh to delete the run and start over"
    )


# the per-step metrics a TrainSummary carries (read back from the arm's MLflow run): what the
# benchmarks that compare arms read from it, the off-policy degree and the engine/trainer mismatch
# included (a key left out here reads as missing in every step, not as an error)
SUMMARY_KEYS: tuple[str, ...] = (
    REWARD_KEY,
    "rollout/time_s",
    STEP_KEY,
    "train/samples",
    LAG_KEY,
    OFF_POLICY_KEY,
    *COMPARE_KEYS,
)


def summarize_arm(cfg: ExperimentConfig, arm: str, steps_run: int = 0, wall_s: float = 0.0) -> TrainSummary:
    """An arm's outcome from its committed states, groups logs and MLflow run."""
    store = open_store(cfg.store)
    states = StateStore(store, cfg.experiment, arm)
    last = states.latest()
    if last is None:
        raise RollpackerError(f"arm {arm!r}: no committed state in {store.uri(states.prefix)}")
    tracker = ExperimentTracker(cfg.tracking_uri, cfg.experiment)
    val = tuple(tracker.metric_history(last.mlflow_run_id, "val/accuracy"))
    per_step: list[dict[str, float]] = [{} for _ in range(last.step + 1)]
    for key in SUMMARY_KEYS:
        for s, v in tracker.metric_history(last.mlflow_run_id, key):
            if 1 <= s <= len(per_step):
                per_step[s - 1][key] = v
    return TrainSummary(
        arm=arm,
        run_id=last.mlflow_run_id,
        steps=last.step + 1,
        steps_run=steps_run,
        trained_samples=last.trained_samples,
        val_accuracy=val,
        wall_s=wall_s,
        store_uri=store.uri(states.prefix),
        tracking_uri=cfg.tracking_uri,
        exactly_once=exactly_once(states),
        step_metrics=tuple(per_step),
    )


def exactly_once(states: StateStore) -> PromptAccount:
    """The arm's exactly-once account (``core.accounting``) from its groups logs and last committed
    state: each prompt trained, dropped by dynamic sampling or still waiting, exactly one of them."""
    last = states.latest()
    if last is None:
        return PromptAccount(0, (), 0, (), 0)
    logs = (GroupsLog.from_json(states.get_blob(k, "groups.json").decode()) for k in range(last.step + 1))
    return account_prompts(
        (StepPrompts(g.trained, g.deferred, g.dropped) for g in logs),
        queued=last.long_queue,
        buffered=(e.prompt_id for e in last.partial_cache),
        epochs=last.cursor_epoch + 1,
    )
