"""Synthetic math solutions and the seeded train/validation split."""

from __future__ import annotations

import pytest

from rollpacker.core.errors import ConfigError
from rollpacker.core.tasks import RewardKind, TaskExample, split
from rollpacker.tasks import synthetic_math
from rollpacker.tasks.synthetic_math import SyntheticMathSpec

EXAMPLES = synthetic_math.generate(SyntheticMathSpec(num_examples=200), seed=0)


def test_synthetic_solutions_end_with_the_reference_answer() -> None:
    assert len(EXAMPLES) == 200
    for ex in EXAMPLES:
        sol = synthetic_math.reference_solution(ex)
        assert sol.splitlines()[-1] == f"Answer: {ex.reference}"
        assert len(sol.splitlines()) == synthetic_math.steps(ex) + 1
        assert ex.reward_kind is RewardKind.MATH
    steps = sorted(synthetic_math.steps(e) for e in EXAMPLES)
    assert steps[len(steps) // 2] <= 6 and steps[-1] >= 20  # heavy tail: median small, max much larger


@pytest.mark.parametrize("frac", [0.0, 0.1, 0.25, 0.5])
def test_split_disjoint_union_deterministic_fraction(frac) -> None:
    train, val = split(EXAMPLES, frac, seed=1)
    ids_t, ids_v = {e.example_id for e in train}, {e.example_id for e in val}
    assert not ids_t & ids_v
    assert ids_t | ids_v == {e.example_id for e in EXAMPLES}
    assert len(val) == round(200 * frac)
    assert split(EXAMPLES, frac, seed=1) == (train, val)
    assert [e.example_id for e in train] == [e.example_id for e in EXAMPLES if e.example_id in ids_t]


def test_split_depends_on_seed_and_rejects_bad_input() -> None:
    assert split(EXAMPLES, 0.25, seed=1)[1] != split(EXAMPLES, 0.25, seed=2)[1]
    with pytest.raises(ConfigError, match="val_fraction"):
        split(EXAMPLES, 1.0, seed=0)
    dup = [TaskExample("a", "p", RewardKind.JUDGE), TaskExample("a", "q", RewardKind.JUDGE)]
    with pytest.raises(ConfigError, match="more than once"):
        split(dup, 0.5, seed=0)
