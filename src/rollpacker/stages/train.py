"""training: the stream trainer's one deferred update (begun when the round ended), the
checkpoint, the weight push into the engine; validation when it is due."""

from __future__ import annotations

import time

from rollpacker.stages import hooks
from rollpacker.stages.context import StageContext
from rollpacker.stages.messages import Clock, PlanOutput, RolloutOutput, TrainOutput, span


def train(ctx: StageContext, plan: PlanOutput, rollout: RolloutOutput) -> TrainOutput:
    clock = Clock()
    ctx.state_for(plan)
    step, cfg = plan.step, ctx.cfg
    got = ctx.services.trainer().collect(rollout.update)
    report, t0, t1 = got.value, got.start_wall, time.time()
    hooks.at("train", step)  # the nastiest point: trainer and engine ahead of the state
    validation, val_s = None, 0.0
    if (step + 1) % cfg.validation.every == 0 or step == cfg.steps - 1:
        t_val = time.perf_counter()
        validation = ctx.services.rollout().validate(step + 1, plan.attempt)
        val_s = time.perf_counter() - t_val
    return TrainOutput(report, validation, val_s, clock.timing(), update_span=span(t0, t1))
