"""rollout: the step's round on the rollout service. Rewards and gradients start inside the
services as responses and groups finish, so the later stages mostly drain.

The round usually begins in the plan stage (``begin_round``: no profile is due; its ticket is in
``plan.started``), so this task's process start-up overlaps it; the stage then collects the round,
and at its end begins the trainer's one update (``begin_update``; its ticket is in the output),
which the training stage collects: the reward and judge tasks start while the update runs
(docs/pipeline.md, "Overhead").
"""

from __future__ import annotations

from rollpacker.core.state import ControllerState
from rollpacker.stages import hooks
from rollpacker.stages.context import StageContext
from rollpacker.stages.messages import Clock, PlanOutput, RolloutOutput, RoundStart, span
from rollpacker.stages.successor import with_fresh_profile


def begin_round(ctx: StageContext, plan: PlanOutput, state: ControllerState) -> RoundStart:
    """Begin the attempt on the trainer and the reward services, and begin its round."""
    trainer = ctx.services.trainer().begin(plan.attempt, state, plan.base_uri)
    rewards = {
        role: ctx.services.reward(role).begin(plan.attempt, state.timeout_anchors)
        for role in plan.round.roles
    }
    fresh = with_fresh_profile(ctx, state, plan.attempt)
    return RoundStart(trainer, rewards, ctx.services.rollout().begin_round(fresh, plan.step, plan.attempt))


def rollout(ctx: StageContext, plan: PlanOutput) -> RolloutOutput:
    clock = Clock()
    state = ctx.state_for(plan)
    started = plan.started or begin_round(ctx, plan, state)
    hooks.at("rollout", plan.step, delay_s=1.0)
    got = ctx.services.rollout().collect(started.round)
    report = got.value
    # the update waits for the step's last rewarded groups itself; the training stage collects it
    update = ctx.services.trainer().begin_update(
        plan.attempt,
        plan.step,
        report.trained,
        ctx.checkpoint_key(plan.step, plan.attempt),
        ctx.batch_key(plan.step, plan.attempt),
    )
    return RolloutOutput(
        report,
        started.trainer,
        started.rewards,
        clock.timing(),
        round_span=span(got.start_wall, report.end_wall),
        update=update,
    )
