"""Controller states for the store tests: an arm's initial state and the states after it."""

from __future__ import annotations

from rollpacker.core.state import ControllerState, TPPlan
from rollpacker.store.state_store import StateStore


def initial(ss: StateStore) -> ControllerState:
    return ControllerState(
        experiment=ss.experiment,
        arm=ss.arm,
        step=-1,
        cursor_seed=7,
        cursor_epoch=0,
        cursor_position=0,
        seed=7,
    )


def advance(s: ControllerState) -> ControllerState:
    """The state after one more step (what the controller would commit)."""
    return s.successor(
        cursor_position=s.cursor_position + 4,
        long_queue=(*s.long_queue, f"p{s.step + 1}"),
        tp_plan=TPPlan(
            short_tp=1,
            long_tp=2,
            preemption_history=(*s.tp_plan.preemption_history, s.step + 1),
            round_kinds=(*s.tp_plan.round_kinds, "short"),
        ),
        checkpoint_uri=f"s3://bucket/x/ckpt/step-{s.step + 1:06d}/",
        policy_version=s.policy_version + 1,
    )


def chain(ss: StateStore, steps: int) -> list[ControllerState]:
    """``init`` of the initial state, then ``steps`` commits; returns every state, oldest first."""
    out = [initial(ss)]
    ss.init(out[0])
    for _ in range(steps):
        out.append(advance(out[-1]))
        ss.commit(out[-1])
    return out
