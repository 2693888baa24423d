"""What the model RL starts from is (its identity, shape and key in the store, checked against the
config) and the task's prompts, without building or training anything: the stages and services
read these. Building the model (the warm-up) is ``tasks.prepare``, which runs before an arm's first
step, never inside a stage."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rollpacker.core.config import ExperimentConfig
from rollpacker.core.errors import ConfigError
from rollpacker.core.memory import ModelShape
from rollpacker.core.model_fit import model_refusals
from rollpacker.core.sizing import shipped, shm_refusal
from rollpacker.core.tasks import TaskExample, split
from rollpacker.core.types import Prompt

# the share of code in a built-in task, which the warm-up mixes in (docs/tasks.md)
CODE_SHARE = {"synthetic_code": 1.0, "mixed": 0.5}


def warmup_spec(cfg: ExperimentConfig):  # type: ignore[no-untyped-def]
    from rollpacker.tasks.warmup import WarmupSpec

    spec = WarmupSpec(
        model=cfg.model.preset,
        steps=cfg.model.warmup_steps,
        code_fraction=CODE_SHARE.get(cfg.task.name, 0.0),
        slip_rate=float(cfg.model.warmup_slip_rate),
    )
    if cfg.task.name in CODE_SHARE or cfg.task.name == "synthetic_math":
        # the warm-up problems have the task's length distribution (a model that never saw a long
        # solution stops early on a long prompt)
        spec = dataclasses.replace(spec, task=dataclasses.replace(spec.task, **dict(cfg.task.shape.items())))
    return spec


def judge_warmup_spec(cfg: ExperimentConfig):  # type: ignore[no-untyped-def]
    """The toy judge's warm-up recipe (``reward.judge.preset``, ``.warmup_steps``)."""
    from rollpacker.tasks.judge_task import JudgeWarmupSpec

    return JudgeWarmupSpec(model=cfg.reward.judge.preset, steps=cfg.reward.judge.warmup_steps)


def needs_toy_judge(cfg: ExperimentConfig) -> bool:
    """Whether ``cfg``'s task has judge prompts and no judge model is given: the toy judge is then
    warmed up here (``judge_warmup_spec``)."""
    from rollpacker.core.tasks import RewardKind
    from rollpacker.tasks.registry import BUILTIN_TASKS, load_task

    if cfg.reward.judge.model or cfg.task.name not in BUILTIN_TASKS:
        return False
    sample = load_task(cfg.task.name, cfg.seed, min(cfg.task.num_examples, 30))
    return any(ex.reward_kind is RewardKind.JUDGE for ex in sample)


def model_identity(cfg: ExperimentConfig) -> str:
    """A short digest of the model RL starts from, without building it: the warm-up's cache key,
    the tiny model's, or ``model.model_dir``'s path and files (names, sizes, mtimes). The start
    checkpoint's key in the store carries it, so a changed model is never served from a cached
    download of the old one."""
    if cfg.model.model_dir:
        p = Path(cfg.model.model_dir).resolve()
        files = sorted(f for f in p.iterdir() if f.is_file()) if p.is_dir() else []
        blob = json.dumps([str(p), *((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files)])
        return "dir-" + hashlib.sha256(blob.encode()).hexdigest()[:12]
    if cfg.model.warmup_steps == 0:
        from rollpacker.tasks.tiny_model import PRESETS

        if cfg.model.preset not in PRESETS:
            raise ConfigError(f"model.preset = {cfg.model.preset!r}: use one of {sorted(PRESETS)}")
        return f"{cfg.model.preset}-{PRESETS[cfg.model.preset].key()}"
    try:
        return f"warm-{cfg.model.preset}-{warmup_spec(cfg).key()}"
    except ValueError as e:
        raise ConfigError(f"model: {e}") from e


def base_key(cfg: ExperimentConfig, arm: str) -> str:
    """The store prefix of an arm's start model, keyed by what it is (``model_identity``): a changed
    model or warm-up is a new key, never a stale cached download of the old one."""
    return f"{cfg.experiment}/{arm}/ckpt/base-{model_identity(cfg)}/"


# written into the start model's prefix after its last file: the prefix is complete iff it is there
PREPARED_MARKER = "prepared.json"


def model_shape(cfg: ExperimentConfig) -> tuple[ModelShape, int, str] | None:
    """The shape of the model RL starts from, its ``max_position_embeddings`` and its name, without
    building or loading it: ``model.model_dir``'s ``config.json``, or the tiny preset's spec (the
    warm-up keeps its shape); None when ``model.model_dir`` is not readable on this machine."""
    if cfg.model.model_dir:
        f = Path(cfg.model.model_dir) / "config.json"
        if not f.is_file():
            return None
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"model.model_dir = {cfg.model.model_dir}: {f} is not readable JSON ({e})"
            ) from e
        shape = ModelShape.from_hf_config(data, str(f))
        return shape, int(data.get("max_position_embeddings") or 2**31), str(f)
    from rollpacker.tasks.tiny_model import PRESETS

    spec = PRESETS.get(cfg.model.preset)
    if spec is None:
        raise ConfigError(f"model.preset = {cfg.model.preset!r}: use one of {sorted(PRESETS)}")
    shape = ModelShape.from_hf_config(spec.config_json(), f"model.preset {cfg.model.preset!r}")
    return shape, spec.max_position_embeddings, f"model.preset {cfg.model.preset!r}"


def check_model(
    cfg: ExperimentConfig, *, local: bool = True, log: Callable[[str], None] | None = None
) -> None:
    """Refuse, before any warm-up, engine, Ray or store work, every setting the model cannot take
    (``core/model_fit.py``) and a warm-up that cannot run. ``local``: the model must be readable
    here (``train``, ``run``, ``bench``); else (``submit``: the model is on the cluster's volume)
    an unreadable ``model.model_dir`` is left to the pods' own checks, saying so to ``log``."""
    if not cfg.model.model_dir and cfg.model.warmup_steps:
        model_identity(cfg)  # the warm-up's spec is valid
    found = model_shape(cfg)
    if found is None:
        where = f"model.model_dir = {cfg.model.model_dir}"
        if local:
            raise ConfigError(f"{where}: not a Hugging Face model directory here (no config.json)")
        if log is not None:
            log(f"model check: {where} is not readable here; the engine and the trainer check it there")
        size = shipped(Path(cfg.model.model_dir).name)  # its size from the shipped table, by name
        why = size and shm_refusal(cfg, size.params, size.name)
        if why:
            raise ConfigError(why)
        return
    refusals = model_refusals(cfg, *found)
    if refusals:
        raise ConfigError("; ".join(refusals))


@dataclass(frozen=True)
class TaskData:
    examples: dict[str, TaskExample]
    train_prompts: tuple[Prompt, ...]
    val_prompts: tuple[Prompt, ...]

    @property
    def by_id(self) -> dict[str, Prompt]:
        return {p.prompt_id: p for p in self.train_prompts}


@functools.lru_cache(maxsize=4)
def task_data(
    task_name: str,
    seed: int,
    num_examples: int,
    val_size: int,
    tokenizer_dir: str,
    shape: tuple[tuple[str, float | bool], ...] = (),
) -> TaskData:
    """The task's examples split into train / validation prompts, tokenized (cached per process);
    ``shape``: ``task.shape`` (``TaskShapeConfig.items()``)."""
    from transformers import AutoTokenizer

    from rollpacker.tasks.registry import load_task

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    examples = load_task(task_name, seed=seed, num_examples=num_examples, shape=shape)
    if val_size >= len(examples):
        raise ConfigError(f"task.val_size = {val_size} leaves no training examples out of {len(examples)}")
    train, val = split(examples, val_size / len(examples), seed=seed)

    def prompts(xs: Sequence[TaskExample]) -> tuple[Prompt, ...]:
        return tuple(
            Prompt(
                prompt_id=ex.example_id,
                token_ids=tuple(tok.encode(ex.prompt, add_special_tokens=False)),
                dataset_index=i,
            )
            for i, ex in enumerate(xs)
        )

    return TaskData({ex.example_id: ex for ex in examples}, prompts(train), prompts(val))
