"""One RL step as a KFP pipeline (docs/architecture.md, "The stages and services on a cluster")::

    controller-plan -> [unless plan.skip: [profiling, if plan.need_profile] -> rollout
                        -> sandbox-reward and judge -> training -> controller-commit]

Every task's Kubernetes settings (resources, node pool, Secrets as env) come from pipelines/platform.py.
Every task has caching off (a step reads and writes the arm's state, so two runs of the same
inputs are different steps) and no retries. A step whose arm already reached ``config.steps`` gets
``plan.skip`` (its ``plan`` output is then an ``ArmDone``, not a ``PlanOutput``): every stage after
the plan sits under a ``dsl.If`` on it, inside the sub-pipeline ``step-unless-done``, so the stages
never see a step that does not run.

Both conditions sit inside sub-pipelines (``step-unless-done``, and ``profile-if-needed`` for
profiling) for two reasons:
- KFP forbids ``rollout.after(profiling)`` when profiling is inside a ``dsl.If`` and rollout is not
  (InvalidTopologyException); ``.after()`` on the sub-pipeline task is legal and waits for the
  profiling task when it runs;
- ``kfp.local`` (2.17.0) cannot evaluate a condition on a named output of a multi-output task
  (``plan.outputs['need_profile']`` resolves as ``None`` and the branch is silently skipped); a
  condition on a sub-pipeline *input* resolves.
"""

from components.controller.component import controller_commit, controller_plan
from components.judge.component import judge
from components.profiling.component import profiling
from components.rollout.component import rollout
from components.sandbox_reward.component import sandbox_reward
from components.training.component import training
from kfp import dsl

from pipelines.platform import on_cluster


@dsl.pipeline(name="profile-if-needed", description="Profile the rollout engine when the plan asks.")
def profile_if_needed(config: str, plan: str, need_profile: bool):
    with dsl.If(need_profile == True, name="need-profile"):  # noqa: E712 - a KFP condition, not Python
        on_cluster(profiling(config=config, plan=plan).set_caching_options(False), "profiling")


@dsl.pipeline(name="step-unless-done", description="The step's stages, unless the arm is done.")
def step_unless_done(config: str, plan: str, need_profile: bool, skip: bool):
    with dsl.If(skip == False, name="arm-not-done"):  # noqa: E712 - a KFP condition, not Python
        profile = profile_if_needed(config=config, plan=plan, need_profile=need_profile).set_caching_options(
            False
        )
        roll = rollout(config=config, plan=plan).after(profile).set_caching_options(False)
        reward = sandbox_reward(config=config, plan=plan, rollout=roll.output).set_caching_options(False)
        judged = judge(config=config, plan=plan, rollout=roll.output).set_caching_options(False)
        for task, component in ((roll, "rollout"), (reward, "sandbox_reward"), (judged, "judge")):
            on_cluster(task, component)
        train = training(
            config=config, plan=plan, rollout=roll.output, reward=reward.output, judge=judged.output
        ).set_caching_options(False)
        on_cluster(train, "training")
        commit = controller_commit(
            config=config,
            plan=plan,
            rollout=roll.output,
            reward=reward.output,
            judge=judged.output,
            train=train.output,
        ).set_caching_options(False)
        on_cluster(commit, "controller")


@dsl.pipeline(name="rl-step", description="One synchronous on-policy RL step of one arm.")
def rl_step(config: str, arm: str):
    plan = on_cluster(controller_plan(config=config, arm=arm).set_caching_options(False), "controller")
    step_unless_done(
        config=config,
        plan=plan.outputs["plan"],
        need_profile=plan.outputs["need_profile"],
        skip=plan.outputs["skip"],
    ).set_caching_options(False)
