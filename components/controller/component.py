"""controller.plan and controller.commit: the first and last task of every RL step."""

from typing import NamedTuple

from kfp import dsl

from components.images import component_image

IMAGE = component_image("controller")


@dsl.component(base_image=IMAGE, packages_to_install=[], install_kfp_package=False)
def controller_plan(config: str, arm: str) -> NamedTuple(
    "PlanOutputs", [("plan", str), ("step", int), ("need_profile", bool), ("skip", bool)]
):
    """Load the arm's state and plan its next step (round kind, prompts, TP size, timeouts)."""
    from collections import namedtuple

    from rollpacker.stages.edge import plan as stage

    out = stage(config=config, arm=arm)
    outputs = namedtuple("PlanOutputs", ["plan", "step", "need_profile", "skip"])
    return outputs(out.plan, int(out.step), bool(out.need_profile), bool(out.skip))


@dsl.component(base_image=IMAGE, packages_to_install=[], install_kfp_package=False)
def controller_commit(
    config: str,
    plan: str,
    rollout: str,
    reward: str,
    judge: str,
    train: str,
    metrics: dsl.Output[dsl.Metrics],
) -> str:
    """Write the step's new state atomically and log it; the step's metrics also go to ``metrics``."""
    from rollpacker.stages.edge import commit as stage

    out = stage(config=config, plan=plan, rollout=rollout, reward=reward, judge=judge, train=train)
    for name, value in out.metrics.items():
        metrics.log_metric(name, float(value))
    return out.summary
