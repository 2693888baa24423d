"""Rollout metrics computed from engine events (pure maths, no engine).

Bubble ratio (SortedRL, eq. 4): ``sum_k (Q - r_k) * dt_k / (T * Q)`` where ``Q`` is the engine's
concurrency limit, ``r_k`` the requests running in engine step ``k``, ``dt_k`` its duration and ``T``
the round's elapsed time. Time between engine steps (the runtime's own work, idle waits) counts
as ``r = 0``: it is bubble too.

Invariants:
- ``0 <= bubble_ratio <= 1``; a round that keeps ``Q`` requests running all the time has 0;
- ``tokens_generated == tokens_useful + tokens_wasted + tokens_cached``;
- ``policy_lag`` is 0 for a round that trains only tokens sampled by the weights it trains from.

Two throughputs, never one for the other (``Throughput``): **output tokens/s** counts every token
the engine generated (terminated, scavenged and cached ones included), as SortedRL's section 4.4.1
measures its engine; **trained tokens/s** counts only the tokens of the responses an update trains
(resumed tokens included), with **seconds per trained step**, as rollpacker's speedups do. A policy
that regenerates what it terminates raises the first and not the second; ``wasted_share`` says by
how much.

Off-policy degree (``policy_lag``): the token-weighted mean of ``v_train - v_token`` over the trained
response tokens, where ``v_token`` is the policy version that sampled the token (resumed tokens keep
theirs) and ``v_train`` the version of the weights the update is computed from.
- response-length statistics are over the trained responses only.

Acceptance per draft position (``acceptance_by_position``): at position ``i`` (1 = the first drafted
token) the drafts whose tokens ``1..i`` were all accepted over the drafts that reached position
``i``, as vLLM counts them; so it is the chance a draft survives to ``i``, never above position
``i - 1``'s when every draft has the same length. Positions nothing was drafted at are 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rollpacker.core.types import EngineStepStats, RoundKind, RoundResult


def bubble_ratio(steps: Sequence[EngineStepStats], total_time_s: float, concurrency: int) -> float:
    """SortedRL's eq. 4 over one rollout of ``total_time_s`` seconds."""
    if concurrency < 1:
        raise ValueError(f"concurrency (Q) must be >= 1, got {concurrency}")
    if total_time_s <= 0:
        return 0.0
    busy = sum(min(s.num_running, concurrency) * s.duration_s for s in steps)
    return min(1.0, max(0.0, 1.0 - busy / (total_time_s * concurrency)))


@dataclass(frozen=True)
class BubbleParts:
    """Where eq. 4's idle slot-seconds of a rollout went: ``outside_steps``, the share of the
    rollout's time with no engine step running (the driver's work between steps: launching and
    aborting requests, a round's start and end), and ``under_filled``, the slots left empty during
    engine steps (fewer than ``Q`` requests running). They sum to ``bubble_ratio``."""

    outside_steps: float
    under_filled: float


def bubble_parts(steps: Sequence[EngineStepStats], total_time_s: float, concurrency: int) -> BubbleParts:
    """``bubble_ratio``'s two parts (``BubbleParts``): the time outside engine steps, and the rest
    of the ratio; engine steps that overran ``total_time_s`` (a clock's rounding) leave no time
    outside."""
    total = bubble_ratio(steps, total_time_s, concurrency)
    if total_time_s <= 0:
        return BubbleParts(0.0, 0.0)
    outside = min(total, max(0.0, total_time_s - sum(s.duration_s for s in steps)) / total_time_s)
    return BubbleParts(outside, total - outside)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method); 0.0 for no values."""
    if not values:
        return 0.0
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class RolloutMetrics:
    """One step's rollout, in the names it is logged under (``rollout/<name>``)."""

    step: int
    round_kind: RoundKind
    time_s: float
    engine_steps: int
    groups: int
    responses: int
    response_len_max: int
    response_len_mean: float
    response_len_p75: float
    tokens_generated: int
    tokens_useful: int
    tokens_wasted: int
    aborted_requests: int
    preemptions: int
    bubble_ratio: float
    concurrency: int
    tokens_cached: int = 0  # generated now, kept for a later step (partial modes)
    policy_lag: float = 0.0  # token-weighted version lag of the trained tokens
    policy_lag_max: int = 0
    off_policy_frac: float = 0.0  # fraction of trained tokens from an older version
    # speculative decoding of the tail (engine.speculation; 0 when off)
    spec_steps: int = 0  # engine steps that verified drafted tokens
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_draft_s: float = 0.0  # seconds spent drafting
    tokens_trained: int = 0  # tokens of the trained responses, resumed ones included
    spec_draft_tokens_per_pos: tuple[int, ...] = ()  # drafts that reached each draft position
    spec_accepted_tokens_per_pos: tuple[int, ...] = ()  # drafts accepted up to each position

    @property
    def spec_acceptance(self) -> float:
        """The share of drafted tokens the target model accepted (0 when nothing was drafted)."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def spec_acceptance_by_position(self) -> tuple[float, ...]:
        """Acceptance at draft positions 1, 2, ... (the module docstring)."""
        return acceptance_by_position(self.spec_draft_tokens_per_pos, self.spec_accepted_tokens_per_pos)

    def as_dict(self) -> dict[str, float | int | str | tuple[int, ...]]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def logged(self, long_queue_size: int) -> dict[str, float]:
        """The step's ``rollout/*`` metrics as logged to MLflow (round kind as a number:
        0 standard, 1 short, 2 long)."""
        return {
            "rollout/time_s": self.time_s,
            "rollout/bubble_ratio": self.bubble_ratio,
            "rollout/max_response_len": float(self.response_len_max),
            "rollout/mean_response_len": self.response_len_mean,
            "rollout/tokens_generated": float(self.tokens_generated),
            "rollout/tokens_wasted": float(self.tokens_wasted),
            "rollout/tokens_trained": float(self.tokens_trained),
            "rollout/aborted": float(self.aborted_requests),
            "rollout/preemptions": float(self.preemptions),
            "rollout/round_kind": float(ROUND_CODE[self.round_kind]),
            "rollout/long_queue_size": float(long_queue_size),
            "rollout/tokens_cached": float(self.tokens_cached),
            "rollout/policy_lag": self.policy_lag,
            "rollout/policy_lag_max": float(self.policy_lag_max),
            "rollout/off_policy_frac": self.off_policy_frac,
            "rollout/spec_steps": float(self.spec_steps),
            "rollout/spec_acceptance": self.spec_acceptance,
            "rollout/spec_accepted_per_step": (
                self.spec_accepted_tokens / self.spec_steps if self.spec_steps else 0.0
            ),
            "rollout/spec_draft_s": self.spec_draft_s,
            **{
                f"rollout/spec_acceptance_pos{i}": a
                for i, a in enumerate(self.spec_acceptance_by_position, start=1)
            },
        }


@dataclass(frozen=True)
class Throughput:
    """A rollout's two throughputs side by side (see the module docstring): they are different
    measurements and are named so that neither is read as the other."""

    output_tokens_per_s: float  # every generated token / rollout seconds (SortedRL's figure)
    trained_tokens_per_s: float  # tokens of the trained responses / rollout seconds (rollpacker's)
    s_per_trained_step: float  # rollout seconds per trained step
    wasted_share: float  # tokens generated then thrown away, share of all generated

    def as_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def throughput(generated: int, trained: int, wasted: int, time_s: float, steps: int) -> Throughput:
    """The throughputs of ``steps`` trained steps that took ``time_s`` rollout seconds."""
    if min(generated, trained, wasted, steps) < 0 or time_s < 0 or wasted > generated:
        raise ValueError(
            f"throughput of {generated} generated, {trained} trained, {wasted} wasted tokens in "
            f"{steps} steps and {time_s} s: counts must be >= 0 and wasted <= generated"
        )
    per_s = 1.0 / time_s if time_s > 0 else 0.0
    return Throughput(
        output_tokens_per_s=generated * per_s,
        trained_tokens_per_s=trained * per_s,
        s_per_trained_step=time_s / steps if steps else 0.0,
        wasted_share=wasted / generated if generated else 0.0,
    )


# the round kind as a number MLflow can plot (one per kind: a new kind gets the next number)
ROUND_CODE: dict[RoundKind, int] = {
    RoundKind.STANDARD: 0,
    RoundKind.SHORT: 1,
    RoundKind.LONG: 2,
    RoundKind.SORTED: 3,
    RoundKind.PARTIAL: 4,
}


@dataclass(frozen=True)
class PolicyLag:
    """The off-policy degree of a batch of trained tokens."""

    mean: float  # token-weighted mean of v_train - v_token
    max: int
    off_policy_frac: float  # tokens with v_token < v_train, over all tokens
    tokens: int

    def logged(self, prefix: str) -> dict[str, float]:
        return {
            f"{prefix}/policy_lag": self.mean,
            f"{prefix}/policy_lag_max": float(self.max),
            f"{prefix}/off_policy_frac": self.off_policy_frac,
        }


def policy_lag(token_versions: Iterable[Sequence[int]], train_version: int) -> PolicyLag:
    """The lag of every token of every sequence against ``train_version``.

    A token from a *newer* version than the update's weights is a bug (the trainer would learn
    from its own future) and raises ``ValueError``.
    """
    total = lag_sum = off = worst = 0
    for versions in token_versions:
        for v in versions:
            lag = train_version - v
            if lag < 0:
                raise ValueError(
                    f"a token sampled by policy version {v} is trained from version {train_version}: "
                    "rollout weights are ahead of the trainer's"
                )
            total += 1
            lag_sum += lag
            off += lag > 0
            worst = max(worst, lag)
    if not total:
        return PolicyLag(0.0, 0, 0.0, 0)
    return PolicyLag(lag_sum / total, worst, off / total, total)


def sum_per_position(rows: Iterable[Sequence[int]]) -> tuple[int, ...]:
    """Element-wise sum of per-position counts of different lengths (missing positions count 0)."""
    out: list[int] = []
    for row in rows:
        if len(row) > len(out):
            out.extend([0] * (len(row) - len(out)))
        for i, n in enumerate(row):
            out[i] += n
    return tuple(out)


def acceptance_by_position(drafted: Sequence[int], accepted: Sequence[int]) -> tuple[float, ...]:
    """Accepted over drafted at each draft position (0 where nothing was drafted)."""
    if len(accepted) > len(drafted):
        raise ValueError(f"accepted counts for {len(accepted)} positions, drafted for only {len(drafted)}")
    padded = [*accepted, *([0] * (len(drafted) - len(accepted)))]
    for i, (d, a) in enumerate(zip(drafted, padded, strict=True), start=1):
        if not 0 <= a <= d:
            raise ValueError(f"draft position {i}: {a} accepted of {d} drafted")
    return tuple(a / d if d else 0.0 for d, a in zip(drafted, padded, strict=True))


def rollout_metrics(
    result: RoundResult,
    steps: Sequence[EngineStepStats],
    time_s: float,
    concurrency: int,
    preemptions: int,
    train_version: int | None = None,
) -> RolloutMetrics:
    """Summarise a committed round from its result and the engine steps it took; the lag is
    against ``train_version`` (default: the newest version among the trained tokens)."""
    lens = [c.num_tokens for g in result.groups for c in g.responses]
    useful = sum(c.num_tokens - c.resumed_tokens for g in result.groups for c in g.responses)
    wasted = sum(c.num_tokens - c.resumed_tokens for c in result.discarded)
    cached = sum(c.num_tokens - c.resumed_tokens for c in result.cached)
    versions = [c.token_versions for g in result.groups for c in g.responses]
    if train_version is None:
        train_version = max((max(v) for v in versions if v), default=0)
    lag = policy_lag(versions, train_version)
    return RolloutMetrics(
        step=result.plan.step,
        round_kind=result.plan.round_kind,
        time_s=time_s,
        engine_steps=len(steps),
        groups=len(result.groups),
        responses=len(lens),
        response_len_max=max(lens, default=0),
        response_len_mean=sum(lens) / len(lens) if lens else 0.0,
        response_len_p75=percentile(lens, 75),
        tokens_generated=useful + wasted + cached,
        tokens_useful=useful,
        tokens_wasted=wasted,
        aborted_requests=sum(1 for c in result.discarded if not c.finish_reason.is_natural),
        preemptions=preemptions,
        bubble_ratio=bubble_ratio(steps, time_s, concurrency),
        concurrency=concurrency,
        tokens_cached=cached,
        policy_lag=lag.mean,
        policy_lag_max=lag.max,
        off_policy_frac=lag.off_policy_frac,
        spec_steps=sum(1 for s in steps if s.spec_draft_tokens),
        spec_draft_tokens=sum(s.spec_draft_tokens for s in steps),
        spec_accepted_tokens=sum(s.spec_accepted_tokens for s in steps),
        spec_draft_s=sum(s.spec_draft_s for s in steps),
        tokens_trained=sum(lens),
        spec_draft_tokens_per_pos=sum_per_position(s.spec_draft_tokens_per_pos for s in steps),
        spec_accepted_tokens_per_pos=sum_per_position(s.spec_accepted_tokens_per_pos for s in steps),
    )
