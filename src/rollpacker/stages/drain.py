"""sandbox-reward and judge: drain the step's rewards of one reward service (most were scored
during rollout) and report them."""

from __future__ import annotations

from rollpacker.core.types import Role
from rollpacker.stages import hooks
from rollpacker.stages.context import StageContext
from rollpacker.stages.messages import Clock, DrainOutput, PlanOutput, RolloutOutput


def drain(ctx: StageContext, role: Role, plan: PlanOutput, rollout: RolloutOutput) -> DrainOutput:
    """``role``: ``Role.REWARD`` (rule and sandbox rewards) or ``Role.JUDGE``."""
    clock = Clock()
    if role not in plan.round.roles:  # the task needs no service of this role
        return DrainOutput(None, clock.timing())
    r = rollout.round
    ctx.state_for(plan)
    hooks.at(role, plan.step)
    report = ctx.services.reward(role).drain(plan.attempt, r.groups_by_role.get(role, ()), r.end_wall)
    return DrainOutput(report, clock.timing())
