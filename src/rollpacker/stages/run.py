"""One RL step, every stage in this process: the whole step on one screen.

The synchronization points are the stage boundaries. During ``rollout`` the services overlap the
rest of the step: each finished response is scored at once (reward scheduler) and each rewarded
group's gradient is computed at once (stream trainer); the drains and ``train`` only finish.
"""

from __future__ import annotations

from rollpacker.core.types import Role
from rollpacker.stages.commit import commit
from rollpacker.stages.context import StageContext
from rollpacker.stages.drain import drain
from rollpacker.stages.messages import CommitOutput
from rollpacker.stages.plan import plan
from rollpacker.stages.profile import profile
from rollpacker.stages.rollout import rollout
from rollpacker.stages.train import train


def run_step(ctx: StageContext) -> CommitOutput:
    p = plan(ctx)  # state loaded, engine synced to its weights, round planned
    if p.need_profile:
        profile(ctx, p)  # the planner's latency table, written to the store
    ro = rollout(ctx, p)  # the round; rewards and gradients start inside the services
    rw = drain(ctx, Role.REWARD, p, ro)  # rule and sandbox rewards finished
    jd = drain(ctx, Role.JUDGE, p, ro)  # judge rewards finished
    tr = train(ctx, p, ro)  # the one deferred update, checkpoint, weights into the engine
    return commit(ctx, p, ro, rw, jd, tr)  # the successor state, atomically; MLflow
