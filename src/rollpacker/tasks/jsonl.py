"""Users' datasets as JSON Lines: one task example per line (``.jsonl`` or gzipped ``.jsonl.gz``).

Format (the full description, with an example per kind, is in ``docs/tasks.md``)::

    {"id": "q1", "prompt": "What is 3+4?", "reward": "math", "answer": "7"}
    {"id": "c1", "prompt": "def add(a, b):\n", "reward": "code", "tests": "assert add(1, 2) == 3",
     "entry_point": "add"}
    {"id": "j1", "prompt": "Explain TCP.", "reward": "judge", "reference": "TCP is ..."}

Keys: ``id`` (string, unique), ``prompt`` (string), ``reward`` (``math`` | ``code`` | ``judge``),
then per kind: ``math`` needs ``answer`` (string or number, stored as ``TaskExample.reference``);
``code`` needs ``tests`` (Python source, or a list of test-case sources run in order, each with its
own timeout) and takes an optional ``entry_point``; ``judge`` takes an
optional ``reference``. Every kind takes an optional ``metadata`` object.

GSM8K convenience: a line with ``question`` (and no ``prompt``) is read in GSM8K's own format,
``{"question": ..., "answer": "...reasoning...\\n#### 72"}``: the question becomes the prompt, the
text after the last ``####`` the reference, the reward is ``math``, the id is ``gsm8k-<line>``
(the 1-based line number in the file) unless the line has an ``id``, and the reasoning before
``####`` is kept as ``metadata["solution"]`` (with ``metadata["source"] = "gsm8k"``).

Invariants:
- every returned example satisfies ``TaskExample``'s checks and ids are unique in the file;
- a bad line never passes silently: it raises ``ConfigError`` whose message starts with
  ``<file>:<line>:`` and says what is wrong and how to fix it (invalid JSON, not an object, a
  missing key, a key of the wrong type, an unknown reward kind, an unknown key — named —, a
  duplicate JSON key, a duplicate id — with the line of its first use —, non-finite numbers, code
  ``tests`` that do not compile);
- blank lines are skipped but still counted, so line numbers match an editor's;
- ``load_jsonl(p)`` after ``dump_jsonl(examples, p)`` gives back ``examples`` with equal metadata;
  ``dump_jsonl`` writes the canonical keys (never the GSM8K form) and replaces ``p`` atomically.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from rollpacker.core.errors import ConfigError
from rollpacker.core.tasks import RewardKind, TaskExample, check_unique

COMMON_KEYS: tuple[str, ...] = ("id", "prompt", "reward", "metadata")
KIND_KEYS: dict[RewardKind, tuple[str, ...]] = {
    RewardKind.MATH: ("answer",),
    RewardKind.CODE: ("tests", "entry_point"),
    RewardKind.JUDGE: ("reference",),
}
REQUIRED_KIND_KEYS: dict[RewardKind, tuple[str, ...]] = {
    RewardKind.MATH: ("answer",),
    RewardKind.CODE: ("tests",),
    RewardKind.JUDGE: (),
}
GSM8K_KEYS: tuple[str, ...] = ("id", "question", "answer", "reward", "metadata")
GSM8K_MARK = "####"

_KINDS = ", ".join(repr(k.value) for k in RewardKind)
_EXAMPLE_LINE = '{"id": "q1", "prompt": "What is 3+4?", "reward": "math", "answer": "7"}'


class _LineError(Exception):
    """A problem with one line; ``iter_json_objects`` / ``load_jsonl`` prefix it with file:line."""


def is_gzip(path: str | os.PathLike[str]) -> bool:
    return str(path).endswith(".gz")


def _reject_constant(name: str) -> Any:
    raise _LineError(f"{name} is not a valid number here; write a finite number or a string")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _LineError(f"key {k!r} appears twice in one object; keep one of them")
        out[k] = v
    return out


def iter_json_objects(path: str | os.PathLike[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line number, object)`` for each non-blank line of a (gzipped) JSON Lines file.

    Raises ``ConfigError`` naming ``file:line`` for unreadable bytes, invalid JSON, a value that is
    not an object, duplicate keys and NaN/Infinity; and naming the file when it is missing or not
    valid gzip.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(
            f"{p}: dataset file not found (or not a regular file); check the path "
            f"(relative paths are resolved from {Path.cwd()})"
        )
    lineno = 0
    try:
        with gzip.open(p, "rb") if is_gzip(p) else p.open("rb") as f:
            for lineno, raw in enumerate(f, start=1):
                if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):  # UTF-8 byte order mark
                    raw = raw[3:]
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ConfigError(
                        f"{p}:{lineno}: not valid UTF-8 (byte {e.start + 1} of the line); "
                        "save the file as UTF-8"
                    ) from None
                if not text.strip():
                    continue
                try:
                    obj = json.loads(
                        text, object_pairs_hook=_no_duplicate_keys, parse_constant=_reject_constant
                    )
                except _LineError as e:
                    raise ConfigError(f"{p}:{lineno}: {e}") from None
                except json.JSONDecodeError as e:
                    raise ConfigError(
                        f"{p}:{lineno}: invalid JSON ({e.msg} at column {e.colno}); each line must be "
                        f"one complete JSON object, e.g. {_EXAMPLE_LINE}"
                    ) from None
                if not isinstance(obj, dict):
                    raise ConfigError(
                        f"{p}:{lineno}: the line is a JSON {type(obj).__name__}, not an object; each "
                        f"line must be one JSON object, e.g. {_EXAMPLE_LINE}"
                    )
                yield lineno, obj
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise ConfigError(
            f"{p}:{lineno + 1}: cannot decompress ({e}); the file ends in .gz but is not a complete "
            "gzip file: re-compress it with `gzip`, or drop the .gz suffix if it is plain text"
        ) from None


def _type_name(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def _get_str(obj: dict[str, Any], key: str, *, required: bool, non_empty: bool) -> str:
    if key not in obj:
        if required:
            raise _LineError(f"missing key {key!r}; add it (see docs/tasks.md for the format)")
        return ""
    v = obj[key]
    if not isinstance(v, str):
        raise _LineError(f"key {key!r} must be a string, got {_type_name(v)} {json.dumps(v)[:60]}; quote it")
    if non_empty and not v.strip():
        raise _LineError(f"key {key!r} is empty; give it a non-empty value")
    return v


def _get_tests(obj: dict[str, Any]) -> tuple[str, ...]:
    """``tests``: one case as a string, or several as a non-empty list of strings."""
    v = obj.get("tests")
    if isinstance(v, str):
        return (_get_str(obj, "tests", required=True, non_empty=True),)
    if isinstance(v, list) and v and all(isinstance(t, str) and t.strip() for t in v):
        return tuple(v)
    raise _LineError(
        f"'tests' must be Python source (a string) or a non-empty list of test-case sources, got "
        f"{_type_name(v)}{' with an empty or non-string case' if isinstance(v, list) and v else ''}"
    )


def _get_metadata(obj: dict[str, Any]) -> dict[str, Any]:
    v = obj.get("metadata", {})
    if not isinstance(v, dict):
        raise _LineError(
            f"key 'metadata' must be a JSON object, got {_type_name(v)}; write e.g. "
            '"metadata": {"source": "mine"}'
        )
    return dict(v)


def _get_answer(obj: dict[str, Any]) -> str:
    if "answer" not in obj:
        raise _LineError("missing key 'answer' (math lines need the final answer); add it")
    v = obj["answer"]
    if isinstance(v, bool) or not isinstance(v, str | int | float):
        raise _LineError(
            f"key 'answer' must be a string or a number, got {_type_name(v)} {json.dumps(v)[:60]}; "
            'write the final answer, e.g. "answer": "7"'
        )
    if isinstance(v, float) and not math.isfinite(v):
        raise _LineError(f"key 'answer' is {v!r}, which is not a finite number; write the answer as a string")
    text = v.strip() if isinstance(v, str) else repr(v)
    if not text:
        raise _LineError("key 'answer' is empty; give the final answer")
    return text


def _check_keys(obj: dict[str, Any], allowed: tuple[str, ...], what: str) -> None:
    for k in obj:
        if k in allowed:
            continue
        owner = [kind.value for kind, keys in KIND_KEYS.items() if k in keys]
        if owner and what != "gsm8k":
            raise _LineError(
                f"key {k!r} belongs to reward {owner[0]!r} lines, not {what!r}; remove it or fix 'reward'"
            )
        raise _LineError(
            f"unknown key {k!r}; {what} lines take only {', '.join(allowed)}: "
            "move extra fields under 'metadata'"
        )


def _parse_gsm8k(obj: dict[str, Any], lineno: int) -> TaskExample:
    if "prompt" in obj:
        raise _LineError(
            "the line has both 'question' (GSM8K format) and 'prompt'; keep one: 'question' + "
            "'answer' for GSM8K lines, or 'prompt' + 'reward' + ... for the native format"
        )
    _check_keys(obj, GSM8K_KEYS, "gsm8k")
    if "reward" in obj and obj["reward"] != RewardKind.MATH.value:
        raise _LineError(
            f"GSM8K lines ('question' + 'answer') are math tasks, but 'reward' is {obj['reward']!r}; "
            "drop 'reward' or use the native format"
        )
    question = _get_str(obj, "question", required=True, non_empty=True)
    answer = _get_str(obj, "answer", required=True, non_empty=True)
    if GSM8K_MARK not in answer:
        raise _LineError(
            f"GSM8K 'answer' has no '{GSM8K_MARK} <final answer>' marker; end it with e.g. "
            f"'{GSM8K_MARK} 72', or use the native format with reward 'math'"
        )
    solution, final = answer.rsplit(GSM8K_MARK, 1)
    final = final.strip()
    if not final:
        raise _LineError(f"GSM8K 'answer' has nothing after '{GSM8K_MARK}'; put the final answer there")
    example_id = _get_str(obj, "id", required=False, non_empty=True) or f"gsm8k-{lineno}"
    metadata = {"source": "gsm8k", "solution": solution.strip(), **_get_metadata(obj)}
    return TaskExample(
        example_id=example_id,
        prompt=question,
        reward_kind=RewardKind.MATH,
        reference=final,
        metadata=metadata,
    )


def _parse_native(obj: dict[str, Any]) -> TaskExample:
    if "reward" not in obj:
        raise _LineError(f"missing key 'reward' (one of {_KINDS}); add it")
    reward = obj["reward"]
    kinds = {k.value: k for k in RewardKind}
    if not isinstance(reward, str) or reward not in kinds:
        raise _LineError(f"reward {json.dumps(reward)[:60]} is not a known reward kind; use one of {_KINDS}")
    kind = kinds[reward]
    _check_keys(obj, COMMON_KEYS + KIND_KEYS[kind], kind.value)
    for key in ("id", "prompt", *REQUIRED_KIND_KEYS[kind]):
        if key not in obj:
            raise _LineError(
                f"missing key {key!r} ({kind.value!r} lines need "
                f"{', '.join(('id', 'prompt', 'reward', *REQUIRED_KIND_KEYS[kind]))}); add it"
            )
    example_id = _get_str(obj, "id", required=True, non_empty=True)
    prompt = _get_str(obj, "prompt", required=True, non_empty=True)
    metadata = _get_metadata(obj)
    if kind is RewardKind.MATH:
        return TaskExample(example_id, prompt, kind, reference=_get_answer(obj), metadata=metadata)
    if kind is RewardKind.CODE:
        tests = _get_tests(obj)
        entry_point = _get_str(obj, "entry_point", required=False, non_empty=False)
        if entry_point and not entry_point.isidentifier():
            raise _LineError(
                f"'entry_point' {entry_point!r} is not a Python identifier; give the function name "
                'the tests call, e.g. "entry_point": "add"'
            )
        for i, case in enumerate(tests):
            try:
                compile(case, f"<tests of {example_id}>", "exec")
            except SyntaxError as e:
                which = f"test case {i}" if len(tests) > 1 else "the tests"
                raise _LineError(
                    f"'tests' do not compile ({e.msg}, line {e.lineno} of {which}); fix the test source"
                ) from None
        return TaskExample(example_id, prompt, kind, tests=tests, entry_point=entry_point, metadata=metadata)
    reference = _get_str(obj, "reference", required=False, non_empty=False)
    return TaskExample(example_id, prompt, kind, reference=reference, metadata=metadata)


def _example_from_json(obj: dict[str, Any], lineno: int) -> TaskExample:
    """One line's object as a ``TaskExample``; raises ``_LineError`` (without file:line)."""
    if "question" in obj:
        return _parse_gsm8k(obj, lineno)
    return _parse_native(obj)


def example_to_json(example: TaskExample) -> dict[str, Any]:
    """The canonical JSON object of an example: what ``dump_jsonl`` writes for it."""
    out: dict[str, Any] = {
        "id": example.example_id,
        "prompt": example.prompt,
        "reward": example.reward_kind.value,
    }
    if example.reward_kind is RewardKind.MATH:
        out["answer"] = example.reference
    elif example.reward_kind is RewardKind.CODE:
        out["tests"] = example.tests[0] if len(example.tests) == 1 else list(example.tests)
        if example.entry_point:
            out["entry_point"] = example.entry_point
    elif example.reference:
        out["reference"] = example.reference
    if example.metadata:
        out["metadata"] = example.metadata
    return out


def load_jsonl(path: str | os.PathLike[str]) -> tuple[TaskExample, ...]:
    """Read a dataset written in the JSON Lines format above (``.jsonl`` or ``.jsonl.gz``)."""
    p = Path(path)
    examples: list[TaskExample] = []
    first_line: dict[str, int] = {}
    for lineno, obj in iter_json_objects(p):
        try:
            ex = _example_from_json(obj, lineno)
        except _LineError as e:
            raise ConfigError(f"{p}:{lineno}: {e}") from None
        except ValueError as e:  # TaskExample's own checks
            raise ConfigError(f"{p}:{lineno}: {e}; fix the line") from None
        if ex.example_id in first_line:
            raise ConfigError(
                f"{p}:{lineno}: id {ex.example_id!r} was already used on line "
                f"{first_line[ex.example_id]}; ids must be unique: rename one of them"
            )
        first_line[ex.example_id] = lineno
        examples.append(ex)
    if not examples:
        raise ConfigError(
            f"{p}: the file has no examples (it is empty or blank); add one JSON object per line"
        )
    return tuple(examples)


def dump_jsonl(examples: Iterable[TaskExample], path: str | os.PathLike[str]) -> None:
    """Write ``examples`` in the canonical format (gzipped when ``path`` ends in ``.gz``).

    The file is written next to ``path`` and renamed over it, so a reader never sees half a file.
    Gzipped output is byte-for-byte deterministic (no timestamp in the header).
    """
    exs = list(examples)
    p = Path(path)
    check_unique(exs, where=str(p))
    lines = []
    for ex in exs:
        try:
            lines.append(json.dumps(example_to_json(ex), ensure_ascii=False, allow_nan=False))
        except (TypeError, ValueError) as e:
            raise ConfigError(
                f"example {ex.example_id!r}: metadata is not JSON-serializable ({e}); keep metadata "
                "to strings, finite numbers, booleans, null, lists and objects"
            ) from None
    data = ("\n".join(lines) + "\n").encode("utf-8") if lines else b""
    if is_gzip(p):
        data = gzip.compress(data, mtime=0)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, p)
    finally:
        tmp.unlink(missing_ok=True)
