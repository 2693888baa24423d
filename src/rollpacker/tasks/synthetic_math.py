"""A synthetic step-by-step math task with a heavy-tailed, per-prompt solution length.

Each problem asks for ``n`` repeated modular additions::

    prompt:   "start 7, add 3 mod 10, 12 steps\n"
    solution: "1: 7+3=0\n2: 0+3=3\n...\n12: 9+3=2\nAnswer: 2"

The number of steps ``n`` is the prompt's difficulty: log-normal with a median of ``median_steps``
and shape ``sigma`` (clipped to ``[1, max_steps]``), so most solutions are a few lines and a few
percent need an order of magnitude more. Each line is ~10 tokens under the byte-level tokenizer,
so the response length follows ``n``. The final answer is a digit checked by math-verify.

Invariants:
- ``generate(spec, seed)`` is a pure function of (spec, seed); ids are ``math-<seed>-<i>``;
- every solution is correct: its last line is ``Answer: <reference>``, and replaying its steps
  gives the reference;
- ``steps(example)`` is the ``n`` the prompt asks for.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from rollpacker.core.tasks import RewardKind, TaskExample

MODULUS = 10


@dataclass(frozen=True)
class SyntheticMathSpec:
    num_examples: int = 4000
    median_steps: float = 4.0
    sigma: float = 1.0
    max_steps: int = 90

    def __post_init__(self) -> None:
        if self.num_examples < 1:
            raise ValueError(f"num_examples = {self.num_examples}: must be >= 1")
        if not 1 <= self.median_steps <= self.max_steps:
            raise ValueError(f"median_steps = {self.median_steps}: must be in [1, max_steps]")
        if self.sigma < 0:
            raise ValueError(f"sigma = {self.sigma}: must be >= 0")


def prompt_text(start: int, add: int, n: int) -> str:
    return f"start {start}, add {add} mod {MODULUS}, {n} steps\n"


def solution_text(start: int, add: int, n: int) -> str:
    lines = []
    x = start
    for k in range(1, n + 1):
        y = (x + add) % MODULUS
        lines.append(f"{k}: {x}+{add}={y}")
        x = y
    lines.append(f"Answer: {x}")
    return "\n".join(lines)


def answer(start: int, add: int, n: int) -> int:
    return (start + add * n) % MODULUS


def make_example(example_id: str, start: int, add: int, n: int) -> TaskExample:
    return TaskExample(
        example_id=example_id,
        prompt=prompt_text(start, add, n),
        reward_kind=RewardKind.MATH,
        reference=str(answer(start, add, n)),
        metadata={"task": "synthetic_math", "start": start, "add": add, "steps": n},
    )


def generate(spec: SyntheticMathSpec, seed: int = 0) -> tuple[TaskExample, ...]:
    rng = random.Random(f"synthetic-math:{seed}")
    out = []
    for i in range(spec.num_examples):
        n = round(math.exp(rng.gauss(math.log(spec.median_steps), spec.sigma)))
        n = min(spec.max_steps, max(1, n))
        start, add = rng.randrange(MODULUS), rng.randrange(1, MODULUS)
        out.append(make_example(f"math-{seed}-{i}", start, add, n))
    return tuple(out)


def steps(example: TaskExample) -> int:
    return int(example.metadata["steps"])


def reference_solution(example: TaskExample) -> str:
    """The step-by-step solution the warm-up trains on."""
    m = example.metadata
    return solution_text(int(m["start"]), int(m["add"]), int(m["steps"]))
