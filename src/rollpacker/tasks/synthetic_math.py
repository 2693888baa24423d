"""A synthetic step-by-step math task with a heavy-tailed, per-prompt solution length.

Each problem asks for ``n`` repeated modular additions, and the solution works one line per step::

    prompt:   "start 7, add 3 mod 10, 12 steps\n"
    solution: "1: 7+3=0\n2: 0+3=3\n...\n12: 9+3=2\nAnswer: 2"
    verbose:  "1/12: 7+3=10, mod 10=0\n2/12: 0+3=3, mod 10=3\n...\n12/12: 9+3=12, mod 10=2\nAnswer: 2"

The number of steps ``n`` is the prompt's difficulty. Most prompts are drawn log-normal (median
``median_steps``, shape ``sigma``, clipped to ``[1, max_steps]``); a ``hard_fraction`` of them is
hard, log-uniform in ``[hard_min_steps, max_steps]``: the per-prompt shape of RL traces
(RollPacker Fig. 1, TLT Fig. 2), where a few hard prompts take an order of magnitude more tokens
than the P75. Each line is ~10 tokens under the byte-level tokenizer (~23 verbose, where each line
repeats ``k/n``: a tiny model then stops at the right line without counting back to the prompt),
so the response length follows ``n``. The embedded default (``task.shape`` in
configs/experiment.yaml: verbose, hard prompts of 24-64 steps) has P75 ~130 tokens and the
longest ~1,500; the spec's defaults are short (P75 ~80, max ~900).
The final answer is a digit checked by math-verify.

Invariants:
- ``generate(spec, seed)`` is a pure function of (spec, seed); ids are ``math-<seed>-<i>``;
- every solution is correct: its last line is ``Answer: <reference>``, and replaying its steps
  gives the reference;
- ``steps(example)`` is the ``n`` the prompt asks for, in ``[1, max_steps]``;
- ``TASK_VERSION`` changes whenever the prompt or solution text does (the warm-up caches and the
  judge's warm-up are keyed on it).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from rollpacker.core.tasks import RewardKind, TaskExample

MODULUS = 10
TASK_VERSION = 1  # bump when the prompt or solution text changes (warm-up cache keys include it)


@dataclass(frozen=True)
class SyntheticMathSpec:
    num_examples: int = 4000
    median_steps: float = 4.0  # log-normal steps
    sigma: float = 1.0
    max_steps: int = 90
    hard_fraction: float = 0.0  # hard prompts: log-uniform steps in [hard_min_steps, max_steps]
    hard_min_steps: int = 1
    verbose: bool = False  # each line written out in full: "k/n: x+a=s, mod 10=y" (~23 tokens)

    def __post_init__(self) -> None:
        if self.num_examples < 1:
            raise ValueError(f"num_examples = {self.num_examples}: must be >= 1")
        if not 1 <= self.median_steps <= self.max_steps:
            raise ValueError(f"median_steps = {self.median_steps}: must be in [1, max_steps]")
        if self.sigma < 0:
            raise ValueError(f"sigma = {self.sigma}: must be >= 0")
        if not 0.0 <= self.hard_fraction <= 1.0:
            raise ValueError(f"hard_fraction = {self.hard_fraction}: must be in [0, 1]")
        if not 1 <= self.hard_min_steps <= self.max_steps:
            raise ValueError(f"hard_min_steps = {self.hard_min_steps}: must be in [1, max_steps]")


def prompt_text(start: int, add: int, n: int) -> str:
    return f"start {start}, add {add} mod {MODULUS}, {n} steps\n"


def step_line(k: int, n: int, x: int, add: int, y: int, verbose: bool = False) -> str:
    """Step ``k`` of ``n``: ``x + add`` reduced mod 10 is ``y`` (the correct result unless a caller
    builds a wrong solution on purpose). Verbose lines carry ``k/n`` (the model sees at every line
    where it stands) and the unreduced sum; both forms end in ``=y`` (what the judge reads)."""
    if verbose:
        return f"{k}/{n}: {x}+{add}={x + add}, mod {MODULUS}={y}"
    return f"{k}: {x}+{add}={y}"


def solution_text(start: int, add: int, n: int, verbose: bool = False) -> str:
    lines = []
    x = start
    for k in range(1, n + 1):
        y = (x + add) % MODULUS
        lines.append(step_line(k, n, x, add, y, verbose))
        x = y
    lines.append(f"Answer: {x}")
    return "\n".join(lines)


def slipped_solution_text(start: int, add: int, n: int, rng: random.Random, verbose: bool = False) -> str:
    """A sloppy teacher's solution: one step, drawn uniformly, adds a wrong amount (the sum is off
    by 1-9 before the mod), and the chain goes on correctly from the wrong value, so the answer is
    wrong. A warm-up with a share of these leaves the model a per-line slip rate that a verifier's
    reward can remove (``model.warmup_slip_rate``)."""
    slip = rng.randrange(1, n + 1)
    off = rng.randrange(1, MODULUS)
    lines = []
    x = start
    for k in range(1, n + 1):
        s = x + add + (off if k == slip else 0)
        y = s % MODULUS
        line = f"{k}/{n}: {x}+{add}={s}, mod {MODULUS}={y}" if verbose else f"{k}: {x}+{add}={y}"
        lines.append(line)
        x = y
    lines.append(f"Answer: {x}")
    return "\n".join(lines)


def answer(start: int, add: int, n: int) -> int:
    return (start + add * n) % MODULUS


def make_example(example_id: str, start: int, add: int, n: int, verbose: bool = False) -> TaskExample:
    meta: dict[str, object] = {"task": "synthetic_math", "start": start, "add": add, "steps": n}
    if verbose:
        meta["verbose"] = True
    return TaskExample(
        example_id=example_id,
        prompt=prompt_text(start, add, n),
        reward_kind=RewardKind.MATH,
        reference=str(answer(start, add, n)),
        metadata=meta,
    )


def generate(spec: SyntheticMathSpec, seed: int = 0) -> tuple[TaskExample, ...]:
    rng = random.Random(f"synthetic-math:{seed}")
    out = []
    lo, hi = math.log(spec.hard_min_steps), math.log(spec.max_steps)
    for i in range(spec.num_examples):
        # no draw at all without hard prompts: the default task is the same sequence as before
        if spec.hard_fraction > 0 and rng.random() < spec.hard_fraction:
            n = round(math.exp(rng.uniform(lo, hi)))
        else:
            n = round(math.exp(rng.gauss(math.log(spec.median_steps), spec.sigma)))
        n = min(spec.max_steps, max(1, n))
        start, add = rng.randrange(MODULUS), rng.randrange(1, MODULUS)
        out.append(make_example(f"math-{seed}-{i}", start, add, n, spec.verbose))
    return tuple(out)


def steps(example: TaskExample) -> int:
    return int(example.metadata["steps"])


def reference_solution(example: TaskExample) -> str:
    """The step-by-step solution the warm-up trains on."""
    m = example.metadata
    return solution_text(int(m["start"]), int(m["add"]), int(m["steps"]), bool(m.get("verbose", False)))


def slipped_solution(example: TaskExample, rng: random.Random) -> str:
    """``slipped_solution_text`` for ``example``: a solution with one wrong step."""
    m = example.metadata
    return slipped_solution_text(
        int(m["start"]), int(m["add"]), int(m["steps"]), rng, bool(m.get("verbose", False))
    )
