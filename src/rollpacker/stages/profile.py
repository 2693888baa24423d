"""profiling: measure the engine (decode step latency by batch size and context) into a profile
table in the store; only when the plan asks (no profile yet, or the last step drifted)."""

from __future__ import annotations

from rollpacker.stages.context import StageContext
from rollpacker.stages.messages import Clock, PlanOutput, ProfileOutput


def profile(ctx: StageContext, plan: PlanOutput) -> ProfileOutput:
    clock = Clock()
    key = ctx.profile_key(plan.attempt)
    summary = ctx.services.rollout().profile(key)
    if plan.run_id:
        doc = ctx.store.get_json(key)
        ctx.tracking_optional(
            "logging the profile",
            lambda: ctx.tracker.log_profile(plan.run_id, plan.step + 1, summary.uri, doc),
        )
    return ProfileOutput(summary, clock.timing())
