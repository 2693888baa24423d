from __future__ import annotations

import pytest

from rollpacker.core.errors import TraceError
from rollpacker.core.trace import PRESETS, check_serves, generate, length_stats, parse_lines


def test_malformed_lines_are_named() -> None:
    good = '{"prompt_id": "a", "prompt_len": 3, "response_lens": [5, 6]}'
    cases = [
        ("{not json", "t.jsonl:2: not valid JSON"),
        ('{"prompt_id": "b", "prompt_len": 0, "response_lens": [1]}', "t.jsonl:2: field 'prompt_len'"),
        (
            '{"prompt_id": "b", "prompt_len": 2, "response_lens": [1, -4]}',
            r"response_lens\[1\] of prompt 'b'",
        ),
        ('{"prompt_id": "b", "prompt_len": 2, "response_lens": []}', "field 'response_lens'"),
        ('{"prompt_id": "a", "prompt_len": 2, "response_lens": [3]}', "already used on line 1"),
        ('{"prompt_id": "b", "prompt_len": 2, "response_lens": [3], "x": 1}', r"unknown field\(s\) \['x'\]"),
        ("[1, 2]", "expected a JSON object"),
    ]
    for bad, msg in cases:
        with pytest.raises(TraceError, match=msg):
            parse_lines([good, bad], source="t.jsonl")


def test_too_few_response_lens_names_the_prompt() -> None:
    recs = parse_lines(['{"prompt_id": "short", "prompt_len": 3, "response_lens": [5, 6, 7, 8]}'])
    check_serves(recs, 4)
    with pytest.raises(TraceError, match=r"prompt .short. has 4 response_lens.*launch 5"):
        check_serves(recs, 5)


def test_generator_is_deterministic_and_round_trips() -> None:
    a = generate(PRESETS["smoke"], seed=7)
    assert a == generate(PRESETS["smoke"], seed=7)
    assert a != generate(PRESETS["smoke"], seed=8)
    assert parse_lines([r.to_json() for r in a]) == a


def test_default_preset_has_a_paper_shaped_tail() -> None:
    st = length_stats(generate(PRESETS["paper-cpu"]), 5)
    # P75 an order of magnitude below the max, as in the papers' traces.
    assert st["max"] / st["p75"] >= 8
    assert st["max"] == PRESETS["paper-cpu"].max_len


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_sortedrl_preset_has_the_papers_length_statistics(seed: int) -> None:
    """SortedRL sec. 2.3: 80 % of responses within 3k of the 8k limit, ~5 % reach the limit."""
    p = PRESETS["sortedrl-cpu"]
    first = sorted(r.response_lens[0] for r in generate(p, seed=seed))
    p80 = first[int(0.8 * len(first))]
    at_max = sum(x == p.max_len for x in first) / len(first)
    assert 0.3 <= p80 / p.max_len <= 3 / 8 + 0.02
    assert 0.03 <= at_max <= 0.08
    assert len(first) >= 2 * 4 * 128 + 256  # two groups at the paper's batch, and tail batching's extra
