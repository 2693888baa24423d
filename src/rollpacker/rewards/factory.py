"""The reward functions a task needs, built from the config: one per reward kind it uses."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rollpacker.core.config import ExperimentConfig
from rollpacker.core.devices import FILE_SCHEME, S3_SCHEME, resolve_device
from rollpacker.core.errors import ConfigError
from rollpacker.core.tasks import RewardKind, TaskExample
from rollpacker.core.timeout import AdaptiveTimeout
from rollpacker.rewards.base import RewardFunction, RewardRouter

if TYPE_CHECKING:
    from rollpacker.rewards.judge import JudgeConfig


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
    """The LLM judge of ``reward.judge`` (see ``judge_settings``)."""
    from rollpacker.rewards.judge import JudgeReward

    model_dir, config = judge_settings(cfg, quiet)
    return JudgeReward(model_dir, config)


def judge_settings(cfg: ExperimentConfig, quiet: bool = True) -> tuple[Path, JudgeConfig]:
    """The judge's model directory (``judge_model_dir``) and its ``JudgeConfig``: the device
    ``reward.judge.device`` resolves to here (``auto``: cuda when a GPU is visible; refused on the
    CPU when the config declares GPUs), the dtype, and resident or layer-wise offloaded (on
    cuda: pinned host memory and a copy stream, ``rewards.offload``)."""
    from rollpacker.rewards.judge import JudgeConfig

    j = cfg.reward.judge
    device = resolve_device(
        j.device, visible_gpus(), name="reward.judge.device", declared=cfg.gpu_declarations
    )
    model_dir = judge_model_dir(cfg, quiet)
    return model_dir, JudgeConfig(
        device=device,
        dtype=j.dtype,
        max_batch=j.max_batch,
        resident_layers=j.resident_layers if j.resident_layers >= 0 else None,
        memory_budget_bytes=int(j.memory_budget_mb * (1 << 20)) if j.memory_budget_mb > 0 else None,
    )


def visible_gpus() -> int:
    """GPUs this process sees (torch's count; 0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def judge_model_dir(cfg: ExperimentConfig, quiet: bool = True) -> Path:
    """Where the judge model is: ``reward.judge.model`` as a directory on this machine, or
    downloaded from the experiment's store (cached under ``$ROLLPACKER_CACHE/judge-models``);
    unset, the toy judge warmed up here, which judges only the synthetic math answers it was
    trained on: refused for a task read from a file (open-ended judge prompts)."""
    j = cfg.reward.judge
    if not j.model:
        return _toy_judge(cfg, quiet)
    if j.model.startswith((S3_SCHEME, FILE_SCHEME)):
        from rollpacker.store import cached_download, open_store
        from rollpacker.tasks.tiny_model import default_cache_dir

        return cached_download(open_store(cfg.store), j.model, default_cache_dir() / "judge-models")
    path = Path(j.model).expanduser()
    if not (path / "config.json").is_file():
        what = "has no config.json" if path.is_dir() else "does not exist"
        raise ConfigError(
            f"reward.judge.model = {j.model!r}: {path.absolute()} {what} on this machine (the judge's pod); "
            "give a Hugging Face model directory mounted there, or upload it to the store and give its "
            "s3:// URI"
        )
    return path


def _toy_judge(cfg: ExperimentConfig, quiet: bool) -> Path:
    """The ``reward.judge.preset`` tiny judge warmed up locally (cached)."""
    from tqdm import tqdm

    from rollpacker.logs import console
    from rollpacker.tasks.judge_task import judge_dir, shipped_judge, warm_up_judge
    from rollpacker.tasks.models import judge_warmup_spec
    from rollpacker.tasks.registry import BUILTIN_TASKS

    j = cfg.reward.judge
    if cfg.task.name not in BUILTIN_TASKS:
        raise ConfigError(
            f"reward.judge: the toy judge (reward.judge.model unset: the {j.preset!r} tiny model warmed up "
            f"here on synthetic math answers) cannot judge the open-ended judge prompts of {cfg.task.name}; "
            "set reward.judge.model to a judge model (a Hugging Face directory on the judge's pod, or a "
            "URI in the experiment's store) (docs/judge.md)"
        )
    spec = judge_warmup_spec(cfg)
    cached = judge_dir(spec)
    if (cached / "judge.json").is_file():
        if not quiet:
            print(f"judge warm-up: cached ({cached})", file=console(), flush=True)
        return cached
    installed = shipped_judge(spec)
    if installed is not None:
        if not quiet:
            print(
                f"judge warm-up: shipped with rollpacker, installed to {installed}",
                file=console(),
                flush=True,
            )
        return installed
    bar = tqdm(total=spec.steps, desc="judge warm-up", unit="step", disable=quiet, file=console())
    try:
        return warm_up_judge(spec, progress=lambda _s, _l: bar.update(1))
    finally:
        bar.close()
