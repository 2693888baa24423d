"""The state after a step: its successor from the step's reports, and the step's metrics.

Invariants:
- the TP plan after a step is the planner's replay over the whole (round kind, preemptions)
  history from the profiled best TP, never an incremental edit (a re-run step gets the same plan);
- the successor holds everything the next step needs: cursor, queue, rollout buffer, pending
  batch, TP plan, timeout anchors, length history, checkpoint, profile, trained counts.
"""

from __future__ import annotations

import dataclasses

from rollpacker.core.latency import Predictor, ProfileTable, best_layout
from rollpacker.core.planner import replay
from rollpacker.core.policies.entries import BufferEntry, buffer_from_json
from rollpacker.core.state import ControllerState, TPPlan
from rollpacker.core.types import RoundKind
from rollpacker.services.api import DrainReport, RoundReport, TrainReport
from rollpacker.stages.context import StageContext

LENGTH_HISTORY_MAX = 20_000  # (prompt, longest response) pairs kept in the state


def successor(
    ctx: StageContext,
    state: ControllerState,
    r: RoundReport,
    anchors_from: DrainReport | None,
    tr: TrainReport,
    profile_uri: str,
) -> ControllerState:
    """``state`` after the step: ``profile_uri`` is the profile measured in it ("" = none)."""
    hist = dict(state.length_history)
    hist.update(r.longest)
    initial_tp = profiled_tp(ctx, profile_uri) if profile_uri else state.tp_plan.initial_tp
    return state.successor(
        cursor_seed=r.next_cursor.seed,
        cursor_epoch=r.next_cursor.epoch,
        cursor_position=r.next_cursor.position,
        long_queue=r.next_queue,
        partial_cache=buffer_of(ctx, r.next_buffer_uri),
        pending_batch_uri=tr.pending_batch_uri,
        tp_plan=replayed_plan(
            ctx,
            (*state.tp_plan.round_kinds, r.round_kind),
            (*state.tp_plan.preemption_history, r.preemptions),
            initial_tp,
        ),
        timeout_anchors=anchors_from.timeout_anchors if anchors_from else state.timeout_anchors,
        length_history=tuple(list(hist.items())[-LENGTH_HISTORY_MAX:]),
        checkpoint_uri=tr.checkpoint_uri,
        rollback_step=rollback_step(state, tr),
        policy_version=tr.policy_version,
        profile_uri=profile_uri or state.profile_uri,
        # a fresh profile was measured this step; otherwise how far this step's decode drifted
        profile_drift=0.0 if profile_uri else r.decode_drift,
        trained_samples=state.trained_samples + tr.samples,
        trained_prompts=state.trained_prompts + len(r.trained),
    )


def rollback_step(state: ControllerState, tr: TrainReport) -> int | None:
    """The step a run that loses this step's weights rolls back to: None when they are stored,
    else the last step whose checkpoint is (``checkpoint.every``)."""
    if tr.checkpoint_uri == state.checkpoint_uri:  # no update (one-off's first step): as before
        return state.rollback_step
    if tr.stored:
        return None
    return state.step if state.rollback_step is None else state.rollback_step


def replayed_plan(
    ctx: StageContext, kinds: tuple[RoundKind, ...], history: tuple[int, ...], initial_tp: int
) -> TPPlan:
    """The planner's heuristic replayed over the whole history from the profiled best TP
    (``initial_tp``; 0 = ``planner.initial_tp``)."""
    cfg = ctx.cfg.planner
    if initial_tp:
        cfg = dataclasses.replace(cfg, initial_tp=max(cfg.min_tp, min(initial_tp, cfg.max_tp)))
    planned = replay(cfg, zip(kinds, history, strict=True))
    return TPPlan(planned.tp_for(RoundKind.SHORT), planned.tp_for(RoundKind.LONG), history, kinds, initial_tp)


def with_fresh_profile(ctx: StageContext, state: ControllerState, attempt: str) -> ControllerState:
    """The state the round runs on: if this attempt just profiled, its profile and the TP plan
    replayed from the profiled best TP (what the commit will record), not the stale ones."""
    key = ctx.profile_key(attempt)
    if not ctx.store.exists(key):
        return state
    uri = ctx.store.uri(key)
    plan = state.tp_plan
    fresh = replayed_plan(ctx, plan.round_kinds, plan.preemption_history, profiled_tp(ctx, uri))
    return dataclasses.replace(state, profile_uri=uri, tp_plan=fresh)


def profiled_tp(ctx: StageContext, profile_uri: str) -> int:
    """The TP of the profiled best layout for this arm's full short round: every launched
    response of a step decoded from the task's typical prompt to the max response length."""
    doc = ctx.store.get_json(ctx.store.key_of(profile_uri))
    pred = Predictor(ProfileTable.from_dict(doc["table"], profile_uri))
    r = ctx.cfg.rollout
    batch = r.launched_prompts * r.launched_responses
    prompt = round(float(doc.get("prompt_tokens_mean", 64)))
    return best_layout(pred, batch, prompt, r.max_tokens).tp


def buffer_of(ctx: StageContext, uri: str) -> tuple[BufferEntry, ...]:
    """The rollout buffer the rollout service stored for this attempt (empty without one)."""
    if not uri:
        return ()
    return buffer_from_json(ctx.store.get_bytes(ctx.store.key_of(uri)).decode(), uri)


def step_metrics(
    r: RoundReport, rw: DrainReport | None, jd: DrainReport | None, tr: TrainReport
) -> dict[str, float]:
    """The step's metrics from every stage's report (``stage/metric_unit`` names)."""
    m: dict[str, float] = dict(r.metrics)
    drains = [d for d in (rw, jd) if d is not None]
    for d in drains:
        m.update(d.metrics)
    m.update(tr.metrics)
    n = sum(d.samples for d in drains)
    if n:
        m["reward/mean"] = sum(d.reward_sum for d in drains) / n
    m["reward/tail_s"] = max((d.tail_s for d in drains), default=0.0)
    m["reward/drain_s"] = sum(d.drain_s for d in drains)
    m["train/samples"] = float(tr.samples)
    return {k: float(v) for k, v in m.items()}
