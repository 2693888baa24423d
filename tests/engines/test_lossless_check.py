"""The losslessness check on synthetic samples: quiet on one distribution, loud on two."""

from __future__ import annotations

import random

from rollpacker.testing.lossless import compare_samples


def _draw(rng: random.Random, weights: list[float], n: int, length: int = 6) -> list[list[int]]:
    toks = list(range(len(weights)))
    return [rng.choices(toks, weights, k=rng.randint(length - 2, length)) for _ in range(n)]


def test_same_distribution_is_same_and_a_shift_is_caught() -> None:
    rng = random.Random(0)
    base = [5.0, 3.0, 2.0, 1.0, 1.0]
    a, b = _draw(rng, base, 1500), _draw(rng, base, 1500)
    assert compare_samples(a, b).same
    shifted = _draw(rng, [5.0, 3.0, 2.0, 2.0, 1.0], 1500)
    report = compare_samples(a, shifted)
    assert not report.same and report.worst().startswith("token@")


def test_lengths_and_rewards_are_compared() -> None:
    rng = random.Random(1)
    a = _draw(rng, [1.0, 1.0], 1000, length=6)
    longer = _draw(rng, [1.0, 1.0], 1000, length=9)
    assert "length" in compare_samples(a, longer).p_values
    assert not compare_samples(a, longer).same
    same_tokens = _draw(rng, [1.0, 1.0], 1000, length=6)
    r = compare_samples(a, same_tokens, [0.0] * 500 + [1.0] * 500, [0.0] * 800 + [1.0] * 200)
    assert not r.same and r.worst() == "reward"
