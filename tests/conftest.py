"""Shared fixtures: small traces and prompt helpers."""

from __future__ import annotations

import pytest

from rollpacker.core.trace import TraceRecord, to_prompts
from rollpacker.core.types import Prompt

pytest_plugins = ["tests.budget"]  # the suite's time budget under `make test`


def make_prompts(lens: list[list[int]], prefix: str = "p") -> list[Prompt]:
    recs = [
        TraceRecord(prompt_id=f"{prefix}{i:03d}", prompt_len=4 + i % 5, response_lens=tuple(ls))
        for i, ls in enumerate(lens)
    ]
    return to_prompts(recs, vocab_size=259)


@pytest.fixture
def prompts_factory():
    return make_prompts
