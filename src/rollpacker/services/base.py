"""What every service shares: its config (the arm's policy applied), the task data, the store.

A service is built from the experiment's config text and its arm; everything else it needs per
step (weights, cursor, queue, timeout anchors) comes from the committed state a stage passes in.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rollpacker.core.config import ExperimentConfig
from rollpacker.core.errors import ConfigError
from rollpacker.core.tasks import TaskExample, split
from rollpacker.core.types import Prompt
from rollpacker.services.registry import ServiceRegistry, config_digest


def arm_config(config_text: str, arm: str) -> ExperimentConfig:
    """The experiment config from YAML text, as arm ``arm`` runs it (its policy and variant)."""
    from rollpacker.loop.runner import config_from_text

    return config_from_text(config_text).for_arm(arm)


@dataclass(frozen=True)
class TaskData:
    examples: dict[str, TaskExample]
    train_prompts: tuple[Prompt, ...]
    val_prompts: tuple[Prompt, ...]

    @property
    def by_id(self) -> dict[str, Prompt]:
        return {p.prompt_id: p for p in self.train_prompts}


@functools.lru_cache(maxsize=4)
def task_data(task_name: str, seed: int, num_examples: int, val_size: int, tokenizer_dir: str) -> TaskData:
    """The task's examples split into train / validation prompts, tokenized (cached per process)."""
    from transformers import AutoTokenizer

    from rollpacker.tasks.registry import load_task

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    examples = load_task(task_name, seed=seed, num_examples=num_examples)
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


class Service:
    """The base of the Ray actors (and their inline twins)."""

    def __init__(self, config_text: str, arm: str, role: str) -> None:
        self.config_text = config_text
        self.arm = arm
        self.role = role
        self.cfg = arm_config(config_text, arm)
        self.registry: ServiceRegistry | None = None

    def config_digest(self) -> str:
        return config_digest(self.config_text)

    def bind(self, registry: ServiceRegistry) -> None:
        """Inline: peers are reached through the caller's registry."""
        self.registry = registry

    def bind_ray(self, config_text: str, experiment: str, address: str, namespace: str) -> None:
        """Ray: peers are reached as named actors of the same namespace."""
        if self.registry is None:
            self.registry = ServiceRegistry(
                config_text, experiment, self.arm, mode="ray", ray_address=address, namespace=namespace
            )

    def peer(self, role: str) -> Any:
        if self.registry is None:
            raise RuntimeError(f"{self.role} service used before bind")
        return self.registry.get(role)

    def store(self) -> Any:

        return _store(self.cfg.store)

    def close(self) -> None:
        pass


@functools.lru_cache(maxsize=4)
def _store(store_cfg: Any) -> Any:
    from rollpacker.store.objstore import ObjectStore

    return ObjectStore.from_config(store_cfg)
