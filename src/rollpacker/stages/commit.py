"""controller.commit: the new state, atomically, and the step in MLflow.

Invariants:
- the step's records go first (groups log, lengths, commit record), then the state document,
  then the pointer; a step dies before the pointer moves, or is committed whole;
- garbage (checkpoints and batches neither the new state nor the one before points to) is
  collected before the records: a commit that dies after it leaves both states' files in place;
- the store keeps the last ``checkpoint.keep`` committed step checkpoints (and the start model):
  older ones go before the records, the previous state's once the pointer has moved past it (when
  ``keep`` is 1); the checkpoint the committed state points at is never deleted;
- a commit whose step is already committed by the same attempt returns what was committed
  (idempotent); one of another attempt is refused as stale;
"""

from __future__ import annotations

from rollpacker.core.errors import RollpackerError
from rollpacker.core.state import ControllerState
from rollpacker.services.api import CommittedStep
from rollpacker.stages import hooks
from rollpacker.stages.context import StageContext
from rollpacker.stages.messages import (
    Clock,
    CommitOutput,
    CommitRecord,
    DrainOutput,
    GroupsLog,
    LengthsLog,
    PlanOutput,
    RolloutOutput,
    Timing,
    TrainOutput,
)
from rollpacker.stages.successor import step_metrics, successor


def commit(
    ctx: StageContext, plan: PlanOutput, ro: RolloutOutput, rw: DrainOutput, jd: DrainOutput, tr: TrainOutput
) -> CommitOutput:
    clock = Clock()
    latest = ctx.states.latest()
    done = _already_committed(ctx, plan, latest)
    if done is not None:
        return done
    state = ctx.state_for(plan, latest)
    r, step = ro.round, plan.step
    prof_key = ctx.profile_key(plan.attempt)
    prof = ctx.store.uri(prof_key) if ctx.store.exists(prof_key) else ""
    metrics = step_metrics(r, rw.report, jd.report, tr.report)
    new = successor(ctx, state, r, rw.report, tr.report, prof)
    # a (re-)profile is one-off work like the arm's start-up: its own metric, not step time
    profile_s = float(ctx.store.get_json(prof_key).get("seconds", 0.0)) if prof else 0.0
    metrics.update(_time_metrics(plan, ro, rw, jd, tr, profile_s))
    # what neither this state nor the one before points to (safe before the commit: both kept)
    _collect_garbage(ctx, new, state)
    # the step's wall clock ends here: what is left is a few store writes and one MLflow call
    metrics.update(_wall_metrics(plan, ro, rw, jd, tr, profile_s, clock.timing()))
    groups = GroupsLog(
        step, plan.attempt, r.round_kind, r.trained, r.deferred, r.from_queue, r.dropped, r.extra
    )
    lengths = LengthsLog(r.round_kind, r.lengths)
    ctx.states.put_blob(step, "groups.json", groups.to_json().encode())
    ctx.states.put_blob(step, "lengths.json", lengths.to_json().encode())
    record = CommitRecord(
        step, plan.attempt, ctx.store.uri(ctx.states.state_key(step)), r.round_kind, metrics
    )
    # the commit record first (the next plan repairs MLflow from it), then the state and pointer
    ctx.states.put_blob(step, "commit.json", record.to_json().encode())
    ctx.states.commit(new)
    _drop_superseded(ctx, new, state)  # keep = 1: the previous checkpoint, now that nothing points at it
    hooks.at("commit", step)  # committed, not yet in MLflow: the next plan repairs it
    # this step and any MLflow missed before (it was down), in order, from the commit records
    ctx.tracking_optional(f"logging step {step} to MLflow", lambda: repair_tracking(ctx, new))
    return CommitOutput(step, plan.attempt, False, record.state_uri, r.round_kind, metrics)


def _already_committed(
    ctx: StageContext, plan: PlanOutput, latest: ControllerState | None
) -> CommitOutput | None:
    """This very commit ran before and died after moving the pointer: what it committed."""
    if latest is None or latest.step != plan.step:
        return None
    rec = CommitRecord.from_json(ctx.states.get_blob(plan.step, "commit.json").decode())
    if rec.attempt != plan.attempt:
        return None  # another attempt committed: state_for refuses this stale plan
    return CommitOutput(rec.step, rec.attempt, False, rec.state_uri, rec.round_kind, rec.metrics)


def _time_metrics(
    plan: PlanOutput, ro: RolloutOutput, rw: DrainOutput, jd: DrainOutput, tr: TrainOutput, profile_s: float
) -> dict[str, float]:
    """Seconds per stage (each stage function's own work) and the validation's metrics."""
    stages = {
        "plan": plan.timing,
        "rollout": ro.timing,
        "reward": rw.timing,
        "judge": jd.timing,
        "train": tr.timing,
    }
    m = {f"stage/{name}_s": t.work_s for name, t in stages.items()}
    if profile_s:
        m["stage/profile_s"] = profile_s
    if tr.validation is not None:
        m.update(tr.validation.metrics())
    return m


def busy_seconds(spans: list[tuple[float, float]]) -> float:
    """The length of the union of wall-clock intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _wall_metrics(
    plan: PlanOutput,
    ro: RolloutOutput,
    rw: DrainOutput,
    jd: DrainOutput,
    tr: TrainOutput,
    profile_s: float,
    commit: Timing,
) -> dict[str, float]:
    """The step's wall clock, from the start of its plan task's process (KFP) or of its plan stage
    (in one process) to its commit record, and the pipeline's own overhead: the time in it when
    neither a stage nor a service worked on the step (process starts, imports, connections, the
    orchestrator; docs/pipeline.md). The round and the update run inside services, partly while
    the next KFP task starts: their spans count as work."""
    wall = commit.end_wall - plan.timing.start_wall
    work = [
        (t.end_wall - t.work_s, t.end_wall)
        for t in (plan.timing, ro.timing, rw.timing, jd.timing, tr.timing, commit)
    ]
    work += [(t.start_wall, t.end_wall) for t in (ro.round_span, tr.update_span)]
    busy = busy_seconds(work) + profile_s  # the profile stage's own span is not passed on
    return {
        "stage/commit_s": commit.work_s,
        "pipeline/overhead_s": max(0.0, wall - busy),
        "step/wall_s": wall,
        # the RL step itself: without the arm's one-off start-up, profiling and validation
        "step/time_s": wall - plan.init_s - tr.val_s - profile_s,
    }


def log_step(
    ctx: StageContext, state: ControllerState, step: int, metrics: dict[str, float], lengths: LengthsLog
) -> None:
    """The committed step in MLflow: metrics, lengths, the state pointer; the arm's plots at its end."""
    ctx.tracker.log_committed(
        CommittedStep(
            state.mlflow_run_id,
            step + 1,
            metrics,
            lengths.round_kind,
            tuple(lengths.lengths),
            ctx.store.uri(ctx.states.state_key(state.step)),
            state.step,
            last=state.step == ctx.cfg.steps - 1,
        )
    )


def _collect_garbage(ctx: StageContext, new: ControllerState, old: ControllerState) -> None:
    """Step checkpoints neither retained (``checkpoint.keep``) nor committed, and one-off batches
    neither of the last two states points to (failed attempts, older steps) are deleted, except
    those of the state a step between checkpoints rolls back to; the base model stays; the buffer
    is in the state now."""
    back = new.rollback_step
    kept = (new, old) if back is None else (new, old, ctx.states.load(back))
    ck = f"{ctx.prefix}/ckpt/"
    keep = retained_checkpoints(ctx, new, old) | _keys(ctx, old.checkpoint_uri)  # old: still committed
    for d in _dirs(ctx, ck):
        if not d.startswith("base") and f"{ck}{d}" not in keep:
            ctx.store.delete_prefix(f"{ck}{d}/")
    batches = f"{ctx.prefix}/batches/"
    keep = {ctx.store.key_of(u).rsplit("/", 1)[0] for u in (s.pending_batch_uri for s in kept) if u}
    for d in _dirs(ctx, batches):
        if f"{batches}{d}" not in keep:
            ctx.store.delete_prefix(f"{batches}{d}/")
    ctx.store.delete_prefix(f"{ctx.prefix}/buffers/")


def retained_checkpoints(ctx: StageContext, new: ControllerState, old: ControllerState) -> set[str]:
    """The keys (no trailing ``/``) of the newest ``checkpoint.keep`` distinct step checkpoints in the
    store that the committed chain points at, ``new`` first; earlier states are read only when
    needed. A step between checkpoints (``checkpoint.every``: its weights only in the trainer and
    the engine) stores none and does not count, so the checkpoint it rolls back to is always kept."""
    keep, base = ctx.cfg.checkpoint.keep, f"{ctx.prefix}/ckpt/base"
    out: list[str] = []
    states = iter((new, old))
    step = old.step - 1
    while len(out) < keep:
        state = next(states, None)
        if state is None:
            if step < 0:
                break
            state, step = ctx.states.load(step), step - 1
        if state.rollback_step is not None:
            continue  # nothing stored for it
        for key in _keys(ctx, state.checkpoint_uri):
            if not key.startswith(base) and key not in out:
                out.append(key)
    return set(out)


def _drop_superseded(ctx: StageContext, new: ControllerState, old: ControllerState) -> None:
    """After the pointer moved to ``new``: the previous checkpoint, if ``keep`` leaves it out."""
    for key in _keys(ctx, old.checkpoint_uri) - retained_checkpoints(ctx, new, old):
        if not key.startswith(f"{ctx.prefix}/ckpt/base"):
            ctx.store.delete_prefix(f"{key}/")


def _keys(ctx: StageContext, uri: str) -> set[str]:
    return {ctx.store.key_of(uri).rstrip("/")} if uri else set()


def _dirs(ctx: StageContext, prefix: str) -> list[str]:
    return sorted({k[len(prefix) :].split("/", 1)[0] for k in ctx.store.list(prefix)})


def repair_tracking(ctx: StageContext, state: ControllerState) -> None:
    """Log to MLflow every committed step it misses, up to ``state``'s, in order, from the steps'
    commit records (MLflow's state pointer says how far it got): the step just committed, and any
    step whose logging failed before (MLflow down, or a commit that died after moving the pointer)."""
    pointer = ctx.tracker.state_pointer(state.mlflow_run_id)
    logged = pointer[1] if pointer is not None else -1
    # MLflow ahead of the state: the arm rolled back (checkpoint.every); the re-run step replaces
    # the lost one's values (a metric's newest value per step counts)
    first = logged + 1 if logged <= state.step else state.step
    for step in range(first, state.step + 1):
        try:
            rec = CommitRecord.from_json(ctx.states.get_blob(step, "commit.json").decode())
            lens = LengthsLog.from_json(ctx.states.get_blob(step, "lengths.json").decode())
        except RollpackerError:
            continue
        log_step(ctx, ctx.states.load(step), step, rec.metrics, lens)
