"""Every data-parallel replica busy: the stream trainer dispatches groups to all of the megatron
gang's replicas at once, balanced by tokens (``trainers/stream.py``, ``accumulate_on``).

The ranks are the outer edge here: sleeping fakes (Ray actors, as the real ranks) whose
``accumulate`` takes time in proportion to the chunk's tokens and records when it ran; the gang,
its placement group and the stream trainer are the real ones.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollpacker.core.config import MegatronConfig, TrainerConfig

pytestmark = pytest.mark.slow  # a local Ray and four actor processes (~15-30 s here)

SECONDS_PER_TOKEN = 0.01


class SleepingRank:
    """A rank of a TP=1, PP=1 gang that computes nothing: ``accumulate`` sleeps for the chunk's tokens
    and records (start, end, prompt ids)."""

    def __init__(self, spec: Any, rank: int) -> None:
        self.rank = rank
        self.spans: list[tuple[float, float, list[str]]] = []

    def coords(self) -> tuple[int, int, int]:
        return 0, 0, self.rank  # TP=1, PP=1: rank i is replica i

    def node(self) -> str:
        return "127.0.0.1"

    def reset_accum(self) -> None:
        pass

    def accumulate(self, samples: list[Any]) -> dict[str, float]:
        t0 = time.time()
        time.sleep(SECONDS_PER_TOKEN * sum(len(s.prompt_ids) + s.num_tokens for s in samples))
        self.spans.append((t0, time.time(), sorted({s.prompt_id for s in samples})))
        n = float(sum(s.num_tokens for s in samples))
        return {"loss_sum": 0.0, "clipped": 0.0, "ratio_sum": n, "kl_sum": 0.0, "bw_sum": n, "seconds": 0.0}

    def finish_step(self, denominator: float) -> dict[str, float]:
        return {"grad_norm": 0.0, "seconds": 0.0}

    def recorded(self) -> list[tuple[float, float, list[str]]]:
        return self.spans


def _max_concurrent(spans: dict[int, list[tuple[float, float, list[str]]]]) -> int:
    """The most replicas computing at one instant."""
    events = sorted(
        (t, +1 if start else -1) for r in spans.values() for a, b, _ in r for t, start in ((a, 1), (b, 0))
    )
    now = best = 0
    for _, step in events:  # an end sorts before a start at the same instant
        now += step
        best = max(best, now)
    return best


@pytest.fixture
def sleeping_gang(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    import ray

    from rollpacker.trainers.megatron import worker
    from rollpacker.trainers.megatron.gang import MegatronTrainer

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the fake goes to the actors by value
    monkeypatch.setattr(worker, "RankWorker", SleepingRank)
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 64,
        "tie_word_embeddings": True,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    started = not ray.is_initialized()
    cfg = TrainerConfig(
        backend="megatron", megatron=MegatronConfig(dp=4, optimizer="sgd", distributed_optimizer=False)
    )
    mt = MegatronTrainer(tmp_path, cfg, temperature=0.8)
    try:
        yield mt
    finally:
        mt.close()
        if started and ray.is_initialized():
            ray.shutdown()


def test_dp4_keeps_three_replicas_busy_with_16_queued_groups(sleeping_gang: Any) -> None:
    import ray

    from rollpacker.trainers.stream import StreamTrainer
    from tests.trainers.conftest import make_batch

    mt = sleeping_gang
    groups = make_batch(num_groups=16, group_size=2, seed=7)
    st = StreamTrainer(mt)
    try:
        for g in groups:  # as the trainer service submits them: one group at a time
            st.submit(g)
        report = st.finish()
    finally:
        st.close()
    spans = dict(enumerate(ray.get([a.recorded.remote() for a in mt.actors])))
    assert report.stats.samples == 32 and report.stats.optimizer_steps == 1
    # every group on exactly one replica
    placed = [p for r in spans.values() for _, _, ids in r for p in ids]
    assert sorted(placed) == sorted(g[0].prompt_id for g in groups)
    assert _max_concurrent(spans) >= 3, spans
    # balanced by tokens: the replicas' loads differ by at most one group
    cost = {g[0].prompt_id: sum(len(s.prompt_ids) + s.num_tokens for s in g) for g in groups}
    load = [sum(cost[p] for _, _, ids in r for p in ids) for r in spans.values()]
    assert max(load) - min(load) <= max(cost.values()), load
