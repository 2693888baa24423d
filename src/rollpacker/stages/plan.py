"""controller.plan: load (or create) the arm's committed state, bring the services to it, plan.

Invariants:
- ``plan`` refuses to start when the store, MLflow or the services are unreachable, naming the
  setting to fix (nothing is half-done);
- a commit that died between its state document and the pointer is finished first (``recover``),
  and one that died before MLflow logged it is logged now (MLflow never misses a committed step);
- the arm's first plan creates step -1: the start model (put in the store by the model preparation
  before the step, never trained here), the cursor at the start, the
  arm's MLflow run, and the validation before any RL (logged at step 0);
- a dataset file (``task.name``) is in the store before any service reads it: the services' pods
  see only the store (``tasks.dataset_store``);
- a committed step between checkpoints (``checkpoint.every``) whose weights the trainer or the
  engine no longer holds is never trained on: the arm rolls back to the last step with a stored
  checkpoint (``StateStore.rewind``), and the steps after it, their prompts included, run again,
  so every prompt is trained exactly once relative to the weights that survived.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
import uuid

from rollpacker.core.errors import RollpackerError
from rollpacker.core.state import ControllerState, TPPlan
from rollpacker.stages import hooks
from rollpacker.stages.commit import repair_tracking
from rollpacker.stages.context import StageContext
from rollpacker.stages.messages import ArmDone, Clock, PlanOutput
from rollpacker.stages.rollout import begin_round
from rollpacker.tasks.dataset_store import publish
from rollpacker.tasks.models import PREPARED_MARKER
from rollpacker.tracking import flatten_params

log = logging.getLogger(__name__)


def plan(ctx: StageContext) -> PlanOutput | ArmDone:
    """The next step of the arm: its round, whether to (re-)profile, the engine synced; ``ArmDone``
    when every step of the arm is committed (nothing else runs: the DAG gates on it)."""
    clock = Clock(ctx.process_start)  # a step's wall clock starts with its plan task's process
    ctx.store.check()
    state = ctx.states.recover()  # finishes a commit that died between its document and the pointer
    publish(ctx.store, ctx.cfg.task.name, ctx.cfg.experiment, ctx.arm)  # once per arm; then a lookup
    t_init = time.perf_counter()
    if state is None:
        ctx.tracker.check()  # an arm starts only with MLflow up: its run holds the comparison
        state = _init_state(ctx)
    else:  # the state is the truth: a step goes on without MLflow, and logs what it missed later
        state = _roll_back_if_lost(ctx, state)
        ctx.tracking_optional("logging the steps MLflow missed", lambda: _check_and_repair(ctx, state))
    step = state.next_step
    attempt = uuid.uuid4().hex[:12]
    if step >= ctx.cfg.steps:
        return ArmDone(
            ctx.cfg.experiment, ctx.arm, step, state.step, attempt, state.mlflow_run_id, clock.timing()
        )
    rollout = ctx.services.rollout()
    sync = rollout.sync(state)
    hooks.at("plan", step)  # the engine is synced; its round (or profiling) is about to start
    round_plan = rollout.plan(state, step)
    # no profile yet, or the last step's decode time drifted from its prediction
    margin = ctx.cfg.planner.reprofile_margin
    need_profile = not state.profile_uri or state.profile_drift > margin
    reprofile = f"drift {state.profile_drift:.2f} > {margin}" if state.profile_uri and need_profile else ""
    val0 = None
    if state.step == -1:  # the starting point of the validation curve
        val0 = rollout.validate(0, attempt)
        ctx.tracker.log_step(state.mlflow_run_id, 0, val0.metrics())
    planned = PlanOutput(
        experiment=ctx.cfg.experiment,
        arm=ctx.arm,
        step=step,
        state_step=state.step,
        attempt=attempt,
        base_uri=ctx.store.uri(ctx.base_key()),
        run_id=state.mlflow_run_id,
        timing=clock.timing(),
        sync=sync,
        round=round_plan,
        need_profile=need_profile,
        reprofile=reprofile,
        val0=val0,
        # one-off work of an arm's first step (warm-up, engine start, first validation): not step time
        init_s=time.perf_counter() - t_init if state.step == -1 else 0.0,
    )
    # no profile due: the round starts now, while the rollout task's process starts up
    started = None if need_profile else begin_round(ctx, planned, state)
    return dataclasses.replace(planned, started=started, timing=clock.timing())


def _init_state(ctx: StageContext) -> ControllerState:
    """Step -1: the start model the model preparation put in the store (``tasks.prepare``, before
    the arm's first step: the runner or the pipeline's ``prepare-model`` task), the cursor at the start."""
    cfg = ctx.cfg
    key = ctx.base_key()
    if not ctx.store.exists(key + PREPARED_MARKER):
        raise RollpackerError(
            f"[{ctx.arm}] the start model is not in the store ({ctx.store.uri(key)}): the model preparation "
            "puts it there before the arm's first step (`rollpacker run` / `rollpacker train` do it, so does "
            "the pipeline's prepare-model task)"
        )
    uri = ctx.store.uri(key)
    run_id = ctx.tracker.arm_run(ctx.arm, flatten_params(cfg))
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


def _roll_back_if_lost(ctx: StageContext, state: ControllerState) -> ControllerState:
    """``state``, or, when it is a step between checkpoints whose weights the trainer or the
    engine lost (a crash, a rebuilt service, an update that ran ahead), the state of the last step
    whose checkpoint is stored: the chain is rewound to it and the lost steps run again."""
    back = state.rollback_step
    if back is None:
        return state
    uri = state.checkpoint_uri
    if ctx.services.trainer().holds(uri) and ctx.services.rollout().holds(uri):
        return state
    lost = f"step {state.step}" if back == state.step - 1 else f"steps {back + 1}..{state.step}"
    msg = (
        f"[{ctx.arm}] the weights {lost} trained are in no store (checkpoint.every = "
        f"{ctx.cfg.checkpoint.every}) and a service lost them: rolling back to step {back}'s checkpoint; "
        f"{lost} {'runs' if back == state.step - 1 else 'run'} again"
    )
    log.warning(msg)
    print(msg, file=sys.stderr, flush=True)
    return ctx.states.rewind(back)


def _check_and_repair(ctx: StageContext, state: ControllerState) -> None:
    ctx.tracker.check()
    repair_tracking(ctx, state)
