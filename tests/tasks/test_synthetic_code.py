"""The synthetic code task: references pass, variants fail or never terminate (run for real)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rollpacker.core.tasks import RewardKind
from rollpacker.tasks import synthetic_code as sc
from rollpacker.tasks.registry import load_task


def _run(program: str, case: str, timeout_s: float = 2.0) -> str:
    try:
        p = subprocess.run(
            [sys.executable, "-c", program + "\n" + case], capture_output=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return "timeout"
    return "passed" if p.returncode == 0 else "failed"


def test_generate_is_deterministic_and_well_formed():
    a = sc.generate(sc.SyntheticCodeSpec(num_examples=50), seed=3)
    assert a == sc.generate(sc.SyntheticCodeSpec(num_examples=50), seed=3)
    assert a != sc.generate(sc.SyntheticCodeSpec(num_examples=50), seed=4)
    assert all(ex.reward_kind is RewardKind.CODE and len(ex.tests) == 2 for ex in a)
    assert [ex.example_id for ex in a[:2]] == ["code-3-0", "code-3-1"]
    assert len({ex.example_id for ex in a}) == 50


def test_steps_have_a_long_tail():
    steps = sorted(int(ex.metadata["steps"]) for ex in sc.generate(sc.SyntheticCodeSpec(), seed=0))
    median, top = steps[len(steps) // 2], steps[int(0.99 * len(steps))]
    assert top >= 4 * median


@pytest.mark.parametrize("i", range(8))
def test_reference_passes_wrong_fails_nonterminating_hangs(i):
    ex = sc.generate(sc.SyntheticCodeSpec(num_examples=8), seed=1)[i]
    for case in ex.tests:
        assert _run(sc.reference_solution(ex), case) == "passed"
        assert _run(sc.wrong_variant(ex), case) == "failed"
    assert _run(sc.nonterminating_variant(ex), ex.tests[0], timeout_s=0.5) == "timeout"


def test_registry_knows_code_and_mixed():
    assert len(load_task("synthetic_code", num_examples=7)) == 7
    mixed = load_task("mixed", seed=0, num_examples=9)
    assert [ex.reward_kind.value for ex in mixed[:3]] == ["math", "code", "judge"]
    assert {ex.reward_kind for ex in mixed} == set(RewardKind)
    judge = next(ex for ex in mixed if ex.reward_kind is RewardKind.JUDGE)
    assert judge.reference.rstrip().splitlines()[-1].startswith("Answer:")
