"""One RL step as stages: plain functions the KFP components and the inline runner both call.

    plan -> [profile] -> rollout -> reward, judge -> train -> commit

Every argument and result is JSON text (the config as YAML text), so a stage runs the same in a
KFP task, a subprocess or this process. Heavy work happens in the services (Ray actors that stay
warm across steps); a stage tells them what to do and reports what they did. The committed state
in the object store is the only thing carried between steps: a stage that dies leaves the pointer
on the previous step, and re-running the step (a new attempt) starts from exactly that state.

Invariants:
- ``plan`` refuses to start when the store, the MLflow server or the Ray cluster is unreachable,
  naming the setting to fix (nothing is half-done);
- every later stage checks that the committed state is still the one its plan read; a stale plan
  (another attempt committed meanwhile) is refused;
- ``commit`` writes the step's groups log and metrics, then the new state document, then moves
  the pointer; a commit whose step is already committed returns what was committed (idempotent).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from rollpacker.core.errors import RollpackerError
from rollpacker.core.state import ControllerState, StateError, TPPlan

LENGTH_HISTORY_MAX = 20_000  # (prompt, longest response) pairs kept in the state


@dataclass(frozen=True)
class PlanOutput:
    plan: str  # JSON
    step: int
    need_profile: bool
    skip: bool


@dataclass(frozen=True)
class CommitOutput:
    summary: str  # JSON
    metrics: dict[str, float]


# -- shared context -------------------------------------------------------------------------------
class _Ctx:
    def __init__(self, config_text: str, arm: str, check: bool = False) -> None:
        from rollpacker.services.base import arm_config
        from rollpacker.services.registry import ServiceRegistry
        from rollpacker.store.objstore import ObjectStore
        from rollpacker.store.state_store import StateStore

        self.config_text = config_text
        self.arm = arm
        self.cfg = arm_config(config_text, arm)
        self.store = ObjectStore.from_config(self.cfg.store)
        if check:
            self.store.check()
        self.states = StateStore(self.store, self.cfg.experiment, arm)
        self.services = ServiceRegistry.for_config(config_text, self.cfg, arm)

    def tracker(self, check: bool = False) -> Any:
        from rollpacker.tracking import ExperimentTracker

        # a stage must not hang for minutes in MLflow's default retry loop (7 tries, backoff)
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")

        t = ExperimentTracker(self.cfg.tracking_uri, self.cfg.experiment)
        if check:
            t.check()
        return t

    @property
    def prefix(self) -> str:
        return f"{self.cfg.experiment}/{self.arm}"

    def base_key(self) -> str:
        return f"{self.prefix}/ckpt/base/"

    def state_for(self, plan: dict[str, Any]) -> ControllerState:
        """The committed state ``plan`` was made from; refuses a stale plan."""
        latest = self.states.latest()
        if latest is None or latest.step != plan["state_step"]:
            raise StateError(
                f"step {plan['step']} (attempt {plan['attempt']}) was planned from state step "
                f"{plan['state_step']}, but the committed state is at step "
                f"{latest.step if latest else '(none)'}: re-run the step from its plan stage"
            )
        return latest


def _fault(stage: str, step: int, delay_s: float = 0.0) -> None:
    """Test hook: ``ROLLPACKER_FAULT=<stage>@<step>[,...]`` SIGKILLs this process ``delay_s`` into
    the stage, once per spec (a file ``<stage>-at-<step>`` in the directory
    ``ROLLPACKER_FAULT_MARK`` records that it fired, so the re-run goes through)."""
    specs = [x.strip() for x in os.environ.get("ROLLPACKER_FAULT", "").split(",") if x.strip()]
    mark_dir = os.environ.get("ROLLPACKER_FAULT_MARK", "")
    if f"{stage}@{step}" not in specs or not mark_dir:
        return
    try:
        fd = os.open(os.path.join(mark_dir, f"{stage}-at-{step}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return  # already fired once: the re-run goes through
    os.write(fd, f"pid {os.getpid()}\n".encode())
    os.close(fd)

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if delay_s <= 0:
        die()
    threading.Timer(delay_s, die).start()


def _out(d: dict[str, Any], t0: float, t0_wall: float) -> str:
    d["work_s"] = time.perf_counter() - t0
    d["t_start_wall"] = t0_wall
    d["t_end_wall"] = time.time()
    return json.dumps(d)


# -- the stages -----------------------------------------------------------------------------------
def plan(config: str, arm: str) -> PlanOutput:
    """Load (or create) the arm's committed state, check every service answers, sync the engine to
    the state's weights, and plan the next step (round kind, prompts)."""
    t0, t0_wall = time.perf_counter(), time.time()
    ctx = _Ctx(config, arm, check=True)
    tracker = ctx.tracker(check=True)
    state = ctx.states.recover()  # finishes a commit that died between its document and the pointer
    t_init = time.perf_counter()
    if state is None:
        state = _init_state(ctx, tracker)
    else:
        _repair_tracking(ctx, tracker, state)
    step = state.next_step
    attempt = uuid.uuid4().hex[:12]
    skip = step >= ctx.cfg.steps
    plan: dict[str, Any] = {
        "experiment": ctx.cfg.experiment,
        "arm": arm,
        "step": step,
        "state_step": state.step,
        "attempt": attempt,
        "skip": skip,
        "base_uri": ctx.store.uri(ctx.base_key()),
        "run_id": state.mlflow_run_id,
    }
    need_profile = False
    if not skip:
        rollout = ctx.services.get("rollout")
        plan["sync"] = rollout.call("sync", state.to_json())
        plan.update(rollout.call("plan", state.to_json(), step))
        # no profile yet, or the last step's decode time drifted from its prediction
        need_profile = not state.profile_uri or state.profile_drift > ctx.cfg.planner.reprofile_margin
        if state.profile_uri and need_profile:
            plan["reprofile"] = f"drift {state.profile_drift:.2f} > {ctx.cfg.planner.reprofile_margin}"
        if state.step == -1:  # the starting point of the validation curve
            val = rollout.call("validate", 0, attempt)
            tracker.log_step(state.mlflow_run_id, 0, val)
            plan["val0"] = val
    # one-off work of an arm's first step (warm-up, engine start, first validation): not step time
    plan["init_s"] = time.perf_counter() - t_init if state.step == -1 else 0.0
    return PlanOutput(_out(plan, t0, t0_wall), step, need_profile, skip)


def profile(config: str, plan: str) -> str:
    """Measure the engine (decode step latency by batch size) into a profile table in the store."""
    t0, t0_wall = time.perf_counter(), time.time()
    p = json.loads(plan)
    if p["skip"]:
        return _out({"skipped": True}, t0, t0_wall)
    ctx = _Ctx(config, p["arm"])
    doc = ctx.services.get("rollout").call("profile")
    key = _profile_key(ctx, p["attempt"])
    uri = ctx.store.uri(key)
    ctx.store.put_json(key, doc)
    if p.get("run_id"):
        ctx.tracker().log_profile(p["run_id"], p["step"] + 1, uri, doc)
    errors = {k: v["window_mape"] for k, v in doc["validation"].items()}
    return _out(
        {
            "profile_uri": uri,
            "points": sum(len(x["points"]) for x in doc["table"]["layouts"]),
            "error": errors,
        },
        t0,
        t0_wall,
    )


def rollout(config: str, plan: str) -> str:
    """Run the step's round on the rollout service; rewards and gradients start inside the services
    as responses and groups finish."""
    t0, t0_wall = time.perf_counter(), time.time()
    p = json.loads(plan)
    if p["skip"]:
        return _out({"skipped": True}, t0, t0_wall)
    ctx = _Ctx(config, p["arm"])
    state = ctx.state_for(p)
    attempt = p["attempt"]
    begun = {"trainer": ctx.services.get("trainer").call("begin", attempt, state.to_json(), p["base_uri"])}
    for role in p["roles"]:
        begun[role] = ctx.services.get(role).call("begin", attempt, state.timeout_anchors)
    _fault("rollout", p["step"], delay_s=1.0)
    summary = ctx.services.get("rollout").call(
        "run_round", _with_fresh_profile(ctx, state, attempt).to_json(), p["step"], attempt
    )
    summary["rollout_end_wall"] = time.time()
    summary["begin"] = begun
    return _out(summary, t0, t0_wall)


def _drain(role: str, config: str, plan: str, rollout: str) -> str:
    t0, t0_wall = time.perf_counter(), time.time()
    p, r = json.loads(plan), json.loads(rollout)
    if p["skip"] or role not in p["roles"]:
        return _out({"skipped": True, "metrics": {}}, t0, t0_wall)
    ctx = _Ctx(config, p["arm"])
    ctx.state_for(p)
    _fault(role, p["step"], delay_s=0.0)
    out = ctx.services.get(role).call(
        "drain", p["attempt"], r["groups_by_role"].get(role, []), r["rollout_end_wall"]
    )
    return _out(out, t0, t0_wall)


def reward(config: str, plan: str, rollout: str) -> str:
    """Drain the step's rule and sandbox rewards (most were scored during rollout)."""
    return _drain("reward", config, plan, rollout)


def judge(config: str, plan: str, rollout: str) -> str:
    """Drain the step's judge rewards."""
    return _drain("judge", config, plan, rollout)


def train(config: str, plan: str, rollout: str, reward: str, judge: str) -> str:
    """The stream trainer's one deferred update, the checkpoint, the weight push; validation when due."""
    t0, t0_wall = time.perf_counter(), time.time()
    p, r = json.loads(plan), json.loads(rollout)
    if p["skip"]:
        return _out({"skipped": True}, t0, t0_wall)
    ctx = _Ctx(config, p["arm"])
    ctx.state_for(p)
    step, cfg = p["step"], ctx.cfg
    key = f"{ctx.prefix}/ckpt/step-{step:06d}-{p['attempt']}/"
    batch_key = f"{ctx.prefix}/batches/step-{step:06d}-{p['attempt']}/samples.json"
    out = ctx.services.get("trainer").call("finish", p["attempt"], step, r["trained"], key, batch_key)
    _fault("train", step, delay_s=0.0)  # the nastiest point: trainer and engine ahead of the state
    out["val_s"] = 0.0
    if (step + 1) % cfg.validation.every == 0 or step == cfg.steps - 1:
        t_val = time.perf_counter()
        out["metrics"].update(ctx.services.get("rollout").call("validate", step + 1, p["attempt"]))
        out["val_s"] = time.perf_counter() - t_val
    return _out(out, t0, t0_wall)


def commit(config: str, plan: str, rollout: str, reward: str, judge: str, train: str) -> CommitOutput:
    """Write the new state atomically (groups log and metrics first, then the state document, then
    the pointer) and log the step to MLflow."""
    t0, t0_wall = time.perf_counter(), time.time()
    p = json.loads(plan)
    if p["skip"]:
        return CommitOutput(_out({"skipped": True}, t0, t0_wall), {})
    ctx = _Ctx(config, p["arm"])
    step = p["step"]
    latest = ctx.states.latest()
    if latest is not None and latest.step == step:
        done = ctx.states.get_blob(step, "commit.json")
        if json.loads(done)["attempt"] == p["attempt"]:  # this very commit ran before and died after
            d = json.loads(done)
            return CommitOutput(json.dumps(d), d["metrics"])
    state = ctx.state_for(p)
    r, rw, jd, tr = (json.loads(x) for x in (rollout, reward, judge, train))
    prof_key = _profile_key(ctx, p["attempt"])
    prof = ctx.store.uri(prof_key) if ctx.store.exists(prof_key) else ""
    metrics = _step_metrics(r, rw, jd, tr)
    hist = dict(state.length_history)
    hist.update(r["longest"])
    new = state.successor(
        cursor_seed=r["next_cursor"]["seed"],
        cursor_epoch=r["next_cursor"]["epoch"],
        cursor_position=r["next_cursor"]["position"],
        long_queue=tuple(r["next_queue"]),
        partial_cache=_buffer_of(ctx, r.get("next_buffer_uri", "")),
        pending_batch_uri=tr.get("pending_batch_uri", ""),
        tp_plan=_next_tp_plan(
            ctx,
            state.tp_plan,
            r["round_kind"],
            int(metrics["rollout/preemptions"]),
            _profiled_tp(ctx, prof) if prof else state.tp_plan.initial_tp,
        ),
        timeout_anchors=rw.get("timeout_anchors") or state.timeout_anchors,
        length_history=tuple(list(hist.items())[-LENGTH_HISTORY_MAX:]),
        checkpoint_uri=tr["checkpoint_uri"],
        policy_version=tr["policy_version"],
        profile_uri=prof or state.profile_uri,
        # a fresh profile was measured this step; otherwise how far this step's decode drifted
        profile_drift=0.0 if prof else float(metrics.get("planner/drift", 0.0)),
        trained_samples=state.trained_samples + tr["samples"],
        trained_prompts=state.trained_prompts + len(r["trained"]),
    )
    stages = {"plan": p, "rollout": r, "reward": rw, "judge": jd, "train": tr}
    work = sum(float(s.get("work_s", 0.0)) for s in stages.values())
    # a (re-)profile is one-off work like the arm's start-up: its own metric, not step time
    profile_s = float(ctx.store.get_json(prof_key).get("seconds", 0.0)) if prof else 0.0
    work += profile_s
    groups = {
        "step": step,
        "attempt": p["attempt"],
        "round_kind": r["round_kind"],
        "trained": r["trained"],
        "deferred": r["deferred"],
        "from_queue": r["from_queue"],
    }
    ctx.states.put_blob(step, "groups.json", json.dumps(groups).encode())
    ctx.states.put_blob(
        step, "lengths.json", json.dumps({"round_kind": r["round_kind"], "lengths": r["lengths"]}).encode()
    )
    metrics["pipeline/overhead_s"] = max(0.0, time.time() - p["t_start_wall"] - work)
    wall = time.time() - p["t_start_wall"]
    metrics["step/wall_s"] = wall
    # the RL step itself: without the arm's one-off start-up, profiling and validation
    metrics["step/time_s"] = wall - float(p.get("init_s", 0.0)) - float(tr.get("val_s", 0.0)) - profile_s
    if prof:
        metrics["stage/profile_s"] = profile_s
    for name, st in stages.items():
        metrics[f"stage/{name}_s"] = float(st.get("work_s", 0.0))
    summary = {
        "step": step,
        "attempt": p["attempt"],
        "state_uri": ctx.store.uri(ctx.states.state_key(step)),
        "round_kind": r["round_kind"],
        "metrics": metrics,
    }
    # the commit record first (the next plan repairs MLflow from it), then the state and pointer
    ctx.states.put_blob(step, "commit.json", json.dumps(summary).encode())
    ctx.states.commit(new)
    _fault("commit", step, delay_s=0.0)  # committed, not yet in MLflow: the next plan repairs it
    _log_step(ctx, new, step, metrics, r["round_kind"], r["lengths"])
    _gc_checkpoints(ctx, keep={new.checkpoint_uri, state.checkpoint_uri})
    _gc_batches(ctx, keep={new.pending_batch_uri, state.pending_batch_uri})
    ctx.store.delete_prefix(f"{ctx.prefix}/buffers/")  # copied into the state document
    return CommitOutput(json.dumps(summary), metrics)


def _next_tp_plan(ctx: _Ctx, plan: TPPlan, round_kind: str, preemptions: int, initial_tp: int = 0) -> TPPlan:
    """The TP plan after this step (the rollout service puts each round on its kind's layout)."""
    return _replayed_plan(
        ctx, (*plan.round_kinds, round_kind), (*plan.preemption_history, preemptions), initial_tp
    )


def _replayed_plan(ctx: _Ctx, kinds: tuple[str, ...], history: tuple[int, ...], initial_tp: int) -> TPPlan:
    """The planner's heuristic replayed over the whole history from the profiled best TP
    (``initial_tp``; 0 = ``planner.initial_tp``)."""
    import dataclasses

    from rollpacker.core.planner import replay

    cfg = ctx.cfg.planner
    if initial_tp:
        cfg = dataclasses.replace(cfg, initial_tp=max(cfg.min_tp, min(initial_tp, cfg.max_tp)))
    planned = replay(cfg, zip(kinds, history, strict=True))
    return TPPlan(planned.tp_for("short"), planned.tp_for("long"), history, kinds, initial_tp)


def _with_fresh_profile(ctx: _Ctx, state: ControllerState, attempt: str) -> ControllerState:
    """The state the round runs on: if this attempt just profiled, its profile and the TP plan
    replayed from the profiled best TP (what the commit will record), not the stale ones."""
    import dataclasses

    key = _profile_key(ctx, attempt)
    if not ctx.store.exists(key):
        return state
    uri = ctx.store.uri(key)
    plan = state.tp_plan
    fresh = _replayed_plan(ctx, plan.round_kinds, plan.preemption_history, _profiled_tp(ctx, uri))
    return dataclasses.replace(state, profile_uri=uri, tp_plan=fresh)


def _profiled_tp(ctx: _Ctx, profile_uri: str) -> int:
    """The TP of the profiled best layout for this arm's full short round: every launched
    response of a step decoded from the task's typical prompt to the max response length."""
    from rollpacker.core.latency import Predictor, ProfileTable, best_layout

    doc = ctx.store.get_json(ctx.store.key_of(profile_uri))
    pred = Predictor(ProfileTable.from_dict(doc["table"], profile_uri))
    r = ctx.cfg.rollout
    batch = r.launched_prompts * r.launched_responses
    prompt = round(float(doc.get("prompt_tokens_mean", 64)))
    return best_layout(pred, batch, prompt, r.max_tokens).tp


def _profile_key(ctx: _Ctx, attempt: str) -> str:
    """Where the profile stage of an attempt writes its table (the commit looks there: the profile
    stage is conditional, so its output is not a DAG edge)."""
    return f"{ctx.prefix}/profiles/profile-{attempt}.json"


def _step_metrics(
    r: dict[str, Any], rw: dict[str, Any], jd: dict[str, Any], tr: dict[str, Any]
) -> dict[str, float]:
    m: dict[str, float] = dict(r["metrics"])
    m.update(rw.get("metrics", {}))
    m.update(jd.get("metrics", {}))
    m.update(tr["metrics"])
    n = rw.get("samples", 0) + jd.get("samples", 0)
    if n:
        m["reward/mean"] = (rw.get("reward_sum", 0.0) + jd.get("reward_sum", 0.0)) / n
    m["reward/tail_s"] = max(
        rw.get("metrics", {}).get("reward/tail_s", 0.0), jd.get("metrics", {}).get("judge/tail_s", 0.0)
    )
    m["reward/drain_s"] = float(rw.get("drain_s", 0.0)) + float(jd.get("drain_s", 0.0))
    m["train/samples"] = float(tr["samples"])
    return {k: float(v) for k, v in m.items()}


def _log_step(
    ctx: _Ctx, state: ControllerState, step: int, metrics: dict[str, float], kind: str, lengths: list[int]
) -> None:
    tracker = ctx.tracker()
    run = state.mlflow_run_id
    tracker.log_step(run, step + 1, metrics)
    tracker.log_step_lengths(run, step + 1, kind, lengths)
    tracker.set_state_pointer(run, ctx.store.uri(ctx.states.state_key(state.step)), state.step)
    if state.step == ctx.cfg.steps - 1:
        tracker.finish_arm(run)


def _repair_tracking(ctx: _Ctx, tracker: Any, state: ControllerState) -> None:
    """A commit that died after moving the pointer but before MLflow logged the step: log it now
    from the step's commit record, so MLflow never misses a committed step."""
    pointer = tracker.state_pointer(state.mlflow_run_id)
    for step in range((pointer[1] if pointer is not None else -1) + 1, state.step + 1):
        try:
            rec = json.loads(ctx.states.get_blob(step, "commit.json"))
            lens = json.loads(ctx.states.get_blob(step, "lengths.json"))
        except RollpackerError:
            continue
        st = ctx.states.load(step)
        _log_step(ctx, st, step, rec["metrics"], lens["round_kind"], lens["lengths"])


def _init_state(ctx: _Ctx, tracker: Any) -> ControllerState:
    """Step -1: the warmed-up base model uploaded to the store, the cursor at the start."""
    from rollpacker.loop.runner import prepare_model
    from rollpacker.tracking import flatten_params

    cfg = ctx.cfg
    base = prepare_model(cfg, quiet=True)
    uri = ctx.store.upload_dir(base, ctx.base_key())
    run_id = tracker.arm_run(ctx.arm, flatten_params(cfg))
    state = ControllerState(
        experiment=cfg.experiment,
        arm=ctx.arm,
        step=-1,
        cursor_seed=cfg.seed,
        cursor_epoch=0,
        cursor_position=0,
        checkpoint_uri=uri,
        policy_version=0,
        tp_plan=TPPlan(cfg.planner.initial_tp, cfg.planner.initial_tp),
        seed=cfg.seed,
        mlflow_run_id=run_id,
    )
    ctx.states.init(state)
    return state


def _gc_checkpoints(ctx: _Ctx, keep: set[str]) -> None:
    """Delete step checkpoints no committed state of the last two steps points to (failed attempts
    and older steps); the base model stays."""
    prefix = f"{ctx.prefix}/ckpt/"
    keep_keys = {ctx.store.key_of(u).rstrip("/") for u in keep if u}
    dirs = {k[len(prefix) :].split("/", 1)[0] for k in ctx.store.list(prefix)}
    for d in sorted(dirs):
        key = f"{prefix}{d}"
        if d == "base" or key in keep_keys:
            continue
        ctx.store.delete_prefix(key + "/")


def _buffer_of(ctx: _Ctx, uri: str) -> tuple[dict[str, Any], ...]:
    """The rollout buffer the rollout service stored for this attempt (empty without one)."""
    if not uri:
        return ()
    doc = ctx.store.get_json(ctx.store.key_of(uri))
    if not isinstance(doc, dict) or not isinstance(doc.get("entries"), list):
        raise StateError(f"{uri}: not a rollout buffer written by the rollout service")
    return tuple(doc["entries"])


def _gc_batches(ctx: _Ctx, keep: set[str]) -> None:
    """Delete one-off pending batches that neither of the last two committed states points to."""
    prefix = f"{ctx.prefix}/batches/"
    keep_dirs = {ctx.store.key_of(u).rsplit("/", 1)[0] for u in keep if u}
    dirs = {k[len(prefix) :].split("/", 1)[0] for k in ctx.store.list(prefix)}
    for d in sorted(dirs):
        if f"{prefix}{d}" not in keep_dirs:
            ctx.store.delete_prefix(f"{prefix}{d}/")


def run_step_inline(config: str, arm: str) -> CommitOutput:
    """One RL step, every stage in this process (``rollpacker run --runner inline``)."""
    po = plan(config, arm)
    if po.skip:
        return commit(config, po.plan, "{}", "{}", "{}", "{}")
    pl = po.plan
    if po.need_profile:
        profile(config, pl)
    ro = rollout(config, pl)
    rw = reward(config, pl, ro)
    jd = judge(config, pl, ro)
    tr = train(config, pl, ro, rw, jd)
    return commit(config, pl, ro, rw, jd, tr)
