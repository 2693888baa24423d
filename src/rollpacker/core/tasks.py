"""Tasks: what a prompt asks, how its answer is checked, and seeded train/validation splits.

A ``TaskExample`` is one dataset line: the prompt text the model sees, the reward kind that scores
it (``math``: the final answer is compared with ``reference`` by math-verify; ``code``: the test
cases in ``tests`` are run after the response's program in a sandbox, each with its own timeout;
``judge``: an LLM judge compares the response with ``reference``), and free-form JSON metadata
(difficulty, source; ``completion: true`` on a code example means the program is the prompt
followed by the response, as in HumanEval).

Invariants:
- example ids are unique within a dataset (checked by ``check_unique``);
- ``split`` is a pure function of (ids, fraction, seed): the same inputs give the same split on
  every machine, train and validation are disjoint, and their union is the input;
- a ``math`` example has a non-empty reference, a ``code`` example at least one test case, and
  every test case is non-empty source.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rollpacker.core.errors import ConfigError

# the tasks built in (``tasks.registry.load_task``); any other ``task.name`` is a dataset file
BUILTIN_TASKS: tuple[str, ...] = ("synthetic_math", "synthetic_code", "mixed", "humaneval")
FILE_SUFFIXES: tuple[str, ...] = (".jsonl", ".jsonl.gz")


class RewardKind(enum.Enum):
    MATH = "math"
    CODE = "code"
    JUDGE = "judge"


@dataclass(frozen=True)
class TaskExample:
    example_id: str
    prompt: str
    reward_kind: RewardKind
    reference: str = ""  # math: the exact final answer; judge: a reference response
    # code: the test cases, each Python source run after the program and the cases before it in the
    # same interpreter (HumanEval-style); a single string is one case. Each case has its own timeout.
    tests: tuple[str, ...] = ()
    entry_point: str = ""  # code: the function the tests call
    metadata: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if isinstance(self.tests, str):
            object.__setattr__(self, "tests", (self.tests,) if self.tests.strip() else ())
        else:
            object.__setattr__(self, "tests", tuple(self.tests))
        if not self.example_id:
            raise ValueError("TaskExample.example_id must be a non-empty string")
        if not self.prompt:
            raise ValueError(f"example {self.example_id!r}: the prompt is empty")
        if self.reward_kind is RewardKind.MATH and not self.reference.strip():
            raise ValueError(f"example {self.example_id!r}: a math example needs a reference answer")
        if self.reward_kind is RewardKind.CODE and not any(t.strip() for t in self.tests):
            raise ValueError(f"example {self.example_id!r}: a code example needs tests")
        if any(not isinstance(t, str) or not t.strip() for t in self.tests):
            raise ValueError(f"example {self.example_id!r}: every test case must be non-empty source")

    def case_keys(self) -> tuple[str, ...]:
        """One key per test case (``<id>/<index>``): what the adaptive sandbox timeout anchors on."""
        return tuple(f"{self.example_id}/{i}" for i in range(len(self.tests)))


def check_unique(examples: Sequence[TaskExample], where: str = "dataset") -> None:
    seen: set[str] = set()
    for ex in examples:
        if ex.example_id in seen:
            raise ConfigError(
                f"{where}: example id {ex.example_id!r} appears more than once; ids must be unique"
            )
        seen.add(ex.example_id)


def split(
    examples: Sequence[TaskExample], val_fraction: float, seed: int
) -> tuple[tuple[TaskExample, ...], tuple[TaskExample, ...]]:
    """Seeded (train, validation) split, stable across machines and Python versions.

    Each example goes to validation when the hash of (seed, id) ranks in the lowest
    ``val_fraction`` of the dataset; order within each part follows the input.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ConfigError(f"val_fraction = {val_fraction!r}: must be in [0, 1)")
    check_unique(examples)
    n_val = round(len(examples) * val_fraction)

    def rank(ex: TaskExample) -> str:
        return hashlib.sha256(f"{seed}:{ex.example_id}".encode()).hexdigest()

    val_ids = {ex.example_id for ex in sorted(examples, key=rank)[:n_val]}
    train = tuple(ex for ex in examples if ex.example_id not in val_ids)
    val = tuple(ex for ex in examples if ex.example_id in val_ids)
    return train, val
