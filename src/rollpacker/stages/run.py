"""One RL step, every stage in this process: the whole step on one screen.

The step is not sequential: two pieces of work run ahead of the stage that waits for them. A
service's ``begin_*`` starts one and returns a typed ticket (``Pending[...]``, in the stage's
message); the stage that needs the result hands the ticket to the service's ``collect``:

- the round: begun by ``plan`` (``p.started.round``; by ``rollout`` when a profile came first),
  collected by ``rollout``;
- the update: begun by ``rollout`` as the round ends (``ro.update``), collected by ``train``, so the
  drains run while the trainer steps.

During the round the services overlap the rest of the step: each finished response is scored at
once (reward scheduler) and each rewarded group's gradient is computed at once (stream trainer);
the drains and ``train`` only finish.
"""

from __future__ import annotations

from rollpacker.core.types import Role
from rollpacker.stages.commit import commit
from rollpacker.stages.context import StageContext
from rollpacker.stages.drain import drain
from rollpacker.stages.messages import ArmDone, CommitOutput
from rollpacker.stages.plan import plan
from rollpacker.stages.profile import profile
from rollpacker.stages.rollout import rollout
from rollpacker.stages.train import train


def run_step(ctx: StageContext) -> CommitOutput:
    p = plan(ctx)  # state loaded, engine synced, round planned; BEGINS the round -> p.started.round
    if isinstance(p, ArmDone):  # every step of the arm is committed (the DAG gates here too)
        return CommitOutput(p.step, p.attempt, skipped=True)
    if p.need_profile:
        profile(ctx, p)  # the planner's latency table, written to the store (the round waits for it)
    ro = rollout(ctx, p)  # AWAITS the round (begins it after a profile); BEGINS the update -> ro.update
    rw = drain(ctx, Role.REWARD, p, ro)  # rule and sandbox rewards finished (the update runs meanwhile)
    jd = drain(ctx, Role.JUDGE, p, ro)  # judge rewards finished
    tr = train(ctx, p, ro)  # AWAITS ro.update: the one deferred update, checkpoint, weights into the engine
    return commit(ctx, p, ro, rw, jd, tr)  # the successor state, atomically; MLflow
