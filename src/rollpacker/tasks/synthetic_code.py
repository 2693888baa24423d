"""A synthetic code task whose wrong answers sometimes never terminate.

Each problem asks for a function that walks a counter to a target in strides::

    prompt:   "code: add 3 mod 10, n to 24 by 2\\n"
    solution: "def f(x):\\n    n = 0\\n    while n != 24:\\n        x = (x + 3) % 10\\n"
              "        n += 2\\n    return x"

The model has to carry the bound and the stride from the prompt into the loop. A slip in the bound
that keeps it a multiple of the stride gives a wrong answer (the tests fail fast); one that does
not (or a wrong stride) makes ``n`` jump over the bound and the loop **never ends**: exactly the
doomed responses that a fixed 30 s sandbox timeout waits out and the adaptive timeout cuts
(RollPacker section 4.3). The tests are several cases ``assert f(x0) == answer`` with different
``x0``; each case has its own adaptive-timeout anchor. The number of steps (bound / stride) is
log-normal (median ``median_steps``), so the loop runs from one to ``max_steps`` iterations.

Invariants:
- ``generate(spec, seed)`` is a pure function of (spec, seed); ids are ``code-<seed>-<i>``;
- every reference solution passes all of its example's test cases and terminates;
  ``metadata["solution"] == reference_solution(example)`` (the code reward times it as the
  cases' first adaptive-timeout anchors, ``rewards/reference.py``);
- ``nonterminating_variant(example)`` is a program of the same shape that never terminates (its
  bound is not reachable in strides), ``wrong_variant`` one that terminates with a wrong answer.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from rollpacker.core.tasks import RewardKind, TaskExample

MODULUS = 10
ENTRY_POINT = "f"
TASK_VERSION = 2  # bump when the prompt or solution text changes (warm-up cache keys include it)


@dataclass(frozen=True)
class SyntheticCodeSpec:
    num_examples: int = 4000
    median_steps: float = 4.0
    sigma: float = 0.8
    max_steps: int = 30
    max_stride: int = 4
    num_cases: int = 2  # test cases per problem (each ``assert f(x0) == ...``)

    def __post_init__(self) -> None:
        if self.num_examples < 1:
            raise ValueError(f"num_examples = {self.num_examples}: must be >= 1")
        if not 1 <= self.median_steps <= self.max_steps:
            raise ValueError(f"median_steps = {self.median_steps}: must be in [1, max_steps]")
        if self.sigma < 0:
            raise ValueError(f"sigma = {self.sigma}: must be >= 0")
        if not 1 <= self.max_stride <= 9:
            raise ValueError(f"max_stride = {self.max_stride}: must be in [1, 9]")
        if not 1 <= self.num_cases <= MODULUS:
            raise ValueError(f"num_cases = {self.num_cases}: must be in [1, {MODULUS}]")


def prompt_text(add: int, steps: int, stride: int) -> str:
    return f"code: add {add} mod {MODULUS}, n to {steps * stride} by {stride}\n"


def program(add: int, bound: int, stride: int) -> str:
    return (
        f"def {ENTRY_POINT}(x):\n"
        "    n = 0\n"
        f"    while n != {bound}:\n"
        f"        x = (x + {add}) % {MODULUS}\n"
        f"        n += {stride}\n"
        "    return x"
    )


def answer(x0: int, add: int, steps: int) -> int:
    return (x0 + add * steps) % MODULUS


def test_cases(add: int, steps: int, starts: tuple[int, ...]) -> tuple[str, ...]:
    return tuple(f"assert {ENTRY_POINT}({x0}) == {answer(x0, add, steps)}\n" for x0 in starts)


def make_example(example_id: str, add: int, steps: int, stride: int, starts: tuple[int, ...]) -> TaskExample:
    return TaskExample(
        example_id=example_id,
        prompt=prompt_text(add, steps, stride),
        reward_kind=RewardKind.CODE,
        tests=test_cases(add, steps, starts),
        entry_point=ENTRY_POINT,
        metadata={
            "task": "synthetic_code",
            "add": add,
            "steps": steps,
            "stride": stride,
            "starts": list(starts),
            # the reference solution (a correct response), timed as the cases' first timeout anchors
            "solution": program(add, steps * stride, stride),
        },
    )


def generate(spec: SyntheticCodeSpec, seed: int = 0) -> tuple[TaskExample, ...]:
    rng = random.Random(f"synthetic-code:{seed}")
    out = []
    for i in range(spec.num_examples):
        steps = round(math.exp(rng.gauss(math.log(spec.median_steps), spec.sigma)))
        steps = min(spec.max_steps, max(1, steps))
        add, stride = rng.randrange(1, MODULUS), rng.randrange(1, spec.max_stride + 1)
        starts = tuple(rng.sample(range(MODULUS), spec.num_cases))
        out.append(make_example(f"code-{seed}-{i}", add, steps, stride, starts))
    return tuple(out)


def _params(example: TaskExample) -> tuple[int, int, int]:
    m = example.metadata
    return int(m["add"]), int(m["steps"]), int(m["stride"])


def reference_solution(example: TaskExample) -> str:
    add, steps, stride = _params(example)
    return program(add, steps * stride, stride)


def nonterminating_variant(example: TaskExample) -> str:
    """The reference with a bound the counter jumps over (or, for stride 1, counts away from)."""
    add, steps, stride = _params(example)
    if stride == 1:
        return program(add, steps, 2) if steps % 2 else program(add, steps + 1, 2)
    return program(add, steps * stride + 1, stride)


def wrong_variant(example: TaskExample) -> str:
    """A terminating program with the wrong answer: one stride too many."""
    add, steps, stride = _params(example)
    return program(add, (steps + 1) * stride, stride)
