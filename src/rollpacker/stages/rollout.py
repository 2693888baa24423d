"""rollout: run the step's round on the rollout service. Rewards and gradients start inside the
services as responses and groups finish, so the later stages mostly drain."""

from __future__ import annotations

from rollpacker.stages import hooks
from rollpacker.stages.context import StageContext
from rollpacker.stages.messages import Clock, RolloutOutput, StepPlan
from rollpacker.stages.successor import with_fresh_profile


def rollout(ctx: StageContext, plan: StepPlan) -> RolloutOutput:
    clock = Clock()
    if plan.skip or plan.round is None:
        return RolloutOutput(None, None, {}, clock.timing())
    state = ctx.state_for(plan)
    trainer = ctx.services.trainer().begin(plan.attempt, state, plan.base_uri)
    rewards = {
        role: ctx.services.reward(role).begin(plan.attempt, state.timeout_anchors)
        for role in plan.round.roles
    }
    hooks.at("rollout", plan.step, delay_s=1.0)
    fresh = with_fresh_profile(ctx, state, plan.attempt)
    report = ctx.services.rollout().run_round(fresh, plan.step, plan.attempt)
    return RolloutOutput(report, trainer, rewards, clock.timing())
