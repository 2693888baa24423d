"""The stages as the KFP components call them: JSON text in, JSON text out.

This is the only place where a stage's messages become text: each function reads its inputs with
the messages' strict ``from_json`` and returns ``to_json``. The services run as Ray actors
(``$ROLLPACKER_SERVICES=inline`` keeps them in the task's process, for debugging).
"""

from __future__ import annotations

import os
from typing import NamedTuple

from rollpacker.stages import commit as commit_stage
from rollpacker.stages import drain as drain_stage
from rollpacker.stages import plan as plan_stage
from rollpacker.stages import profile as profile_stage
from rollpacker.stages import rollout as rollout_stage
from rollpacker.stages import train as train_stage
from rollpacker.stages.context import StageContext
from rollpacker.stages.messages import DrainOutput, RolloutOutput, StepPlan, TrainOutput


class PlanOutput(NamedTuple):
    plan: str  # StepPlan
    step: int
    need_profile: bool
    skip: bool


class CommitEdge(NamedTuple):
    summary: str  # CommitOutput
    metrics: dict[str, float]


def _ctx(config: str, arm: str) -> StageContext:
    return StageContext.create(config, arm, os.environ.get("ROLLPACKER_SERVICES", "ray"))


def plan(config: str, arm: str) -> PlanOutput:
    p = plan_stage.plan(_ctx(config, arm))
    return PlanOutput(p.to_json(), p.step, p.need_profile, p.skip)


def profile(config: str, plan: str) -> str:
    p = StepPlan.from_json(plan)
    return profile_stage.profile(_ctx(config, p.arm), p).to_json()


def rollout(config: str, plan: str) -> str:
    p = StepPlan.from_json(plan)
    return rollout_stage.rollout(_ctx(config, p.arm), p).to_json()


def reward(config: str, plan: str, rollout: str) -> str:
    p = StepPlan.from_json(plan)
    return drain_stage.drain(_ctx(config, p.arm), "reward", p, RolloutOutput.from_json(rollout)).to_json()


def judge(config: str, plan: str, rollout: str) -> str:
    p = StepPlan.from_json(plan)
    return drain_stage.drain(_ctx(config, p.arm), "judge", p, RolloutOutput.from_json(rollout)).to_json()


def train(config: str, plan: str, rollout: str, reward: str, judge: str) -> str:
    p = StepPlan.from_json(plan)
    return train_stage.train(_ctx(config, p.arm), p, RolloutOutput.from_json(rollout)).to_json()


def commit(config: str, plan: str, rollout: str, reward: str, judge: str, train: str) -> CommitEdge:
    p = StepPlan.from_json(plan)
    out = commit_stage.commit(
        _ctx(config, p.arm),
        p,
        RolloutOutput.from_json(rollout),
        DrainOutput.from_json(reward, "reward"),
        DrainOutput.from_json(judge, "judge"),
        TrainOutput.from_json(train),
    )
    return CommitEdge(out.to_json(), out.metrics)
