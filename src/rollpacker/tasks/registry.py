"""Tasks by name: the built-in ones, or a user's JSON Lines file.

``load_task(name_or_path)`` accepts:

- ``"synthetic_math"``: ``synthetic_math.generate(SyntheticMathSpec(num_examples=...), seed)``;
  ``num_examples`` defaults to the spec's default (4000);
- ``"synthetic_code"``: ``synthetic_code.generate(SyntheticCodeSpec(num_examples=...), seed)``;
- ``"mixed"``: the multi-task setting: math, code and judge prompts in equal thirds, interleaved
  (``mixed_tasks``); the judge prompts are synthetic math problems whose reference is the full
  reference solution, scored by the LLM judge;
- ``"humaneval"``: the 164 HumanEval problems (``humaneval.load_humaneval``);
- a path ending in ``.jsonl`` or ``.jsonl.gz``: ``jsonl.load_jsonl``. A store URI
  (``s3://...``) is not read here: the experiment's plan stage publishes it and the services read
  it through the store (``tasks.dataset_store``).

Invariants:
- the result is a pure function of (name_or_path, seed, num_examples, the file's bytes);
- ``seed`` only matters for generated tasks; files keep their order and are not shuffled (the
  seeded order comes from ``core.tasks.split`` and the prompt cursor);
- ``num_examples`` is exact for generated tasks and a cap (the first ``n`` in file order) for
  HumanEval and files; it must be >= 1;
- anything else raises ``ConfigError`` listing the choices.
"""

from __future__ import annotations

import dataclasses
import difflib

from rollpacker.core.errors import ConfigError
from rollpacker.core.tasks import BUILTIN_TASKS, FILE_SUFFIXES, RewardKind, TaskExample

__all__ = ["BUILTIN_TASKS", "FILE_SUFFIXES", "load_task", "mixed_tasks"]


def load_task(
    name_or_path: str,
    seed: int = 0,
    num_examples: int | None = None,
    shape: tuple[tuple[str, float | bool], ...] = (),
) -> tuple[TaskExample, ...]:
    """``shape``: the synthetic math prompts' length distribution (``TaskShapeConfig.items()``:
    ``SyntheticMathSpec`` fields) for ``synthetic_math`` and ``mixed``; ignored by other tasks."""
    if num_examples is not None and num_examples < 1:
        raise ConfigError(f"num_examples = {num_examples}: must be >= 1 (or None for the whole task)")
    if name_or_path == "synthetic_math":
        from rollpacker.tasks import synthetic_math

        spec = synthetic_math.SyntheticMathSpec(**dict(shape))
        if num_examples is not None:
            spec = dataclasses.replace(spec, num_examples=num_examples)
        return synthetic_math.generate(spec, seed)
    if name_or_path == "synthetic_code":
        from rollpacker.tasks import synthetic_code

        cspec = (
            synthetic_code.SyntheticCodeSpec()
            if num_examples is None
            else synthetic_code.SyntheticCodeSpec(num_examples=num_examples)
        )
        return synthetic_code.generate(cspec, seed)
    if name_or_path == "mixed":
        return mixed_tasks(seed, 3000 if num_examples is None else num_examples, shape)
    if name_or_path == "humaneval":
        from rollpacker.tasks.humaneval import load_humaneval

        examples = load_humaneval()
    elif "://" in name_or_path:
        raise ConfigError(
            f"task {name_or_path!r}: a store URI is read through the store, not as a file; run it as an "
            "experiment (the plan stage publishes it, the services download it: tasks.dataset_store)"
        )
    elif name_or_path.endswith(FILE_SUFFIXES):
        from rollpacker.tasks.jsonl import load_jsonl

        examples = load_jsonl(name_or_path)
    else:
        close = difflib.get_close_matches(name_or_path, BUILTIN_TASKS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"unknown task {name_or_path!r}{hint}; choose one of {', '.join(BUILTIN_TASKS)}, or give a "
            f"path to a dataset file ending in {' or '.join(FILE_SUFFIXES)} (format: docs/tasks.md)"
        )
    return examples if num_examples is None else examples[:num_examples]


def mixed_tasks(
    seed: int, num_examples: int, shape: tuple[tuple[str, float | bool], ...] = ()
) -> tuple[TaskExample, ...]:
    """Math, code and judge examples in equal thirds, interleaved (math, code, judge, math, ...);
    ``shape`` sets the math and judge prompts' length distribution."""
    from rollpacker.tasks import synthetic_code, synthetic_math

    def math_spec(k: int) -> synthetic_math.SyntheticMathSpec:
        return synthetic_math.SyntheticMathSpec(**{**dict(shape), "num_examples": max(1, k)})

    n = [num_examples // 3 + (1 if i < num_examples % 3 else 0) for i in range(3)]
    maths = synthetic_math.generate(math_spec(n[0]), seed)
    codes = synthetic_code.generate(synthetic_code.SyntheticCodeSpec(num_examples=max(1, n[1])), seed)
    judged = [
        TaskExample(
            example_id=f"judge-{seed}-{i}",
            prompt=ex.prompt,
            reward_kind=RewardKind.JUDGE,
            reference=synthetic_math.reference_solution(ex),
            metadata={**ex.metadata, "task": "synthetic_judge"},
        )
        for i, ex in enumerate(synthetic_math.generate(math_spec(n[2]), seed + 7919))
    ]
    parts: list[list[TaskExample]] = [list(maths[: n[0]]), list(codes[: n[1]]), judged[: n[2]]]
    out: list[TaskExample] = []
    for i in range(max(n)):
        out.extend(p[i] for p in parts if i < len(p))
    return tuple(out)
