from __future__ import annotations

import pytest

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
