from __future__ import annotations

import random
from pathlib import Path

import pytest

from rollpacker.core.advantages import TrainSample
from rollpacker.lab.bench.gpu.samples import make_samples
from tests.small_model import build_small_model


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Qwen2 (hidden 32) saved in HF format: fast enough for float64 gradient checks."""
    return build_small_model(tmp_path_factory.mktemp("small-model"))


def make_batch(num_groups: int, group_size: int, seed: int, vocab: int = 64) -> list[list[TrainSample]]:
    """Groups of samples with varied prompt/response lengths, random rewards and logprobs."""
    return make_samples(num_groups, group_size, seed, vocab)


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
