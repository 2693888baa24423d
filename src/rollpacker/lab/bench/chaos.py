"""The chaos suite: an experiment of many RL steps with faults injected at seeded random points,
then checked against a fault-free run of the same config.

``rollpacker lab chaos`` (``make chaos``) starts its own local services (SeaweedFS, MLflow, a Ray head;
free ports, under ``<out_dir>/services``, temporary files under a directory of its own), then:

1. runs the config fault-free (the reference; ``--ref-runner inline`` by default: the same stages
   in one process, which is faster; ``kfp`` runs it like the chaos run);
2. runs the same config again through ``kfp.local`` with the faults armed (stage hooks,
   ``rollpacker.testing.faults``), each arm once, with in-run retries only (``--retries``): no
   second command. A fault controller thread carries out the S3 restarts and MLflow outages the
   hooks ask for, and a poller records when each step commits;
3. checks every arm's committed chain (``rollpacker.testing.chain``), counts prompts lost and
   trained twice, and compares each step's state with the reference's;
4. stops the services and looks for what was left behind: processes of their sessions or of this
   process, ports still listening, files in the run's temporary directory.

Fault kinds (``KINDS``): ``stage`` (SIGKILL of the process running the rollout, reward, training
or commit stage), ``rollout-actor``, ``reward-actor``, ``trainer-actor`` (SIGKILL of the
``ray::RolloutService`` / ``RewardService`` / ``TrainerService`` process while a stage waits on
it), ``engine-core`` (the vLLM engine core process inside the rollout service: engine layouts
only), ``s3-restart``, ``mlflow-down`` (until the next step), ``sandbox-hang`` (a frozen sandbox
run: code tasks only). The schedule (``schedule``) is drawn from ``--seed``: every kind at least
once when there are enough faults, at most one fault per (arm, step), never at step 0 (the arm's
start) nor the last step (an MLflow outage would outlast the run).

What is compared with the reference, and why not more: the sync arm's round is the next ``P0``
prompts of the seeded cursor, so its whole state is deterministic and compared exactly (trained
prompts per step, cursor, queue, policy version). Tail batching decides which prompts to defer by
which responses finish first; the engine samples from one random stream per engine process
(vLLM on CPU takes no per-request seeds here), which a re-run of a step or a rebuilt engine
continues differently, so *which* prompts a short round defers after a fault can differ from the
reference. What does not depend on sampling is compared exactly at every step for every arm:
round kind, queue length, cursor, policy version, prompts trained. Prompt identities are compared
too and reported (for tail batching: the last step up to which they are equal); every run is
also checked for exactly-once training and no prompt lost.

Invariants (tests/lab/bench/test_chaos.py, tests/experiment/test_chaos.py):
- the schedule is a function of the seed: at most one fault per (arm, step), steps in
  ``1..steps-2``, every available kind once before any twice;
- a fault counts as recovered when it fired and its arm committed every step in the same run;
  its recovery time runs from the fault to the first commit of a later step than the last one
  committed before it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rollpacker.core.errors import ConfigError
from rollpacker.lab.bench.tables import legend, wrap

# kind -> (hook points it may fire at, fault target in the spec)
KINDS: dict[str, tuple[tuple[str, ...], str]] = {
    "stage": (("rollout", "reward", "train", "commit"), ""),
    "rollout-actor": (("rollout",), "RolloutService"),
    "reward-actor": (("reward", "rollout"), "RewardService"),
    "trainer-actor": (("rollout", "reward"), "TrainerService"),
    "engine-core": (("plan",), "EngineCore"),  # killed when next busy: the step's round or profile
    "s3-restart": (("rollout", "train", "commit"), "s3-restart"),
    "mlflow-down": (("rollout", "commit"), "mlflow-down"),
    "sandbox-hang": (("rollout",), "sandbox-hang"),
}
DEFAULT_ARMS = ("sync", "tail_batching")
KEPT_TEMP = ("rollpacker-ray-", "torchinductor_")  # Ray's session logs, torch's compile cache


@dataclass(frozen=True)
class Fault:
    arm: str
    step: int
    kind: str
    point: str

    @property
    def spec(self) -> str:
        target = KINDS[self.kind][1]
        return f"{self.point}:{target}@{self.step}" if target else f"{self.point}@{self.step}"


def available_kinds(cfg: Any) -> list[str]:
    """The kinds the config can host: an engine core process of its own needs engine layouts, a
    sandbox run needs code prompts."""
    out = [k for k in KINDS if k not in ("engine-core", "sandbox-hang")]
    if cfg.planner.devices:
        out.append("engine-core")
    if cfg.task.name in ("synthetic_code", "mixed", "humaneval"):
        out.append("sandbox-hang")
    return out


def schedule(seed: int, steps: int, n: int, arms: Sequence[str], kinds: Sequence[str]) -> list[Fault]:
    """``n`` faults over ``arms`` x steps ``1..steps-2``, at most one per (arm, step); every kind
    once (in a seeded order) before any kind twice; points drawn per fault."""
    if not kinds:
        raise ConfigError("chaos: no fault kind to inject")
    slots = [(a, s) for a in arms for s in range(1, steps - 1)]
    if n > len(slots):
        raise ConfigError(
            f"--faults {n}: at most one fault per arm and step, and {len(arms)} arm(s) x steps 1.."
            f"{steps - 2} offer {len(slots)}; raise --steps"
        )
    rng = random.Random(seed)
    order: list[str] = []
    while len(order) < n:
        batch = list(kinds)
        rng.shuffle(batch)
        order += batch
    # spread the faults over the arms (round robin), then over each arm's steps
    per_arm: dict[str, list[str]] = {a: [] for a in arms}
    for i, kind in enumerate(order[:n]):
        per_arm[arms[i % len(arms)]].append(kind)
    out = []
    for arm, arm_kinds in per_arm.items():
        steps_drawn = sorted(rng.sample(range(1, steps - 1), len(arm_kinds)))
        for step, kind in zip(steps_drawn, arm_kinds, strict=True):
            out.append(Fault(arm, step, kind, rng.choice(KINDS[kind][0])))
    return out


# -- the config ------------------------------------------------------------------------------------


def chaos_config(
    path: Path, svc: Any, experiment: str, steps: int, arms: Sequence[str], task: str, devices: int = 0
) -> Path:
    """A small config on the local services (``svc``): tiny model, 4 prompts x 2 responses; with
    ``devices`` the rollout runs on engine layouts of that many CPU devices (TP 1 only), each
    replica's vLLM engine core a process of its own (what the ``engine-core`` kind kills)."""
    path.write_text(chaos_config_text(svc, experiment, steps, arms, task, devices))
    return path


# where the services will be, for the checks made before any is started (nothing connects to them)
_UNSTARTED = SimpleNamespace(
    tracking_uri="http://127.0.0.1:1",
    s3_endpoint="127.0.0.1:1",
    bucket="chaos",
    ray_address="127.0.0.1:1",
)


def check_chaos(
    steps: int,
    n_faults: int,
    seed: int,
    arms: Sequence[str],
    task: str,
    ref_runner: str = "inline",
    kinds: Sequence[str] | None = None,
    devices: int = 0,
) -> None:
    """``ConfigError`` for a chaos run that could not run as asked, before any service, warm-up or
    output: its settings, its fault schedule, and the config it would run (the arms' policies, the
    task, the model against the config, the engines against this machine)."""
    from rollpacker.core.config import arm_config, config_from_text
    from rollpacker.engines.gpus import check_machine
    from rollpacker.tasks.models import check_model

    if steps < 4:
        raise ConfigError(f"--steps {steps}: the chaos suite needs at least 4 steps")
    if ref_runner not in ("inline", "kfp"):
        raise ConfigError(f"--ref-runner {ref_runner!r}: use 'inline' or 'kfp'")
    unknown = sorted(set(kinds or ()) - set(KINDS))
    if unknown:
        raise ConfigError(f"--kinds: unknown fault kind(s) {unknown}; known: {', '.join(KINDS)}")
    if devices < 0 or devices > len(os.sched_getaffinity(0)):
        raise ConfigError(
            f"--devices {devices}: this machine offers {len(os.sched_getaffinity(0))} CPU devices; "
            "use 0 (one in-process engine) up to that"
        )
    if "engine-core" in (kinds or ()) and not devices:
        raise ConfigError(
            "--kinds engine-core: an engine core of its own needs engine layouts; add --devices 1"
        )
    schedule(seed, steps, n_faults, list(arms), list(kinds or KINDS))
    text = chaos_config_text(_UNSTARTED, "chaos-check", steps, arms, task, devices)
    config_from_text(text, where="the chaos run's config (--arms, --task, --devices)")
    for arm in arms:
        arm_cfg = arm_config(text, arm)
        check_model(arm_cfg)
        check_machine(arm_cfg)


def chaos_config_text(
    svc: Any, experiment: str, steps: int, arms: Sequence[str], task: str, devices: int = 0
) -> str:
    """The text of ``chaos_config``."""
    layouts = f"devices: {devices}, max_tp: 1, " if devices else ""
    return f"""
experiment: {experiment}
steps: {steps}
arms: [{", ".join(arms)}]
tracking_uri: {svc.tracking_uri}
store: {{endpoint: "{svc.s3_endpoint}", bucket: {svc.bucket}, outage_s: 60}}
services: {{ray_address: "{svc.ray_address}", namespace: {experiment}}}
task: {{name: {task}, num_examples: 400, val_size: 8}}
model: {{preset: tiny, warmup_steps: 200}}
rollout: {{prompts_per_step: 4, responses_per_prompt: 2, max_tokens: 64}}
engine: {{max_num_seqs: 32, max_model_len: 400, kv_cache_gib: 1}}
planner: {{{layouts}profile_batches: [1, 8], profile_contexts: [16, 64], profile_window: 4}}
reward: {{sandbox: {{t_min_s: 0.5, t_max_s: 3.0}}}}
validation: {{every: 1000, max_tokens: 32}}
"""


# -- the fault controller ----------------------------------------------------------------------------


class Controller:
    """Carries out the S3 and MLflow faults the hooks request (``<marks>/requests/*.json``), and
    records when each arm commits a step."""

    def __init__(self, svc: Any, seaweed_ports: Any, mlflow_port: int, outage_s: float) -> None:
        self.svc, self.seaweed_ports, self.mlflow_port, self.outage_s = (
            svc,
            seaweed_ports,
            mlflow_port,
            outage_s,
        )
        self.marks: Path | None = None
        self.states: Any = None  # the StateStore of the arm running now
        self.arm = ""
        self.events: list[dict[str, Any]] = []
        self.commits: dict[str, list[tuple[float, int]]] = {}
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._serve, daemon=True),
            threading.Thread(target=self._poll, daemon=True),
        ]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)

    def _serve(self) -> None:
        done: set[str] = set()
        while not self._stop.wait(0.1):
            marks = self.marks
            if marks is None or not (marks / "requests").is_dir():
                continue
            for req in sorted((marks / "requests").glob("*.json")):
                if req.name in done:
                    continue
                done.add(req.name)
                self._carry_out(json.loads(req.read_text()), req.with_suffix(".ack"))

    def _carry_out(self, doc: dict[str, Any], ack: Path) -> None:
        from rollpacker import devservices

        ev: dict[str, Any] = {**doc, "arm": self.arm, "t_down": time.time()}
        root = self.svc.root
        try:
            if doc["action"] == "s3-restart":
                devservices.down(root, names=["seaweedfs"], grace_s=2.0)
                ack.write_text("down")
                time.sleep(self.outage_s)
                ev["t_start"] = time.time()
                devservices.up(
                    root, bucket=self.svc.bucket, s3=True, mlflow=False, ray=False,
                    seaweed_ports=self.seaweed_ports, timeout_s=120.0,
                )  # fmt: skip
            elif doc["action"] == "mlflow-down":
                devservices.down(root, names=["mlflow"], grace_s=2.0)
                ack.write_text("down")
            elif doc["action"] == "mlflow-up":
                ev["t_start"] = time.time()
                devservices.up(
                    root, bucket=self.svc.bucket, s3=True, mlflow=True, ray=False,
                    seaweed_ports=self.seaweed_ports, mlflow_port=self.mlflow_port, timeout_s=180.0,
                )  # fmt: skip
            ev["t_up"] = time.time()
        except Exception as e:  # recorded: the report names the fault whose server did not come back
            ev["error"] = f"{type(e).__name__}: {e}"
            ack.write_text("error")
        self.events.append(ev)

    def _poll(self) -> None:
        while not self._stop.wait(0.5):
            states, arm = self.states, self.arm
            if states is None:
                continue
            try:
                latest = states.latest()
            except Exception:
                continue  # the store is down (a restart): try again
            seen = self.commits.setdefault(arm, [])
            step = latest.step if latest is not None else -1
            if not seen or seen[-1][1] != step:
                seen.append((time.time(), step))


# -- the run ---------------------------------------------------------------------------------------


@dataclass
class ChaosReport:
    steps: int
    seed: int
    arms: list[str]
    task: str
    faults: list[dict[str, Any]] = field(default_factory=list)
    arm_runs: dict[str, dict[str, Any]] = field(default_factory=dict)
    comparison: dict[str, Any] = field(default_factory=dict)
    leftovers: dict[str, Any] = field(default_factory=dict)
    reference_step_s: float = 0.0
    wall_s: float = 0.0
    devices: int = 0  # planner.devices of the config (0: one in-process engine)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["by_kind"] = by_kind(self.faults)
        d["ok"] = ok(d)
        return d


def run_chaos(
    steps: int,
    n_faults: int,
    seed: int,
    out_dir: Path,
    arms: Sequence[str] = DEFAULT_ARMS,
    task: str = "synthetic_code",
    retries: int | None = None,
    ref_runner: str = "inline",
    outage_s: float = 3.0,
    kinds: Sequence[str] | None = None,
    devices: int = 0,
    say: Callable[[str], None] = lambda s: None,
) -> ChaosReport:
    """Services up, the reference run, the chaos run, the checks, services down (see the module
    docstring)."""
    from rollpacker import devservices
    from rollpacker.core.config import load_config

    check_chaos(steps, n_faults, seed, arms, task, ref_runner, kinds, devices)  # before anything starts
    out_dir = out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    report = ChaosReport(steps, seed, list(arms), task, devices=devices)
    preexisting = _child_pids()  # this process's children from before the run are not its leftovers
    saved_env = dict(os.environ)
    tmp = Path(tempfile.mkdtemp(prefix="rc", dir="/tmp"))  # short: Ray's sockets live under it
    os.environ["TMPDIR"] = str(tmp)  # every process of the run writes its temporary files here
    tempfile.tempdir = None
    root = out_dir / "services"
    sw_ports, ml_port, ray_ports = (
        devservices.SeaweedPorts.free(),
        devservices.free_ports(1)[0],
        devservices.RayPorts.free(),
    )
    ctl: Controller | None = None
    records: dict[str, Any] = {}
    try:
        say(f"[chaos] starting the local services under {root}")
        svc = devservices.up(
            root, bucket="chaos", seaweed_ports=sw_ports, mlflow_port=ml_port, ray_ports=ray_ports,
            timeout_s=180.0,
        )  # fmt: skip
        ctl = Controller(svc, sw_ports, ml_port, outage_s)
        os.environ.update(svc.env())
        from rollpacker.testing.faults import SERVICES_ENV

        os.environ[SERVICES_ENV] = str(root)
        records = _records(root, "start")
        ctl.start()
        tag = f"s{seed}"
        ref_cfg = chaos_config(
            out_dir / "reference.yaml", svc, f"chaos-ref-{tag}", steps, arms, task, devices
        )
        run_cfg = chaos_config(out_dir / "chaos.yaml", svc, f"chaos-{tag}", steps, arms, task, devices)
        cfg = load_config(run_cfg)
        plan = schedule(seed, steps, n_faults, list(arms), kinds or available_kinds(cfg))
        say(f"[chaos] {len(plan)} faults: " + ", ".join(f"{f.arm}/{f.spec}" for f in plan))
        report.reference_step_s = _reference(ref_cfg, ref_runner, out_dir, say)
        for arm in arms:
            faults = [f for f in plan if f.arm == arm]
            report.arm_runs[arm] = _chaos_arm(run_cfg, arm, faults, ctl, out_dir, retries, say)
            report.faults += _outcomes(faults, report.arm_runs[arm], ctl, out_dir / "marks" / arm)
        report.comparison = compare_runs(ref_cfg, run_cfg, arms, steps)
    finally:
        if ctl is not None:
            ctl.stop()
        say("[chaos] stopping the local services")
        records.update(_records(root, "end"))  # restarted servers run in sessions of their own
        devservices.down(root, grace_s=5.0)
        report.leftovers = leftovers(records, sw_ports, ml_port, ray_ports, tmp, root, preexisting)
        shutil.rmtree(tmp, ignore_errors=True)  # counted: now the run's own directory goes too
        os.environ.clear()
        os.environ.update(saved_env)
        tempfile.tempdir = None
    report.wall_s = time.perf_counter() - t0
    return report


def _records(root: Path, tag: str) -> dict[str, Any]:
    """The services' pid records (session ids) under ``root``."""
    out = {}
    for n in ("seaweedfs", "mlflow", "ray"):
        p = root / "pids" / f"{n}.json"
        if p.exists():
            out[f"{n}@{tag}"] = json.loads(p.read_text())
    return out


def _reference(cfg_path: Path, runner: str, out_dir: Path, say: Callable[[str], None]) -> float:
    """The fault-free run; its median step time (MLflow's ``step/time_s``)."""
    from rollpacker.experiment import run_experiment
    from rollpacker.tracking import ExperimentTracker

    say(f"[chaos] the fault-free reference ({runner})")
    t0 = time.perf_counter()
    out = run_experiment(
        cfg_path, runner=runner, retries=0, pipeline_root=out_dir / "kfp-ref", start_services=False,
        echo=say, fresh=True,
    )  # fmt: skip
    say(f"[chaos] reference done in {time.perf_counter() - t0:.0f} s")
    times: list[float] = []
    from rollpacker.core.config import load_config

    cfg = load_config(cfg_path)
    tracker = ExperimentTracker(cfg.tracking_uri, cfg.experiment)
    for arm in out.arms:
        run = tracker.find_arm_run(arm.arm)
        if run is not None:
            times += [v for _, v in tracker.metric_history(run, "step/time_s")]
    return statistics.median(times) if times else 0.0


def _chaos_arm(
    cfg_path: Path,
    arm: str,
    faults: list[Fault],
    ctl: Controller,
    out_dir: Path,
    retries: int | None,
    say: Callable[[str], None],
) -> dict[str, Any]:
    """One arm through kfp.local with its faults armed; what happened."""
    from rollpacker.core.config import load_config
    from rollpacker.core.errors import RollpackerError
    from rollpacker.experiment import run_experiment
    from rollpacker.stages.hooks import HOOK_ENV
    from rollpacker.store import open_store
    from rollpacker.store.state_store import StateStore
    from rollpacker.testing.faults import HOOK, mark_name

    marks = out_dir / "marks" / arm
    if marks.exists():
        shutil.rmtree(marks)
    marks.mkdir(parents=True)
    os.environ.update(
        {
            HOOK_ENV: HOOK,
            "ROLLPACKER_FAULT": ",".join(f.spec for f in faults),
            "ROLLPACKER_FAULT_MARK": str(marks),
        }
    )
    cfg = load_config(cfg_path)
    ctl.arm, ctl.marks = arm, marks
    ctl.states = StateStore(open_store(cfg.store), cfg.experiment, arm)
    stamped: list[tuple[float, str]] = []

    def echo(line: str) -> None:
        stamped.append((time.time(), line))
        say(line)

    budget = retries if retries is not None else 2 * len(faults) + 2
    say(f"[chaos] {arm}: {cfg.steps} steps, faults {[f.spec for f in faults]}, retries {budget}")
    t0 = time.perf_counter()
    error = ""
    try:
        run_experiment(
            cfg_path, runner="kfp", arms=[arm], retries=budget, pipeline_root=out_dir / "kfp" / arm,
            start_services=False, echo=echo, fresh=True,
        )  # fmt: skip
    except RollpackerError as e:
        error = str(e).splitlines()[0]
        say(f"[chaos] {arm}: the run gave up: {error}")
    finally:
        for k in (HOOK_ENV, "ROLLPACKER_FAULT", "ROLLPACKER_FAULT_MARK"):
            os.environ.pop(k, None)
    time.sleep(1.0)  # the poller's last look
    for f in faults:  # a sandbox-hang watcher still waiting for its frozen run to end
        mark = marks / mark_name(f.spec)
        t_wait = time.monotonic()
        while f.kind == "sandbox-hang" and mark.exists() and not mark.read_text().startswith("{"):
            if time.monotonic() - t_wait > 30:
                break
            time.sleep(0.5)
    latest = None
    try:
        latest = ctl.states.latest()
    except Exception as e:
        error = error or f"state unreadable: {e}"
    ctl.states = None
    failures = [(t, line) for t, line in stamped if "a step failed" in line]
    return {
        "seconds": time.perf_counter() - t0,
        "committed_step": latest.step if latest is not None else -1,
        "complete": latest is not None and latest.step == cfg.steps - 1 and not error,
        "error": error,
        "failures": [{"t": t, "line": line} for t, line in failures],
    }


def _watcher_outcome(mark: Path, wait_s: float = 30.0) -> dict[str, Any]:
    """What a fault's watcher process wrote into its mark (``{}`` without one): the hook creates
    the mark, the watcher replaces its text with JSON when it is done, which can be a moment after
    the run ended."""
    t0 = time.monotonic()
    while mark.exists():
        text = mark.read_text()
        if text.startswith("{"):
            try:
                return dict(json.loads(text))
            except ValueError:
                pass  # being written
        if time.monotonic() - t0 > wait_s:
            return {}
        time.sleep(0.2)
    return {}


def _outcomes(faults: list[Fault], run: dict[str, Any], ctl: Controller, marks: Path) -> list[dict[str, Any]]:
    """Per fault: whether and when it fired, recovered, the seconds to recover, the re-runs it cost."""
    from rollpacker.testing.faults import mark_name

    commits = ctl.commits.get(faults[0].arm, []) if faults else []
    fired_at: dict[Fault, float] = {}
    out: list[dict[str, Any]] = []
    for f in faults:
        mark = marks / mark_name(f.spec)
        row: dict[str, Any] = {**dataclasses.asdict(f), "spec": f.spec, "fired": mark.exists()}
        doc = _watcher_outcome(mark) if f.kind in ("sandbox-hang", "engine-core") else {}
        if f.kind == "sandbox-hang" and mark.exists():
            row["fired"] = bool(doc.get("stopped"))
            if row["fired"]:
                row["hang_s"] = doc["t_gone"] - doc["t_stop"]
                row["t_stop"] = doc["t_stop"]
        if f.kind == "engine-core" and mark.exists():  # killed when it was next busy
            row["fired"] = bool(doc.get("killed"))
            if row["fired"]:
                row["t_stop"] = doc["t_kill"]
                row["waited_s"] = doc["waited_s"]
                # killed in its own step (its round or profile), not in a later one's: before the
                # poller saw the step commit (it sees a commit late, never early)
                seen = next((ts for ts, s in commits if s >= f.step), None)
                row["in_its_step"] = seen is not None and doc["t_kill"] < seen
        ev = next((e for e in ctl.events if e.get("spec") == f.spec and e["action"] != "mlflow-up"), None)
        up = next((e for e in ctl.events if e.get("spec") == f.spec and e["action"] == "mlflow-up"), None)
        if ev is not None:
            row["error"] = ev.get("error", "")
            row["outage_s"] = (up or ev).get("t_up", time.time()) - ev["t_down"]
        if row["fired"]:
            fired_at[f] = ev["t_down"] if ev is not None else row.get("t_stop", mark.stat().st_mtime)
        out.append(row)
    order = sorted(fired_at, key=lambda f: fired_at[f])
    for row, f in zip(out, faults, strict=True):
        if f not in fired_at:
            row.update(recovered=False, recover_s=None, reruns=0)
            continue
        t = fired_at[f]
        # committed when it fired: the step before it, or the step itself at the commit point (the
        # hook runs after the state is written); the poller may not have seen that commit yet
        before = max(max((s for ts, s in commits if ts <= t), default=-1), f.step - (f.point != "commit"))
        after = next((ts for ts, s in commits if ts > t and s > before), None)
        nxt = min((fired_at[g] for g in order if fired_at[g] > t), default=float("inf"))
        reruns = sum(1 for x in run["failures"] if t <= x["t"] < nxt)
        row.update(
            recovered=bool(run["complete"] and not row.get("error") and after is not None),
            recover_s=(after - t) if after is not None else None,
            reruns=reruns,
        )
    return out


# -- the checks ------------------------------------------------------------------------------------


def _step_view(state: Any, groups: dict[str, Any]) -> dict[str, Any]:
    return {
        "round_kind": groups["round_kind"],
        "queue_len": len(state.long_queue),
        "cursor": [state.cursor_epoch, state.cursor_position],
        "policy_version": state.policy_version,
        "trained_prompts": state.trained_prompts,
        "partial_len": len(state.partial_cache),
        # prompt identities
        "trained": sorted(groups["trained"]),
        "queue": list(state.long_queue),
        "partial": sorted(e.prompt_id for e in state.partial_cache),
    }


DETERMINISTIC = ("round_kind", "queue_len", "cursor", "policy_version", "trained_prompts", "partial_len")
IDENTITIES = ("trained", "queue", "partial")


def compare_runs(ref_cfg: Path, run_cfg: Path, arms: Sequence[str], steps: int) -> dict[str, Any]:
    """Per arm: the chain's invariants, exactly-once, and each step's state against the reference."""
    from rollpacker.experiment import exactly_once
    from rollpacker.testing.chain import chain_problems, read_chain

    out: dict[str, Any] = {}
    for arm in arms:
        entry: dict[str, Any] = {"chain_problems": chain_problems(run_cfg, steps, arm)}
        try:
            _, _, states, chain, groups = read_chain(run_cfg, arm, steps)
            _, _, _, ref_chain, ref_groups = read_chain(ref_cfg, arm, steps)
        except AssertionError as e:
            entry["error"] = str(e)
            out[arm] = entry
            continue
        once = exactly_once(states)
        entry["prompts_lost"] = len(once.deferred_lost)
        entry["trained_twice"] = len(once.trained_twice)
        entry["prompts_trained"] = once.prompts_trained
        det_diff: list[str] = []
        id_equal_through = -1
        for s in range(steps):
            a = _step_view(chain[s + 1], groups[s])
            b = _step_view(ref_chain[s + 1], ref_groups[s])
            det_diff += [f"step {s}: {k} {a[k]} != {b[k]}" for k in DETERMINISTIC if a[k] != b[k]]
            if id_equal_through == s - 1 and all(a[k] == b[k] for k in IDENTITIES):
                id_equal_through = s
        entry["deterministic_fields_equal"] = not det_diff
        entry["deterministic_diffs"] = det_diff[:20]
        entry["identities_equal_through_step"] = id_equal_through
        entry["identities_equal"] = id_equal_through == steps - 1
        out[arm] = entry
    return out


def _child_pids() -> set[int]:
    import psutil

    try:
        return {c.pid for c in psutil.Process().children(recursive=True)}
    except psutil.Error:
        return set()


def leftovers(
    records: dict[str, Any],
    sw_ports: Any,
    ml_port: int,
    ray_ports: Any,
    tmp: Path,
    services_root: Path,
    preexisting: set[int] = frozenset(),  # type: ignore[assignment]
) -> dict[str, Any]:
    """After the services are stopped: processes of their sessions or of this process still alive
    (but not children it had before the run: another test's services in the same pytest process),
    ports still listening, files left in the run's temporary directory."""
    import psutil

    from rollpacker import devservices

    time.sleep(1.0)
    sids = {int(r["sid"]) for r in records.values()}
    procs = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if os.getsid(p.pid) in sids and p.status() != psutil.STATUS_ZOMBIE:
                procs.append(" ".join(p.info.get("cmdline") or [])[:80])
        except (OSError, psutil.Error):
            continue
    for c in psutil.Process().children(recursive=True):
        if c.pid in preexisting:
            continue
        try:
            cmd = " ".join(c.cmdline())
            # multiprocessing's resource tracker serves this process (the in-process reference's
            # engine) and ends with it: not a leftover of the run
            if c.status() != psutil.STATUS_ZOMBIE and "multiprocessing.resource_tracker" not in cmd:
                procs.append(cmd[:80])
        except psutil.Error:
            continue
    ports = [(devservices.HOST, p) for p in dataclasses.astuple(sw_ports)] + [(devservices.HOST, ml_port)]
    ports += [
        (devservices.RAY_HOST, p) for p in (ray_ports.gcs, ray_ports.client_server, ray_ports.dashboard_agent)
    ]
    open_ports = [f"{h}:{p}" for h, p in ports if _listening(h, p)]
    files = sorted(str(p.relative_to(tmp)) for p in tmp.iterdir()) if tmp.is_dir() else []
    server_tmp = services_root / "tmp"  # the servers' own temporary files (devservices)
    if server_tmp.is_dir():
        files += sorted(str(p) for p in server_tmp.rglob("*") if p.is_file())
    # kept by design: Ray's session directory (its logs, `ray start`), torch's compile cache
    leaked = [f for f in files if not f.startswith(KEPT_TEMP)]
    return {
        "processes": procs,
        "ports": open_ports,
        "temp_files": leaked,
        "temp_kept": files,
        "tmp": str(tmp),
    }


def _listening(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.3)
        return s.connect_ex((host, port)) == 0


# -- the table -------------------------------------------------------------------------------------


def by_kind(faults: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for kind in dict.fromkeys(f["kind"] for f in faults):
        fs = [f for f in faults if f["kind"] == kind]
        secs = [f["recover_s"] for f in fs if f.get("recover_s") is not None]
        rows.append(
            {
                "kind": kind,
                "injected": sum(1 for f in fs if f["fired"]),
                "scheduled": len(fs),
                "recovered": sum(1 for f in fs if f.get("recovered")),
                "recover_s_median": statistics.median(secs) if secs else None,
                "recover_s_max": max(secs) if secs else None,
                "reruns": sum(f.get("reruns", 0) for f in fs),
            }
        )
    return rows


def ok(d: dict[str, Any]) -> bool:
    faults, comp, left = d["faults"], d["comparison"], d["leftovers"]
    return bool(
        faults
        and all(f["fired"] and f.get("recovered") for f in faults)
        and all(r.get("complete") for r in d["arm_runs"].values())
        and all(
            not c.get("error")
            and not c["chain_problems"]
            and c.get("prompts_lost") == 0
            and c.get("trained_twice") == 0
            and c.get("deterministic_fields_equal")
            for c in comp.values()
        )
        and comp.get("sync", {"identities_equal": True}).get("identities_equal")
        and not left.get("processes")
        and not left.get("ports")
        and not left.get("temp_files")
    )


_LEGEND = (
    ("injected", "faults that fired (of those scheduled)"),
    ("recovered", "fired, and the arm committed every step in the same run (its own retries)"),
    (
        "recover s",
        "from the fault to the first commit of a later step than the last one before it "
        "(median / max; a fault-free step takes the reference's step time)",
    ),
    ("re-runs", "failed pipeline attempts the fault cost (each re-runs its step from the committed state)"),
)


def render(d: dict[str, Any]) -> str:
    n_kinds = len([r for r in d["by_kind"] if r["injected"]])
    lines = wrap(
        f"chaos: {len(d['arms'])} arm(s) ({', '.join(d['arms'])}) x {d['steps']} steps, task {d['task']}, "
        f"seed {d['seed']}: {sum(r['injected'] for r in d['by_kind'])} faults of {n_kinds} kinds in "
        f"{d['wall_s']:.0f} s; fault-free step {d['reference_step_s']:.1f} s (median)"
    )
    hdr = f"{'fault kind':<14} {'injected':>9} {'recovered':>9} {'recover s':>15} {'re-runs':>7}"
    lines += [hdr, "-" * len(hdr)]

    def secs(r: dict[str, Any]) -> str:
        if r["recover_s_median"] is None:
            return "-"
        return f"{r['recover_s_median']:.1f} / {r['recover_s_max']:.1f}"

    for r in d["by_kind"]:
        lines.append(
            f"{r['kind']:<14} {r['injected']:>4} of {r['scheduled']:<2} {r['recovered']:>9} {secs(r):>15} "
            f"{r['reruns']:>7}"
        )
    tot_inj = sum(r["injected"] for r in d["by_kind"])
    tot_rec = sum(r["recovered"] for r in d["by_kind"])
    lines.append(
        f"{'all':<14} {tot_inj:>9} {tot_rec:>9} {'':>15} {sum(r['reruns'] for r in d['by_kind']):>7}"
    )
    lines.append("")
    for f in d["faults"]:
        lines.append(_fault_line(f))
    lines.append("")
    for arm, c in d["comparison"].items():
        lines += wrap(_arm_line(arm, c, d["arm_runs"].get(arm, {})))
    left = d["leftovers"]
    where = left.get("processes", [])[:3] + left.get("ports", [])[:3] + left.get("temp_files", [])[:3]
    lines += wrap(
        f"after the services stopped: {len(left.get('processes', []))} process(es), "
        f"{len(left.get('ports', []))} port(s) still listening, {len(left.get('temp_files', []))} "
        f"temporary file(s) left" + (f": {', '.join(where)}" if where else "")
    )
    lines.append(f"verdict: {'PASS' if d['ok'] else 'FAIL'}")
    return "\n".join(lines + legend(_LEGEND))


def _fault_line(f: dict[str, Any]) -> str:
    extra = f" (hung {f['hang_s']:.1f} s)" if "hang_s" in f else ""
    extra += f" (down {f['outage_s']:.1f} s)" if "outage_s" in f else ""
    extra += f" ERROR {f['error']}" if f.get("error") else ""
    rec = f"{f['recover_s']:.1f} s" if f.get("recover_s") is not None else "-"
    fired = "fired" if f["fired"] else "NOT FIRED"
    recovered = "recovered" if f.get("recovered") else "NOT RECOVERED"
    return (
        f"  {f['arm']:<14} step {f['step']:>3}  {f['kind']:<13} at {f['point']:<8} {fired:<9} "
        f"{recovered} in {rec}, {f.get('reruns', 0)} re-run(s){extra}"
    )


def _arm_line(arm: str, c: dict[str, Any], run: dict[str, Any]) -> str:
    if c.get("error"):
        return f"{arm}: {c['error']}"
    gave_up = f", GAVE UP: {run['error']}" if run.get("error") else ""
    chain = "hold" if not c["chain_problems"] else "BROKEN: " + "; ".join(c["chain_problems"][:3])
    det = "equal" if c["deterministic_fields_equal"] else "DIFFER: " + "; ".join(c["deterministic_diffs"][:3])
    ids = (
        "equal at every step"
        if c["identities_equal"]
        else f"equal through step {c['identities_equal_through_step']}"
    )
    return (
        f"{arm}: committed through step {run.get('committed_step')} in {run.get('seconds', 0):.0f} s, "
        f"{len(run.get('failures', []))} failed attempt(s){gave_up}; chain invariants {chain}; "
        f"{c['prompts_trained']} prompts trained, {c['prompts_lost']} lost, {c['trained_twice']} trained "
        f"twice; vs the fault-free run: round kinds, queue lengths, cursor, policy version {det} at "
        f"every step; prompt identities (trained, queue, partial cache) {ids}"
    )


def ok_left(left: dict[str, Any]) -> bool:
    return not left.get("processes") and not left.get("ports") and not left.get("temp_files")
