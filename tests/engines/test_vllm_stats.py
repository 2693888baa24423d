"""The vLLM engine's stat collector: speculation counts, in all and per draft position, from vLLM's
own ``SchedulerStats`` / ``SpecDecodingStats`` (the objects its stat logger receives)."""

from __future__ import annotations

from rollpacker.core.metrics import acceptance_by_position
from rollpacker.engines.vllm_engine import SpecCounts, _StatsCollector


def _stats(drafts: list[tuple[int, int]], k: int = 3) -> object:
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    spec = SpecDecodingStats.new(k)
    for drafted, accepted in drafts:
        spec.observe_draft(drafted, accepted)
    return SchedulerStats(num_running_reqs=len(drafts), spec_decoding_stats=spec)


def test_the_collector_counts_drafts_per_position_between_takes() -> None:
    c = _StatsCollector()
    # step 1: drafts of 3 tokens (2 accepted) and 2 tokens (0 accepted); step 2: 1 token, accepted
    c.record(_stats([(3, 2), (2, 0)]), None)
    c.record(_stats([(1, 1)]), None)
    got = c.take_spec()
    assert got == SpecCounts(drafted=6, accepted=3, drafted_per_pos=(3, 2, 1), accepted_per_pos=(2, 1, 0))
    assert acceptance_by_position(got.drafted_per_pos, got.accepted_per_pos) == (2 / 3, 1 / 2, 0.0)
    assert c.take_spec() == SpecCounts(0, 0, (), ())  # taken: the next step starts from zero
