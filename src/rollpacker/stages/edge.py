"""The stages as the KFP components call them: JSON text in, JSON text out.

This is the only place where a stage's messages become text: each function reads its inputs with
the messages' strict ``from_json`` and returns ``to_json``. The services run as Ray actors
(``$ROLLPACKER_SERVICES=inline`` keeps them in the task's process, for debugging).

Each function is one KFP task, a fresh process: it joins Ray once, and leaves it explicitly before
returning (leaving through Ray's own exit hook took 0.92 s of every task, an explicit
``ray.shutdown()`` and exit 0.41 s: ``rollpacker lab bench overhead``). Nothing
here imports MLflow, torch or vLLM (docs/pipeline.md has the per-task breakdown).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import NamedTuple

from rollpacker.core.types import Role, ServicesMode, parse_enum
from rollpacker.stages import commit as commit_stage
from rollpacker.stages import drain as drain_stage
from rollpacker.stages import plan as plan_stage
from rollpacker.stages import profile as profile_stage
from rollpacker.stages import rollout as rollout_stage
from rollpacker.stages import train as train_stage
from rollpacker.stages.context import StageContext
from rollpacker.stages.messages import ArmDone, DrainOutput, PlanOutput, RolloutOutput, TrainOutput


class PlanEdge(NamedTuple):
    plan: str  # PlanOutput, or ArmDone when ``skip``
    step: int
    need_profile: bool
    skip: bool


class CommitEdge(NamedTuple):
    summary: str  # CommitOutput
    metrics: dict[str, float]


@contextlib.contextmanager
def _ctx(config: str, arm: str) -> Iterator[StageContext]:
    mode = parse_enum(ServicesMode, os.environ.get("ROLLPACKER_SERVICES", "ray"), "$ROLLPACKER_SERVICES")
    ctx = StageContext.create(config, arm, mode, process_start=_process_start())
    try:
        yield ctx
    finally:
        ctx.services.disconnect()


def _process_start() -> float | None:
    """When this process started (wall clock), or None if the OS does not say."""
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:  # only a measurement: the stage's own start is used instead
        return None


def plan(config: str, arm: str) -> PlanEdge:
    """``skip``: the arm is done (``plan`` holds an ``ArmDone``): the DAG runs nothing after it."""
    with _ctx(config, arm) as ctx:
        p = plan_stage.plan(ctx)
    if isinstance(p, ArmDone):
        return PlanEdge(p.to_json(), p.step, False, True)
    return PlanEdge(p.to_json(), p.step, p.need_profile, False)


def profile(config: str, plan: str) -> str:
    p = PlanOutput.from_json(plan)
    with _ctx(config, p.arm) as ctx:
        return profile_stage.profile(ctx, p).to_json()


def rollout(config: str, plan: str) -> str:
    p = PlanOutput.from_json(plan)
    with _ctx(config, p.arm) as ctx:
        return rollout_stage.rollout(ctx, p).to_json()


def reward(config: str, plan: str, rollout: str) -> str:
    p = PlanOutput.from_json(plan)
    with _ctx(config, p.arm) as ctx:
        return drain_stage.drain(ctx, Role.REWARD, p, RolloutOutput.from_json(rollout)).to_json()


def judge(config: str, plan: str, rollout: str) -> str:
    p = PlanOutput.from_json(plan)
    with _ctx(config, p.arm) as ctx:
        return drain_stage.drain(ctx, Role.JUDGE, p, RolloutOutput.from_json(rollout)).to_json()


def train(config: str, plan: str, rollout: str, reward: str, judge: str) -> str:
    p = PlanOutput.from_json(plan)
    with _ctx(config, p.arm) as ctx:
        return train_stage.train(ctx, p, RolloutOutput.from_json(rollout)).to_json()


def commit(config: str, plan: str, rollout: str, reward: str, judge: str, train: str) -> CommitEdge:
    p = PlanOutput.from_json(plan)
    with _ctx(config, p.arm) as ctx:
        out = commit_stage.commit(
            ctx,
            p,
            RolloutOutput.from_json(rollout),
            DrainOutput.from_json(reward, "reward"),
            DrainOutput.from_json(judge, "judge"),
            TrainOutput.from_json(train),
        )
    return CommitEdge(out.to_json(), out.metrics)
