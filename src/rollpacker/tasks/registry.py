"""Tasks by name: the built-in ones, or a user's JSON Lines file.

``load_task(name_or_path)`` accepts:

- ``"synthetic_math"``: ``synthetic_math.generate(SyntheticMathSpec(num_examples=...), seed)``;
  ``num_examples`` defaults to the spec's default (4000);
- ``"humaneval"``: the 164 HumanEval problems (``humaneval.load_humaneval``);
- a path ending in ``.jsonl`` or ``.jsonl.gz``: ``jsonl.load_jsonl``.

Invariants:
- the result is a pure function of (name_or_path, seed, num_examples, the file's bytes);
- ``seed`` only matters for generated tasks; files keep their order and are not shuffled (the
  seeded order comes from ``core.tasks.split`` and the prompt cursor);
- ``num_examples`` is exact for generated tasks and a cap (the first ``n`` in file order) for
  HumanEval and files; it must be >= 1;
- anything else raises ``ConfigError`` listing the choices.
"""

from __future__ import annotations

import difflib

from rollpacker.core.errors import ConfigError
from rollpacker.core.tasks import TaskExample

BUILTIN_TASKS: tuple[str, ...] = ("synthetic_math", "humaneval")
FILE_SUFFIXES: tuple[str, ...] = (".jsonl", ".jsonl.gz")


def load_task(name_or_path: str, seed: int = 0, num_examples: int | None = None) -> tuple[TaskExample, ...]:
    if num_examples is not None and num_examples < 1:
        raise ConfigError(f"num_examples = {num_examples}: must be >= 1 (or None for the whole task)")
    if name_or_path == "synthetic_math":
        from rollpacker.tasks import synthetic_math

        spec = (
            synthetic_math.SyntheticMathSpec()
            if num_examples is None
            else synthetic_math.SyntheticMathSpec(num_examples=num_examples)
        )
        return synthetic_math.generate(spec, seed)
    if name_or_path == "humaneval":
        from rollpacker.tasks.humaneval import load_humaneval

        examples = load_humaneval()
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
