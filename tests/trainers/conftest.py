from __future__ import annotations

import random
from pathlib import Path

import pytest

from rollpacker.core.advantages import TrainSample, group_advantages
from tests.small_model import build_small_model


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Qwen2 (hidden 32) saved in HF format: fast enough for float64 gradient checks."""
    return build_small_model(tmp_path_factory.mktemp("small-model"))


def make_batch(num_groups: int, group_size: int, seed: int, vocab: int = 64) -> list[list[TrainSample]]:
    """Groups of samples with varied prompt/response lengths, random rewards and logprobs."""
    rng = random.Random(seed)
    groups = []
    for g in range(num_groups):
        prompt = tuple(rng.randrange(1, vocab) for _ in range(rng.randint(2, 9)))
        rewards = [float(rng.random() < 0.5) for _ in range(group_size)]
        if len(set(rewards)) == 1:
            rewards[0] = 1.0 - rewards[0]
        adv = group_advantages(rewards)
        samples = []
        for j in range(group_size):
            n = rng.choice([1, 2, 3, 5, 8, 13, 30])
            samples.append(
                TrainSample(
                    sample_id=f"g{g}/r{j}",
                    prompt_id=f"g{g}",
                    prompt_ids=prompt,
                    response_ids=tuple(rng.randrange(1, vocab) for _ in range(n)),
                    behaviour_logprobs=tuple(-rng.uniform(2.0, 6.0) for _ in range(n)),
                    advantage=adv[j],
                    reward=rewards[j],
                )
            )
        groups.append(samples)
    return groups


def random_chunks(groups: list[list[TrainSample]], seed: int) -> list[list[TrainSample]]:
    """The groups in a random arrival order, cut into chunks of 1-3 groups (a stream's arrivals)."""
    rng = random.Random(seed)
    order = list(groups)
    rng.shuffle(order)
    chunks, i = [], 0
    while i < len(order):
        k = rng.randint(1, 3)
        chunks.append([s for g in order[i : i + k] for s in g])
        i += k
    return chunks
