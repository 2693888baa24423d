from __future__ import annotations

import pytest

from rollpacker.core.errors import ConfigError
from rollpacker.core.tasks import RewardKind, TaskExample
from rollpacker.tasks import synthetic_math
from rollpacker.tasks.jsonl import dump_jsonl
from rollpacker.tasks.registry import load_task


def test_synthetic_math_by_name() -> None:
    exs = load_task("synthetic_math", seed=3, num_examples=25)
    assert exs == synthetic_math.generate(synthetic_math.SyntheticMathSpec(num_examples=25), 3)
    assert exs[0].example_id == "math-3-0"
    assert load_task("synthetic_math", seed=4, num_examples=25) != exs
    assert len(load_task("synthetic_math")) == synthetic_math.SyntheticMathSpec().num_examples


def test_humaneval_by_name_and_cap() -> None:
    assert len(load_task("humaneval")) == 164
    assert [e.example_id for e in load_task("humaneval", num_examples=2)] == ["HumanEval/0", "HumanEval/1"]


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_file_by_path(tmp_path, suffix) -> None:
    exs = tuple(TaskExample(f"q{i}", f"p{i}", RewardKind.MATH, reference=str(i)) for i in range(5))
    path = tmp_path / f"d{suffix}"
    dump_jsonl(exs, path)
    assert load_task(str(path)) == exs
    assert load_task(str(path), seed=9, num_examples=3) == exs[:3]  # a cap, file order, seed unused


def test_unknown_name_lists_choices() -> None:
    with pytest.raises(ConfigError, match=r"'synthetic-math' \(did you mean 'synthetic_math'\?\).*humaneval"):
        load_task("synthetic-math")
    with pytest.raises(ConfigError, match=r"\.jsonl or \.jsonl\.gz"):
        load_task("data.json")
    with pytest.raises(ConfigError, match="num_examples = 0"):
        load_task("synthetic_math", num_examples=0)
