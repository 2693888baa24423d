"""The reward functions a task needs, built from the config: one per reward kind it uses."""

from __future__ import annotations

from collections.abc import Sequence

from rollpacker.core.config import ExperimentConfig
from rollpacker.core.tasks import RewardKind, TaskExample
from rollpacker.core.timeout import AdaptiveTimeout
from rollpacker.rewards.base import RewardFunction, RewardRouter


def build_rewards(
    cfg: ExperimentConfig, examples: Sequence[TaskExample], timeouts: AdaptiveTimeout, quiet: bool = False
) -> RewardRouter:
    """One reward function per reward kind the examples use: math-verify workers, the code sandbox
    (adaptive timeouts; reference solutions as first anchors with ``reward.sandbox.reference_anchors``),
    the LLM judge; refuses examples no function covers."""
    kinds = {ex.reward_kind for ex in examples}
    fns: list[RewardFunction] = []
    if RewardKind.MATH in kinds:
        from rollpacker.rewards.math_rule import MathReward

        fns.append(MathReward(workers=cfg.reward.workers, timeout_s=cfg.reward.timeout_s))
    if RewardKind.CODE in kinds:
        from rollpacker.rewards.code import CodeReward
        from rollpacker.rewards.sandbox import Sandbox, SandboxLimits

        sb = cfg.reward.sandbox
        limits = SandboxLimits(
            wall_s=sb.t_max_s * 2 + 5,
            cpu_s=sb.t_max_s * 2 + 5,
            memory_mb=sb.memory_mb,
            max_procs=sb.max_procs,
        )
        refs = sb.reference_anchors and sb.adaptive
        fns.append(CodeReward(Sandbox(limits), timeouts, workers=sb.workers, references=refs))
    if RewardKind.JUDGE in kinds:
        fns.append(_judge_reward(cfg, quiet))
    router = RewardRouter(fns)
    router.check_covers(examples)
    return router


def _judge_reward(cfg: ExperimentConfig, quiet: bool) -> RewardFunction:
    """The LLM judge, warmed up locally (cached), resident or layer-wise offloaded."""
    from tqdm import tqdm

    from rollpacker.rewards.judge import JudgeConfig, JudgeReward
    from rollpacker.tasks.judge_task import JudgeWarmupSpec, warm_up_judge

    j = cfg.reward.judge
    spec = JudgeWarmupSpec(model=j.preset, steps=j.warmup_steps)
    bar = tqdm(total=spec.steps, desc="judge warm-up (cached)", unit="step", disable=quiet, leave=False)
    try:
        model_dir = warm_up_judge(spec, progress=lambda _s, _l: bar.update(1))
    finally:
        bar.close()
    return JudgeReward(
        model_dir,
        JudgeConfig(
            max_batch=j.max_batch,
            resident_layers=j.resident_layers if j.resident_layers >= 0 else None,
            memory_budget_bytes=int(j.memory_budget_mb * (1 << 20)) if j.memory_budget_mb > 0 else None,
        ),
    )
