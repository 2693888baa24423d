"""The rollout service keeps the draft history in the store: each round's responses by prompt,
bounded to ``history_prompts`` prompts' worth of steps; a restarted engine is seeded from the
newest; the partial-rollout cache is offered as drafts every round. (The engine here records what
it is given: that ``remember_drafts`` reaches the real proposer is tested in
tests/engines/test_speculation.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rollpacker.core.policies.entries import BufferEntry, CachedSample
from rollpacker.core.state import ControllerState
from rollpacker.core.types import Completion, FinishReason, Group, Prompt

CONFIG = """
experiment: dh
engine: {{speculation: {{enabled: {enabled}, history_prompts: 4, history_per_prompt: 2}}}}
rollout: {{prompts_per_step: 2, responses_per_prompt: 3}}
store: {{endpoint: "file://{root}"}}
"""


class _Recorder:
    def __init__(self) -> None:
        self.got: dict[str, list[list[int]]] = {}

    def remember_drafts(self, history: Any) -> int:
        for k, v in history.items():
            self.got.setdefault(k, []).extend(list(r) for r in v)
        return len(history)

    def forget_drafts(self) -> int:
        n, self.got = len(self.got), {}
        return n


def _service(tmp_path: Path, enabled: bool = True) -> Any:
    from rollpacker.services.rollout import RolloutService

    text = CONFIG.format(enabled=str(enabled).lower(), root=tmp_path / "store")
    svc = RolloutService(text, "tail_batching")
    svc.engine = _Recorder()
    return svc


def _group(prompt_id: str, step: int) -> Group:
    p = Prompt(prompt_id=prompt_id, token_ids=(1, 2))
    rs = tuple(
        Completion(f"s{step}/{prompt_id}/r{j}/a0", prompt_id, j, (step, j, 9), (0.0,) * 3, FinishReason.STOP)
        for j in range(3)
    )
    return Group(p, rs)


def test_rounds_persist_bounded_and_a_restarted_engine_takes_the_newest(tmp_path: Path) -> None:
    svc = _service(tmp_path)
    for step in range(4):
        svc._persist_drafts(step, [_group(f"p{step}", step), _group("shared", step)])
    keys = sorted(svc.store().list("dh/tail_batching/drafts/"))
    assert [k.split("/")[3] for k in keys] == ["step-000002", "step-000003"]
    restarted = _service(tmp_path)
    restarted._restore_drafts()
    got = restarted.engine.got
    assert sorted(got) == ["p2", "p3", "shared"]
    assert got["p3"] == [[3, 1, 9], [3, 2, 9]]  # the last history_per_prompt responses of the group
    assert got["shared"][-2:] == [[3, 1, 9], [3, 2, 9]]  # oldest first: the newest step is given last


def test_a_malformed_history_document_is_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    svc = _service(tmp_path)
    svc._persist_drafts(5, [_group("p5", 5)])
    svc.store().put_bytes("dh/tail_batching/drafts/step-000006/responses.json", b"{not json")
    restarted = _service(tmp_path)
    restarted._restore_drafts()
    assert list(restarted.engine.got) == ["p5"]
    assert "not a draft-history document" in caplog.text


def test_nothing_is_kept_with_speculation_off_and_the_partial_cache_is_offered(tmp_path: Path) -> None:
    off = _service(tmp_path, enabled=False)
    off._persist_drafts(0, [_group("p0", 0)])
    assert off.store().list("dh/") == []
    svc = _service(tmp_path)
    sample = CachedSample(sample_index=1, token_ids=(7, 8, 9), logprobs=(0.0,) * 3, versions=(0,) * 3)
    cache = (BufferEntry("q", loaded_step=0, samples=(sample,)), BufferEntry("empty", loaded_step=0))
    state = ControllerState("dh", "tail_batching", 0, 0, 0, 0, partial_cache=cache)
    svc._remember_cached(state)
    assert svc.engine.got == {"q": [[7, 8, 9]]}


def test_an_engine_without_draft_memory_is_offered_nothing(tmp_path: Path) -> None:
    """Draft memory is a capability (``engines.base.DraftMemory``) checked with ``isinstance``: an
    engine of the port without it (the fake) is skipped, with a history in the store or not."""
    from rollpacker.engines.base import DraftMemory, PrefixCache, RequestList, RolloutEngine
    from rollpacker.engines.fake import FakeEngine
    from rollpacker.engines.layout import forget_cached

    writer = _service(tmp_path)
    writer._persist_drafts(0, [_group("p0", 0)])
    svc = _service(tmp_path)
    svc.engine = fake = FakeEngine()
    assert isinstance(fake, RolloutEngine) and not isinstance(fake, DraftMemory | PrefixCache | RequestList)
    assert isinstance(_Recorder(), DraftMemory)
    sample = CachedSample(sample_index=0, token_ids=(1,), logprobs=(0.0,), versions=(0,))
    state = ControllerState(
        "dh", "tail_batching", 0, 0, 0, 0, partial_cache=(BufferEntry("q", 0, (sample,)),)
    )
    svc._restore_drafts()  # neither raises nor calls anything on the fake
    svc._remember_cached(state)
    forget_cached(fake)  # no prefix cache: nothing to do

    class _Cached:
        forgot = 0

        def forget_cached(self) -> None:
            self.forgot += 1

    cached = _Cached()
    forget_cached(cached)
    assert cached.forgot == 1
