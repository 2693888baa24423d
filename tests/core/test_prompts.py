from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from rollpacker.core.errors import PolicyError
from rollpacker.core.prompts import LongPromptQueue, PromptCursor
from tests.conftest import make_prompts


def test_cursor_resumes_exactly_from_its_state() -> None:
    prompts = make_prompts([[1]] * 7)
    a = PromptCursor(prompts, seed=3)
    a.advance(5)
    b = PromptCursor(prompts, state=a.state)
    assert a.peek(9) == b.peek(9)
    # An epoch is a permutation; the next epoch is reshuffled.
    c = PromptCursor(prompts, seed=3)
    ep0, ep1 = c.peek(7), c.peek(14)[7:]
    assert sorted(p.prompt_id for p in ep0) == sorted(p.prompt_id for p in prompts)
    assert [p.prompt_id for p in ep0] != [p.prompt_id for p in ep1]


def test_cursor_epoch_limit_and_duplicates() -> None:
    prompts = make_prompts([[1]] * 3)
    c = PromptCursor(prompts, shuffle=False, epochs=1)
    c.advance(3)
    with pytest.raises(PolicyError, match="used up"):
        c.peek(1)
    with pytest.raises(PolicyError, match="appears more than once"):
        PromptCursor(prompts + prompts[:1])


def test_queue_is_fifo_and_refuses_duplicates() -> None:
    p = make_prompts([[1]] * 4)
    q = LongPromptQueue(p[:2])
    q.push(p[2:])
    assert [x.prompt_id for x in q.pop(3)] == ["p000", "p001", "p002"]
    with pytest.raises(PolicyError, match="already in the long-prompt queue"):
        q.push(p[3:])
    with pytest.raises(PolicyError, match="holds 1 prompts"):
        q.pop(2)


def _draws(cursor: PromptCursor, sizes: list[int]) -> list[list[str]]:
    out = []
    for n in sizes:
        out.append([p.prompt_id for p in cursor.peek(n)])
        cursor.advance(n)
    return out


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(2, 40),
    w=st.integers(1, 20),
    seed=st.integers(0, 10_000),
    sizes=st.lists(st.integers(1, 20), min_size=1, max_size=30),
)
def test_cursor_window_draws_are_distinct_across_epochs(n, w, seed, sizes) -> None:
    assume(n >= 2 * w)
    prompts = make_prompts([[1]] * n)
    sizes = [min(s, w) for s in sizes]
    cursor = PromptCursor(prompts, seed=seed, window=w)
    flat = [pid for d in _draws(cursor, sizes) for pid in d]
    # every `w` consecutive prompts are distinct, so no round of <= w prompts repeats one
    for i in range(max(0, len(flat) - w + 1)):
        assert len(set(flat[i : i + w])) == len(flat[i : i + w])
    # every full epoch is still a permutation of the prompt set
    for e in range(len(flat) // n):
        assert sorted(flat[e * n : (e + 1) * n]) == sorted(p.prompt_id for p in prompts)
    # and a cursor rebuilt from the state continues identically
    again = PromptCursor(prompts, seed=seed, window=w, state=cursor.state)
    assert again.peek(3 * n) == cursor.peek(3 * n)


def test_without_a_window_a_round_can_repeat_a_prompt() -> None:
    """The failure the window prevents: draws of 16 over 20 prompts repeat one within a draw."""
    prompts = make_prompts([[1]] * 20)
    plain = _draws(PromptCursor(prompts, seed=0), [16] * 10)
    assert any(len(set(d)) < len(d) for d in plain)
    fixed = _draws(PromptCursor(prompts, seed=0, window=10), [10] * 16)
    assert all(len(set(d)) == len(d) for d in fixed)
    with pytest.raises(PolicyError, match="need >= 32"):
        PromptCursor(prompts, window=16)
