from __future__ import annotations

import gzip
import json
import subprocess
import sys

import pytest

from rollpacker.core.errors import ConfigError
from rollpacker.core.tasks import RewardKind
from rollpacker.tasks.humaneval import NUM_PROBLEMS, default_path, load_humaneval


def test_loads_all_164_problems_in_order() -> None:
    exs = load_humaneval()
    assert len(exs) == NUM_PROBLEMS == 164
    assert [e.example_id for e in exs] == [f"HumanEval/{i}" for i in range(164)]
    for e in exs:
        assert e.reward_kind is RewardKind.CODE
        assert f"def {e.entry_point}(" in e.prompt
        assert len(e.tests) == 1 and "def check(" in e.tests[0]
        assert e.tests[0].rstrip().endswith(f"check({e.entry_point})")
        assert e.metadata["canonical_solution"].strip()
    assert exs[0].entry_point == "has_close_elements"


def test_canonical_solutions_pass_their_tests() -> None:
    """prompt + canonical solution + tests is a passing program: the tests really check."""
    exs = load_humaneval()
    code = (
        "import json, sys\n"
        "failed = []\n"
        "for p in json.load(sys.stdin):\n"
        "    try:\n"
        "        exec(p['prompt'] + p['solution'] + '\\n' + p['tests'], {'__name__': 'check'})\n"
        "    except BaseException as e:\n"
        "        failed.append(p['id'])\n"
        "    try:\n"
        "        exec(p['prompt'] + '    return None\\n' + '\\n' + p['tests'], {'__name__': 'check'})\n"
        "        failed.append(p['id'] + ' (a wrong solution passed)')\n"
        "    except BaseException:\n"
        "        pass\n"
        "print(json.dumps(failed))\n"
    )
    payload = [
        {
            "id": e.example_id,
            "prompt": e.prompt,
            "solution": e.metadata["canonical_solution"],
            "tests": e.tests[0],
        }
        for e in exs
    ]
    out = subprocess.run(
        [sys.executable, "-c", code], input=json.dumps(payload), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_missing_or_malformed_file(tmp_path) -> None:
    assert default_path().is_file()
    with pytest.raises(ConfigError, match="HumanEval data not found"):
        load_humaneval(tmp_path / "nope.jsonl.gz")
    bad = tmp_path / "he.jsonl.gz"
    row = {"task_id": "T/0", "prompt": "def f():\n", "test": "def check(c): pass", "entry_point": "f"}
    bad.write_bytes(gzip.compress((json.dumps(row) + "\n").encode()))
    with pytest.raises(ConfigError, match=r"he\.jsonl\.gz:1: .*'canonical_solution'"):
        load_humaneval(bad)
    row["canonical_solution"] = "    pass\n"
    bad.write_bytes(gzip.compress((json.dumps(row) + "\n" + json.dumps(row) + "\n").encode()))
    with pytest.raises(ConfigError, match=r":2: task_id 'T/0' was already used on line 1"):
        load_humaneval(bad)
