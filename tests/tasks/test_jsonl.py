from __future__ import annotations

import gzip
import json

import pytest

from rollpacker.core.errors import ConfigError
from rollpacker.core.tasks import RewardKind, TaskExample
from rollpacker.tasks.jsonl import dump_jsonl, load_jsonl

EXAMPLES = (
    TaskExample("m1", "What is 3+4?", RewardKind.MATH, reference="7", metadata={"difficulty": 1}),
    TaskExample("m2", "Half of 1?", RewardKind.MATH, reference="\\frac{1}{2}"),
    TaskExample(
        "c1",
        "def add(a, b):\n",
        RewardKind.CODE,
        tests="def check(f):\n    assert f(1, 2) == 3\n\ncheck(add)\n",
        entry_point="add",
        metadata={"source": "mine", "tags": ["easy"], "nested": {"x": None, "ok": True}},
    ),
    TaskExample("c2", "print hi", RewardKind.CODE, tests="assert True"),
    TaskExample(
        "c3", "f?", RewardKind.CODE, tests=("assert f(1) == 2\n", "assert f(2) == 3\n"), entry_point="f"
    ),
    TaskExample("j1", "Explain TCP. é ✓", RewardKind.JUDGE, reference="A reliable byte stream."),
    TaskExample("j2", "Write a poem.", RewardKind.JUDGE),
)


def _same(a: tuple[TaskExample, ...], b: tuple[TaskExample, ...]) -> None:
    assert a == b
    assert [x.metadata for x in a] == [x.metadata for x in b]  # metadata is excluded from ==


@pytest.mark.parametrize("name", ["d.jsonl", "d.jsonl.gz"])
def test_round_trip(tmp_path, name) -> None:
    path = tmp_path / name
    dump_jsonl(EXAMPLES, path)
    _same(load_jsonl(path), EXAMPLES)
    first = path.read_bytes()
    dump_jsonl(load_jsonl(path), path)  # stable: same bytes again (gzip without a timestamp)
    assert path.read_bytes() == first
    assert not [p for p in tmp_path.iterdir() if p.name != name]  # no temporary file left
    if name.endswith(".gz"):
        assert gzip.decompress(first).decode().count("\n") == len(EXAMPLES)


def test_numbers_blank_lines_and_bom(tmp_path) -> None:
    path = tmp_path / "d.jsonl"
    lines = [
        '{"id": "a", "prompt": "p", "reward": "math", "answer": 72}',
        "",
        "   ",
        '{"id": "b", "prompt": "p", "reward": "math", "answer": 0.5, "metadata": {}}',
        '{"id": "c", "prompt": "p", "reward": "math", "answer": " -3 "}',
    ]
    path.write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode())
    a, b, c = load_jsonl(path)
    assert (a.reference, b.reference, c.reference) == ("72", "0.5", "-3")


def test_gsm8k_mapping(tmp_path) -> None:
    path = tmp_path / "gsm8k.jsonl"
    rows = [
        {
            "question": "Natalia sold 48 clips ... How many?",
            "answer": "48/2 = <<48/2=24>>24\n48+24 = 72\n#### 72",
        },
        {
            "question": "Q2?",
            "answer": "It is 1,000.\n#### 1,000",
            "id": "mine",
            "metadata": {"split": "test"},
        },
        {"question": "Q3?", "answer": "#### -5", "reward": "math"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n" + json.dumps(rows[2]) + "\n")
    a, b, c = load_jsonl(path)
    assert (a.example_id, b.example_id, c.example_id) == ("gsm8k-1", "mine", "gsm8k-4")  # line numbers
    assert a.prompt == rows[0]["question"] and a.reward_kind is RewardKind.MATH
    assert (a.reference, b.reference, c.reference) == ("72", "1,000", "-5")
    assert a.metadata == {"source": "gsm8k", "solution": "48/2 = <<48/2=24>>24\n48+24 = 72"}
    assert b.metadata == {"source": "gsm8k", "solution": "It is 1,000.", "split": "test"}
    out = tmp_path / "native.jsonl"
    dump_jsonl((a, b, c), out)  # dumps the native format, which loads back the same
    assert '"question"' not in out.read_text()
    _same(load_jsonl(out), (a, b, c))


GOOD = '{"id": "ok", "prompt": "p", "reward": "math", "answer": "1"}'
BAD_LINES = {
    "invalid_json": ('{"id": "x", "prompt": "p",', "invalid JSON"),
    "not_object": ('["id", "x"]', "not an object"),
    "missing_prompt": ('{"id": "x", "reward": "math", "answer": "1"}', "missing key 'prompt'"),
    "missing_id": ('{"prompt": "p", "reward": "math", "answer": "1"}', "missing key 'id'"),
    "missing_reward": ('{"id": "x", "prompt": "p", "answer": "1"}', "missing key 'reward'"),
    "missing_answer": ('{"id": "x", "prompt": "p", "reward": "math"}', "missing key 'answer'"),
    "missing_tests": ('{"id": "x", "prompt": "p", "reward": "code"}', "missing key 'tests'"),
    "id_not_string": ('{"id": 5, "prompt": "p", "reward": "math", "answer": "1"}', "'id' must be a string"),
    "prompt_not_string": (
        '{"id": "x", "prompt": ["p"], "reward": "math", "answer": "1"}',
        "'prompt' must be",
    ),
    "empty_prompt": ('{"id": "x", "prompt": "  ", "reward": "math", "answer": "1"}', "'prompt' is empty"),
    "answer_list": ('{"id": "x", "prompt": "p", "reward": "math", "answer": [1]}', "string or a number"),
    "answer_bool": ('{"id": "x", "prompt": "p", "reward": "math", "answer": true}', "string or a number"),
    "answer_nan": ('{"id": "x", "prompt": "p", "reward": "math", "answer": NaN}', "NaN is not a valid"),
    "answer_huge": ('{"id": "x", "prompt": "p", "reward": "math", "answer": 1e999}', "not a finite number"),
    "metadata_list": ('{"id": "x", "prompt": "p", "reward": "judge", "metadata": [1]}', "'metadata' must be"),
    "unknown_reward": ('{"id": "x", "prompt": "p", "reward": "maths", "answer": "1"}', "not a known reward"),
    "unknown_key": ('{"id": "x", "prompt": "p", "reward": "math", "answer": "1", "level": 3}', "'level'"),
    "other_kind_key": (
        '{"id": "x", "prompt": "p", "reward": "math", "answer": "1", "tests": "a"}',
        "'tests'",
    ),
    "duplicate_key": ('{"id": "x", "id": "y", "prompt": "p", "reward": "judge"}', "appears twice"),
    "tests_syntax": ('{"id": "x", "prompt": "p", "reward": "code", "tests": "assert ("}', "do not compile"),
    "entry_point": (
        '{"id": "x", "prompt": "p", "reward": "code", "tests": "a", "entry_point": "a b"}',
        "entry_po",
    ),
    "gsm8k_no_mark": ('{"question": "q", "answer": "72"}', "'####"),
    "gsm8k_empty_final": ('{"question": "q", "answer": "so #### "}', "nothing after"),
    "gsm8k_and_prompt": ('{"question": "q", "prompt": "p", "answer": "#### 1"}', "both 'question'"),
    "gsm8k_code": ('{"question": "q", "answer": "#### 1", "reward": "code"}', "math tasks"),
    "duplicate_id": ('{"id": "ok", "prompt": "q", "reward": "judge"}', "already used on line 2"),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_bad_line_names_file_and_line(tmp_path, case) -> None:
    bad, needle = BAD_LINES[case]
    path = tmp_path / "d.jsonl"
    path.write_text(f"\n{GOOD}\n{bad}\n{GOOD.replace('ok', 'ok2')}\n")  # the bad line is line 3
    with pytest.raises(ConfigError) as info:
        load_jsonl(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}:3: "), msg
    assert needle in msg, msg
    assert ";" in msg  # the problem, then what to do


def test_unknown_key_message_lists_allowed_keys(tmp_path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"id": "x", "prompt": "p", "reward": "code", "tests": "a", "level": 3}\n')
    with pytest.raises(ConfigError, match=r"unknown key 'level'.*entry_point.*metadata"):
        load_jsonl(path)


def test_file_level_errors(tmp_path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_jsonl(tmp_path / "missing.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(ConfigError, match="no examples"):
        load_jsonl(empty)
    fake_gz = tmp_path / "plain.jsonl.gz"
    fake_gz.write_text(GOOD + "\n")
    with pytest.raises(ConfigError, match=r"plain\.jsonl\.gz:1: cannot decompress"):
        load_jsonl(fake_gz)
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes((GOOD + "\n").encode() + '{"id": "é"}\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1\.jsonl:2: not valid UTF-8"):
        load_jsonl(latin1)


def test_gzipped_bad_line_is_located(tmp_path) -> None:
    path = tmp_path / "d.jsonl.gz"
    path.write_bytes(gzip.compress(f"{GOOD}\n{{oops\n".encode()))
    with pytest.raises(ConfigError, match=r"d\.jsonl\.gz:2: invalid JSON"):
        load_jsonl(path)


def test_dump_rejects_duplicates_and_unserializable_metadata(tmp_path) -> None:
    with pytest.raises(ConfigError, match="more than once"):
        dump_jsonl([EXAMPLES[0], EXAMPLES[0]], tmp_path / "d.jsonl")
    odd = TaskExample("m", "p", RewardKind.MATH, reference="1", metadata={"when": object()})
    with pytest.raises(ConfigError, match="'m': metadata is not JSON-serializable"):
        dump_jsonl([odd], tmp_path / "d.jsonl")
    assert not list(tmp_path.iterdir())


def test_tests_may_be_a_list_of_cases_and_each_case_must_compile(tmp_path) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text(
        json.dumps({"id": "c", "prompt": "p", "reward": "code", "tests": ["assert 1", "assert 2"]}) + "\n"
    )
    (ex,) = load_jsonl(p)
    assert ex.tests == ("assert 1", "assert 2") and ex.case_keys() == ("c/0", "c/1")
    p.write_text(
        json.dumps({"id": "c", "prompt": "p", "reward": "code", "tests": ["assert 1", "def ("]}) + "\n"
    )
    with pytest.raises(ConfigError, match=r"d\.jsonl:1:.*test case 1"):
        load_jsonl(p)
    p.write_text(json.dumps({"id": "c", "prompt": "p", "reward": "code", "tests": ["assert 1", ""]}) + "\n")
    with pytest.raises(ConfigError, match=r"d\.jsonl:1:.*empty or non-string case"):
        load_jsonl(p)
