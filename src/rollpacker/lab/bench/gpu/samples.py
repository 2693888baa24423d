"""Random RL samples for the GPU bench's training checks (and the tests' batches): groups with both
outcomes, varied lengths, random behaviour logprobs; and a stream's arrival of them in chunks."""

from __future__ import annotations

import random
from collections.abc import Sequence

from rollpacker.core.advantages import TrainSample, group_advantages

CHUNKS = 8  # chunks a streamed batch arrives in
LR = 0.1  # the SGD step of the megatron check


def make_samples(
    groups: int,
    group_size: int,
    seed: int,
    vocab: int = 64,
    prompt_lens: tuple[int, int] = (2, 9),
    response_lens: Sequence[int] = (1, 2, 3, 5, 8, 13, 30),
) -> list[list[TrainSample]]:
    """Groups of random samples: prompt lengths in ``prompt_lens`` (inclusive), response lengths
    drawn from ``response_lens``, rewards with both outcomes in every group, random behaviour
    logprobs. The tests' batches (tests/trainers/conftest.py) are its defaults."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = tuple(rng.randrange(1, vocab) for _ in range(rng.randint(*prompt_lens)))
        rewards = [float(rng.random() < 0.5) for _ in range(group_size)]
        if len(set(rewards)) == 1:
            rewards[0] = 1.0 - rewards[0]
        adv = group_advantages(rewards)
        samples = []
        for j in range(group_size):
            n = rng.choice(response_lens)
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
        out.append(samples)
    return out


def chunks(groups: list[list[TrainSample]], seed: int, n: int = CHUNKS) -> list[list[TrainSample]]:
    """The groups shuffled and cut into ``n`` chunks of uneven size (a stream's arrivals)."""
    rng = random.Random(seed)
    order = list(groups)
    rng.shuffle(order)
    cuts = sorted(rng.sample(range(1, len(order)), min(n, len(order)) - 1))
    return [[s for g in order[a:b] for s in g] for a, b in zip([0, *cuts], [*cuts, len(order)], strict=True)]
