"""A stand-in for ``rollpacker.stages.edge`` and ``rollpacker.tasks.prepare`` (the contracts the
components call), recording its calls.

Used in-process by test_components.py and, through a sitecustomize, inside kfp.local's task
subprocesses by test_local.py. ``FAKE_STAGES_STATE`` names a file holding the arm's step counter;
``fail: <stage>`` in the config text makes that stage raise.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

calls: list[tuple[str, dict[str, str]]] = []


@dataclass
class PlanOutput:
    plan: str
    step: int
    need_profile: bool
    skip: bool


@dataclass
class CommitOutput:
    summary: str
    metrics: dict[str, float] = field(default_factory=dict)


def _enter(stage: str, **kwargs: str) -> None:
    calls.append((stage, kwargs))
    if f"fail: {stage}" in kwargs["config"]:
        raise RuntimeError(f"planted failure in {stage}")


def _state() -> Path | None:
    p = os.environ.get("FAKE_STAGES_STATE")
    return Path(p) if p else None


def prepare(config: str, arm: str) -> str:
    """``rollpacker.tasks.prepare.prepare``: the prepare-model task's edge."""
    _enter("prepare", config=config, arm=arm)
    return f"file:///store/{arm}/base/"


def plan(config: str, arm: str) -> PlanOutput:
    _enter("plan", config=config, arm=arm)
    state = _state()
    step = int(state.read_text()) if state is not None and state.exists() else 0
    done = re.search(r"^steps: (\d+)$", config, re.M)  # the arm is done at config.steps
    skip = done is not None and step >= int(done.group(1))
    return PlanOutput(json.dumps({"arm": arm, "step": step}), step, step == 0, skip)


def profile(config: str, plan: str) -> str:
    _enter("profile", config=config, plan=plan)
    return json.dumps({"profile": "p"})


def rollout(config: str, plan: str) -> str:
    _enter("rollout", config=config, plan=plan)
    return json.dumps({"rollout": "r"})


def reward(config: str, plan: str, rollout: str) -> str:
    _enter("reward", config=config, plan=plan, rollout=rollout)
    return json.dumps({"reward": "w"})


def judge(config: str, plan: str, rollout: str) -> str:
    _enter("judge", config=config, plan=plan, rollout=rollout)
    return json.dumps({"judge": "j"})


def train(config: str, plan: str, rollout: str, reward: str, judge: str) -> str:
    _enter("train", config=config, plan=plan, rollout=rollout, reward=reward, judge=judge)
    return json.dumps({"train": "t"})


def commit(config: str, plan: str, rollout: str, reward: str, judge: str, train: str) -> CommitOutput:
    _enter("commit", config=config, plan=plan, rollout=rollout, reward=reward, judge=judge, train=train)
    step = json.loads(plan)["step"]
    state = _state()
    if state is not None:
        state.write_text(str(step + 1))
    return CommitOutput(json.dumps({"committed": step}), {"rollout/time_s": 1.5, "train/loss": 0.25})
