"""The replay benchmark: every rollout policy on the same prompts, on one real engine.

Each response is replayed at its traced length (``ignore_eos`` with ``max_tokens`` = the length),
so the scheduling effect is measured on real decoding whatever the model says. One run compares
``sync``, ``tail_batching``, ``sorted`` (SortedRL, on-policy mode), ``sorted_partial`` (SortedRL,
partial mode) and ``partial`` (async partial rollout) on the same trace and the same engine
(``BenchConfig.policies`` picks a subset; sync and tail batching always run: they are the baseline).

- **tail batching** runs first for whole periods (short rounds up to and including a long round);
  the number of steps it takes, ``N``, is the length of every other arm;
- **sync** then trains exactly the prompts tail batching trained, in dataset order, in ``N`` steps
  (``trained_prompts_identical``);
- the **buffered arms** (sorted, sorted_partial, partial) run on the whole trace prompt list in
  file order (``PromptCursor(prompts, shuffle=False, epochs=1)``): which prompts they train is
  their own decision (that is the policy), so it cannot be the tail-batching set. The sorted arms
  run ``N`` rounded *up* to a whole number of SortedRL groups (``n = rollout.sorted.group_size``
  steps each) when the trace holds that many groups of ``n * P0`` prompts, else ``N``: a sorted arm
  stopped inside a group would leave its longest prompts untrained in the buffer and look better
  than it is. Partial rollout runs ``N`` steps with ``rollout.partial.in_flight`` requests running
  (0 = the engine's concurrency Q); its cache is never empty, and what is left cached at the end is
  reported as ``tokens_left_cached``. Any arm stops early, marked ``trace_used_up``, when the trace
  cannot fill its next step (partial rollout needs ``P0 + in_flight`` unread prompts to plan one).

Speedup is sync's rollout seconds per step over the arm's. An arm that trained fewer steps than sync
(it ran out of trace) gets ``speedup: null``: its steps are not the ones sync's mean is over. The
sorted arms' extra steps (whole groups) are compared per step. ``speedup_note`` says which, and
the printed table repeats it under the rows. ``simulated`` (with ``simulated_by``) records whether
the engine was the simulator (``FakeEngine``, a virtual clock), whose seconds are not measurements;
the printed title then says SIMULATED.

The policy version is bumped once per step (one update per RL step), so the token-weighted
off-policy lag of the trained tokens (``policy_lag`` mean / max, ``off_policy_frac``) is the real
one: 0 for the on-policy arms, > 0 where tokens generated under an older policy are resumed.

In the same run the engine's batch-scaling curve is measured, and its saturated throughput
(tokens/s at the concurrency limit) is the yardstick of rollout efficiency:

    efficiency = (trained tokens / saturated tokens-per-second) / actual rollout seconds

1.0 is the physical floor (every second spent decoding trained tokens at full batch). Trained
tokens are the tokens of the trained responses, resumed ones included (for sync and tail batching
that is ``tokens_useful``); all were generated inside the arm's own rollout time.

Token accounting per arm: ``tokens_generated == tokens_useful + tokens_wasted + tokens_cached``
(cached = generated now, kept for a later step); the cached tokens are later trained
(``tokens_resumed``), still cached when the arm ends (``tokens_left_cached``), or dropped by the
partial policy's staleness bound and regenerated (``tokens_dropped_stale``).

**Scale-down decisions (RollPacker §4.4, Algorithm 1)** are computed on every arm's real round
trajectories and reported, never enacted: during each round a ``ScaleDownMonitor`` is fed, after
every engine step that completes a request, the round's cumulative completed count and its live
requests (prompt tokens, generated tokens) on a hypothetical layout of
``BenchConfig.scaledown_replicas`` DP replicas (requests assigned round-robin in submission
order), with a ``LengthHistory`` of the arm's earlier rounds only. The observation goes through a
pass-through engine wrapper and the driver's callbacks: it changes neither a round's schedule nor
its (virtual) clock; only the KV-capacity probe (when no capacity is configured) runs on the
engine, once, before the arms. Per arm the report gives the
rounds that scaled down, the completed fraction at the decision, replicas freed, requests
migrated, the replica-seconds the freed replicas would have sat through for the rest of the round,
and the attempts refused by the KV-fit criterion (``scaledown`` in each policy's summary).

The SortedRL paper's bubble-ratio reduction (74 % baseline -> 5.81 % on-policy, 3.37 % partial,
arXiv:2603.23414, section 4.4.1) is reported beside the measured sync -> sorted figures
(``sortedrl_reference``).
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rollpacker.core.config import EngineConfig, PolicyName, RolloutConfig, SortedConfig, SortedMode
from rollpacker.core.errors import ConfigError, PolicyError, RollpackerError
from rollpacker.core.metrics import RolloutMetrics, bubble_parts, bubble_ratio, percentile, throughput
from rollpacker.core.policies.base import RolloutPolicy, SamplingFactory
from rollpacker.core.policies.partial import PartialPolicy
from rollpacker.core.policies.sorted import SortedPolicy
from rollpacker.core.policies.sync import SyncPolicy
from rollpacker.core.policies.tail_batching import TailBatchingPolicy
from rollpacker.core.prompts import PromptCursor
from rollpacker.core.scaledown import (
    LengthHistory,
    Replica,
    RolloutLayout,
    RunningRequest,
    ScaleDecision,
    ScaleDownConfig,
    ScaleDownMonitor,
)
from rollpacker.core.trace import PRESETS as TRACE_PRESETS
from rollpacker.core.trace import TraceRecord, check_serves, generate, length_stats, parse_lines, to_prompts
from rollpacker.core.types import (
    Completion,
    EngineStepStats,
    GenerationRequest,
    Prompt,
    RequestUpdate,
    RoundKind,
    SamplingSpec,
)
from rollpacker.engines.base import RolloutEngine
from rollpacker.engines.fake import FakeEngine
from rollpacker.engines.vllm_engine import VLLMEngine
from rollpacker.lab.bench.tables import legend, wrap
from rollpacker.lab.bench.throughput import throughput_table
from rollpacker.rollout.driver import run_round
from rollpacker.tasks.tiny_model import PRESETS as MODEL_PRESETS
from rollpacker.tasks.tiny_model import build_tiny_model

SCALING_BATCHES = (1, 8, 32, 128)

# Every arm the benchmark knows, in report order; the first two are the baseline and always run.
ALL_POLICIES = ("sync", "tail_batching", "sorted", "sorted_partial", "partial")
BASELINE_POLICIES = ("sync", "tail_batching")

# SortedRL (arXiv:2603.23414), section 4.4.1: bubble ratio (eq. 4) of the synchronous baseline and of the
# two SortedRL modes, 512 samples in 4 batches, max generation length 8k, lengths replayed.
SORTEDRL_PAPER_BUBBLE = {"baseline": 0.74, "sorted": 0.0581, "sorted_partial": 0.0337}

_UNBOUNDED_KV = 1 << 62  # a replica KV capacity no projection reaches (when it cannot be known)


def bench_policies(names: str | Sequence[str]) -> tuple[str, ...]:
    """The arms to run, from a comma list or names, in report order, with the baseline (sync and
    tail batching) always added; an unknown name is a ``ConfigError`` naming it."""
    items = names.split(",") if isinstance(names, str) else list(names)
    wanted = {n.strip() for n in items if n.strip()}
    unknown = sorted(wanted - set(ALL_POLICIES))
    if unknown:
        raise ConfigError(
            f"unknown policy {unknown[0]!r} in --policies; use some of {', '.join(ALL_POLICIES)}"
        )
    wanted |= set(BASELINE_POLICIES)
    return tuple(n for n in ALL_POLICIES if n in wanted)


@dataclass(frozen=True)
class BenchConfig:
    rollout: RolloutConfig
    periods: int = 2  # whole tail-batching periods (short rounds ending with a long round)
    max_steps: int = 200
    scaling_tokens: int = 64  # decode tokens per request when measuring the batch-scaling curve
    seed: int = 0
    policies: tuple[str, ...] = ALL_POLICIES  # arms to run (sync and tail_batching always)
    # Algorithm 1's scale-down decision, observed and reported (never enacted): DP replicas of the
    # hypothetical rollout layout (0 = not observed) and each replica's KV capacity in tokens
    # (None = the engine's capacity, estimated through the port, divided by the replicas)
    scaledown_replicas: int = 4
    scaledown_replica_kv_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.periods < 1:
            raise ConfigError(f"bench.periods = {self.periods}: must be >= 1")
        if self.max_steps < 1:
            raise ConfigError(f"bench.max_steps = {self.max_steps}: must be >= 1")
        r = self.scaledown_replicas
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ConfigError(
                f"bench.scaledown_replicas = {r!r}: must be an integer >= 0 "
                "(DP replicas of the rollout; 0 turns the scale-down report off)"
            )
        kv = self.scaledown_replica_kv_tokens
        if kv is not None and (isinstance(kv, bool) or not isinstance(kv, int) or kv < 1):
            raise ConfigError(
                f"bench.scaledown_replica_kv_tokens = {kv!r}: must be a positive integer "
                "(KV capacity of one replica, in tokens) or None (derived from the engine)"
            )
        unknown = [n for n in self.policies if n not in ALL_POLICIES]
        if unknown:
            raise ConfigError(f"bench.policies: unknown policy {unknown[0]!r}; use some of {ALL_POLICIES}")
        missing = [n for n in BASELINE_POLICIES if n not in self.policies]
        if missing:
            raise ConfigError(
                f"bench.policies lacks {missing[0]!r}: sync and tail_batching always run (the baseline)"
            )


@dataclass(frozen=True)
class ScalingPoint:
    batch: int
    tokens: int
    time_s: float
    engine_steps: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.time_s if self.time_s > 0 else 0.0

    @property
    def step_ms(self) -> float:
        return 1000.0 * self.time_s / max(1, self.engine_steps)


# ---------------------------------------------------------------------------------------------
# Algorithm 1 (scale-down), observed on the real rounds and reported; nothing is enacted


class _Live:
    """A request of the current round that has neither finished nor been aborted."""

    __slots__ = ("generated_tokens", "prompt_tokens", "replica_id")

    def __init__(self, replica_id: str, prompt_tokens: int, generated_tokens: int) -> None:
        self.replica_id = replica_id
        self.prompt_tokens = prompt_tokens
        self.generated_tokens = generated_tokens


class TrackingEngine:
    """The engine, passed through unchanged, recording what Algorithm 1's monitor reads: the
    round's live requests with their prompt and generated tokens, each assigned round-robin (in
    submission order) to one replica of the hypothetical layout, and ``launched``, the requests
    submitted before the round's first engine step (the round's ``|R|``). Every call goes to the
    engine as it came; the bookkeeping never touches the engine or its clock."""

    def __init__(self, inner: RolloutEngine, replica_ids: Sequence[str]) -> None:
        if not replica_ids:
            raise ConfigError("TrackingEngine needs at least one replica id")
        self._inner = inner
        self._replica_ids = tuple(replica_ids)
        self.live: dict[str, _Live] = {}
        self.submitted = 0  # requests submitted in this round
        self.launched: int | None = None  # submitted before the round's first step

    def begin_round(self) -> None:
        self.live.clear()
        self.submitted = 0
        self.launched = None

    def running(self) -> list[RunningRequest]:
        return [
            RunningRequest(rid, x.replica_id, x.prompt_tokens, x.generated_tokens)
            for rid, x in self.live.items()
        ]

    @property
    def concurrency(self) -> int:
        return self._inner.concurrency

    @property
    def tp_size(self) -> int:
        return self._inner.tp_size

    @property
    def vocab_size(self) -> int:
        return self._inner.vocab_size

    @property
    def eos_token_id(self) -> int:
        return self._inner.eos_token_id

    def now(self) -> float:
        return self._inner.now()

    def add_request(self, request: GenerationRequest) -> None:
        self._inner.add_request(request)
        replica = self._replica_ids[self.submitted % len(self._replica_ids)]
        self.submitted += 1
        # a resumed response's KV holds its cached tokens too: they count as generated
        self.live[request.request_id] = _Live(
            replica, len(request.prompt.token_ids), len(request.prefix_token_ids)
        )

    def abort(self, request_ids: Sequence[str]) -> None:
        self._inner.abort(request_ids)
        for rid in request_ids:
            self.live.pop(rid, None)

    def step(self) -> tuple[list[RequestUpdate], EngineStepStats]:
        if self.launched is None:
            self.launched = self.submitted
        updates, stats = self._inner.step()
        for u in updates:
            x = self.live.get(u.request_id)
            if x is None:
                continue
            if u.finished:
                del self.live[u.request_id]
            else:
                x.generated_tokens += len(u.new_token_ids)
        return updates, stats

    def has_unfinished(self) -> bool:
        return self._inner.has_unfinished()

    def num_preemptions(self) -> int:
        return self._inner.num_preemptions()

    def kv_cache_usage(self) -> float:
        return self._inner.kv_cache_usage()

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        self._inner.load_weights(named_tensors)

    @property
    def dead(self) -> bool:
        return bool(getattr(self._inner, "dead", False))

    def close(self) -> None:
        self._inner.close()


@dataclass(frozen=True)
class ScaleDownRound:
    """Algorithm 1 on one round: its attempts and, if it scaled down, the decision."""

    step: int
    round_kind: str
    requests: int  # |R|: requests submitted before the round's first engine step
    round_s: float
    history_lengths: int = 0  # response lengths the monitor's history held (earlier rounds only)
    attempts: int = 0
    refused_kv: int = 0  # attempts refused by MeetScaleCriteria (projected KV does not fit)
    aborted_pick: int = 0  # attempts aborted by PickScaleDownGPUs (fewer than 2 replicas)
    completed_frac: float | None = None  # |R_comp|/|R| at the decision
    decision_s: float | None = None  # seconds into the round
    freed_replicas: int = 0
    freed_devices: int = 0
    migrated: int = 0  # running requests on the freed replicas, resubmitted on the kept ones

    @property
    def scaled_down(self) -> bool:
        return self.decision_s is not None

    @property
    def freed_replica_s(self) -> float:
        """Replica-seconds the freed replicas would have given training: until the round ends."""
        return 0.0 if self.decision_s is None else self.freed_replicas * (self.round_s - self.decision_s)

    def as_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "round_kind": self.round_kind,
            "requests": self.requests,
            "round_s": self.round_s,
            "history_lengths": self.history_lengths,
            "attempts": self.attempts,
            "refused_kv": self.refused_kv,
            "aborted_pick": self.aborted_pick,
            "scaled_down": self.scaled_down,
            "completed_frac": self.completed_frac,
            "decision_s": self.decision_s,
            "freed_replicas": self.freed_replicas,
            "migrated": self.migrated,
            "freed_replica_s": self.freed_replica_s,
        }


class ScaleDownObserver:
    """Feeds one arm's rounds to a ``ScaleDownMonitor`` and records what it decides.

    Use ``engine`` (a ``TrackingEngine``) for the arm's rounds, call ``begin_round`` before each,
    pass ``on_step`` and ``on_response`` to ``run_round``, then ``end_round``. The length history
    holds the natural (not aborted) response lengths of the arm's *earlier* rounds only.
    """

    def __init__(
        self, engine: RolloutEngine, layout: RolloutLayout, config: ScaleDownConfig, max_tokens: int
    ) -> None:
        self.engine = TrackingEngine(engine, layout.replica_ids)
        self._layout = layout
        self._config = config
        self._history = LengthHistory((), max_tokens)
        self._seen: list[int] = []
        self._monitor: ScaleDownMonitor | None = None
        self._t0 = 0.0
        self._tally = [0, 0, 0]  # attempts, refused_kv, aborted_pick in this round
        self._decision: tuple[ScaleDecision, float] | None = None
        self.rounds: list[ScaleDownRound] = []

    @property
    def layout(self) -> RolloutLayout:
        return self._layout

    @property
    def history(self) -> LengthHistory:
        """What the next round's monitor will project with: the earlier rounds' final lengths."""
        return self._history

    def begin_round(self) -> None:
        self.engine.begin_round()
        self._monitor = None
        self._t0 = self.engine.now()
        self._tally = [0, 0, 0]
        self._decision = None

    def on_response(self, completion: Completion) -> None:
        self._seen.append(completion.num_tokens)

    def on_step(self, _stats: EngineStepStats, completed: int) -> None:
        """Lines 9-21 of Algorithm 1 after one engine step (``completed``: the driver's count of
        naturally finished requests of the round, capped at ``|R|``)."""
        if self._monitor is None:
            total = self.engine.launched or 0
            if total == 0:
                return
            self._monitor = ScaleDownMonitor(self._config, self._layout, self._history, total)
        m = self._monitor
        done = min(completed, m.state.total_requests)
        # Without a new completion neither Δ_R nor |R_comp| moves: the monitor could not attempt.
        if m.scaled_down or done == m.state.completed:
            return
        before = m.state.attempts
        decision = m.observe(done, self.engine.running())
        if m.state.attempts == before:
            return
        self._tally[0] += 1
        check = m.last_check
        if decision is not None:
            self._decision = (decision, self.engine.now() - self._t0)
        elif check is not None and not check.freed:
            self._tally[2] += 1
        else:
            self._tally[1] += 1

    def end_round(self, step: int, round_kind: str) -> ScaleDownRound:
        m = self._monitor
        rec = ScaleDownRound(
            step=step,
            round_kind=round_kind,
            requests=m.state.total_requests if m is not None else 0,
            round_s=self.engine.now() - self._t0,
            history_lengths=len(self._history.lengths),
            attempts=self._tally[0],
            refused_kv=self._tally[1],
            aborted_pick=self._tally[2],
        )
        if self._decision is not None:
            d, at_s = self._decision
            rec = replace(
                rec,
                completed_frac=d.completed_fraction,
                decision_s=at_s,
                freed_replicas=len(d.freed),
                freed_devices=len(self._layout.devices_of(d.freed)),
                migrated=len(d.migrate),
            )
        self.rounds.append(rec)
        self._history = self._history.extended(self._seen)
        self._seen = []
        return rec

    def summary(self, rollout_time_s: float) -> dict[str, Any]:
        """Per-arm totals; ``freed_share`` = freed replica-seconds / (replicas x rollout seconds)."""
        rounds = self.rounds
        decided = [r for r in rounds if r.scaled_down]
        fracs = [r.completed_frac for r in decided if r.completed_frac is not None]
        freed_s = sum(r.freed_replica_s for r in rounds)
        n = len(self._layout.replicas)
        return {
            "rounds": len(rounds),
            "rounds_scaled_down": len(decided),
            "completed_frac_mean": sum(fracs) / len(fracs) if fracs else None,
            "replicas_freed": sum(r.freed_replicas for r in rounds),
            "requests_migrated": sum(r.migrated for r in rounds),
            "freed_replica_s": freed_s,
            "freed_device_s": sum(
                r.freed_devices * (r.round_s - r.decision_s) for r in decided if r.decision_s is not None
            ),
            "freed_share": freed_s / (n * rollout_time_s) if rollout_time_s > 0 else 0.0,
            "attempts": sum(r.attempts for r in rounds),
            "refused_kv": sum(r.refused_kv for r in rounds),
            "aborted_pick": sum(r.aborted_pick for r in rounds),
            "per_round": [r.as_dict() for r in rounds],
        }


def scaledown_layout(replicas: int, replica_kv_tokens: int, tp_size: int) -> RolloutLayout:
    """``replicas`` DP replicas ``r0..`` of ``tp_size`` devices each on one node."""
    return RolloutLayout(
        tuple(
            Replica(f"r{i}", tuple(range(i * tp_size, (i + 1) * tp_size)), "node0", replica_kv_tokens)
            for i in range(replicas)
        )
    )


def measure_kv_capacity(
    engine: RolloutEngine,
    batch: int = 16,
    prompt_len: int = 127,
    tokens: int = 8,
    seed: int = 0,
    tag: str = "kvprobe",
) -> int | None:
    """The engine's KV capacity in tokens, estimated through the port (``kv_cache_usage``).

    ``batch`` requests with distinct random prompts (no shared prefix) decode ``tokens`` tokens;
    after each step the running requests' resident tokens (prompt + generated) over the reported
    usage estimates the capacity, taken at the step of highest usage below 1 with nothing waiting.
    Block rounding makes it a slight underestimate (conservative for the KV-fit check). The unit
    is the monitor's: prompt + generated tokens per request, no prefix sharing. ``None`` when no
    usable reading came back (no usage reported, or the probe alone overflows the cache).
    """
    rng = random.Random(f"{tag}:{seed}")
    hi = max(4, min(engine.vocab_size, 259))
    resident: dict[str, int] = {}
    for i in range(min(batch, engine.concurrency)):
        ids = tuple(rng.randrange(3, hi) for _ in range(prompt_len))
        rid = f"{tag}-{i}-{time.monotonic_ns()}"
        engine.add_request(
            GenerationRequest(
                request_id=rid,
                prompt=Prompt(prompt_id=f"{tag}-{i}", token_ids=ids),
                sample_index=0,
                sampling=SamplingSpec(max_tokens=tokens, ignore_eos=True),
            )
        )
        resident[rid] = prompt_len
    best: tuple[float, int] = (0.0, 0)
    while engine.has_unfinished():
        updates, stats = engine.step()
        for u in updates:
            if u.request_id in resident:
                resident[u.request_id] += len(u.new_token_ids)
                if u.finished:
                    del resident[u.request_id]
        # only while every request is resident (none waiting or preempted) and the cache is not full
        usage = stats.kv_cache_usage
        if resident and stats.num_waiting == 0 and best[0] < usage < 1.0:
            best = (usage, sum(resident.values()))
    usage, held = best
    return round(held / usage) if usage > 0 else None


def _scaledown_setup(
    engine: RolloutEngine, cfg: BenchConfig, log: Callable[[str], None]
) -> tuple[RolloutLayout | None, dict[str, Any] | None]:
    """The hypothetical rollout layout the arms are observed on, and its description for the report."""
    n = cfg.scaledown_replicas
    if n == 0:
        return None, None
    kv = cfg.scaledown_replica_kv_tokens
    source = "configured"
    engine_kv: int | None = None
    if kv is None:
        engine_kv = measure_kv_capacity(engine, seed=cfg.seed)
        if engine_kv is None:
            kv, source = _UNBOUNDED_KV, "unknown: the engine reports no KV usage"
        else:
            kv, source = max(1, engine_kv // n), f"engine estimate {engine_kv} tokens / {n} replicas"
    log(f"scale-down (Algorithm 1) observed on {n} replicas x {kv} KV tokens ({source})")
    sd = ScaleDownConfig()
    info = {
        "replicas": n,
        "replica_kv_tokens": kv,
        "kv_source": source,
        "engine_kv_tokens": engine_kv,
        "kv_checked": kv != _UNBOUNDED_KV,
        "tp_size": engine.tp_size,
        "milestones": [sd.milestone_low, sd.milestone_high, sd.milestone_step],
        "fraction": sd.fraction,
    }
    return scaledown_layout(n, kv, engine.tp_size), info


@dataclass(frozen=True)
class SampledResponse:
    """One response a round generated (trained or discarded), as the lossless check needs it."""

    step: int
    prompt_id: str
    num_tokens: int
    natural: bool  # ended by itself (EOS, stop, max_tokens), not aborted
    head: tuple[int, ...]  # its first tokens (``run_policy``'s ``keep_tokens``)


@dataclass
class PolicyRun:
    policy: str
    steps: list[RolloutMetrics] = field(default_factory=list)
    engine_steps: list[EngineStepStats] = field(default_factory=list)
    trained_prompt_ids: list[str] = field(default_factory=list)
    engine_tokens: int = 0
    wall_s: float = 0.0
    step_trained_tokens: list[int] = field(default_factory=list)  # per step: trained response tokens
    resumed_tokens: int = 0  # trained tokens generated in an earlier step (cached, then resumed)
    left_cached_tokens: int = 0  # tokens still in the policy's rollout buffer when the arm ended
    trace_used_up: bool = False  # the arm stopped because the trace could not fill its next step
    scaledown: ScaleDownObserver | None = None  # Algorithm 1 observed on the arm's rounds
    responses: list[SampledResponse] = field(default_factory=list)  # with run_policy's keep_tokens

    @property
    def time_s(self) -> float:
        return sum(m.time_s for m in self.steps)

    def summary(self, concurrency: int, saturated_tps: float) -> dict[str, Any]:

        n = len(self.steps)
        useful = sum(m.tokens_useful for m in self.steps)
        cached = sum(m.tokens_cached for m in self.steps)
        time_s = self.time_s
        kinds = [m.round_kind for m in self.steps]
        # token-weighted over the whole arm: each step's mean lag weighs by its trained tokens
        trained = sum(self.step_trained_tokens)
        lag = sum(m.policy_lag * t for m, t in zip(self.steps, self.step_trained_tokens, strict=True))
        off = sum(m.off_policy_frac * t for m, t in zip(self.steps, self.step_trained_tokens, strict=True))
        generated, wasted = (
            sum(m.tokens_generated for m in self.steps),
            sum(m.tokens_wasted for m in self.steps),
        )
        return {
            "steps": n,
            "short_rounds": kinds.count(RoundKind.SHORT.value),
            "long_rounds": kinds.count(RoundKind.LONG.value),
            "rollout_time_s": time_s,
            "rollout_s_per_step": time_s / n if n else 0.0,
            "tokens_generated": generated,
            "tokens_useful": useful,
            "tokens_wasted": wasted,
            "tokens_cached": cached,
            "tokens_trained": trained,
            "tokens_resumed": self.resumed_tokens,
            "tokens_left_cached": self.left_cached_tokens,
            "tokens_dropped_stale": cached - self.resumed_tokens - self.left_cached_tokens,
            "engine_tokens": self.engine_tokens,
            "aborted_requests": sum(m.aborted_requests for m in self.steps),
            "preemptions": sum(m.preemptions for m in self.steps),
            "bubble_ratio": bubble_ratio(self.engine_steps, time_s, concurrency),
            **{
                f"bubble_{k}": v
                for k, v in dataclasses.asdict(bubble_parts(self.engine_steps, time_s, concurrency)).items()
            },
            **throughput(generated, trained, wasted, time_s, n).as_dict(),
            "efficiency": ((trained / saturated_tps) / time_s if time_s > 0 and saturated_tps > 0 else 0.0),
            "policy_lag": lag / trained if trained else 0.0,
            "policy_lag_max": max((m.policy_lag_max for m in self.steps), default=0),
            "off_policy_frac": off / trained if trained else 0.0,
            "trace_used_up": self.trace_used_up,
            "max_len_per_step": [m.response_len_max for m in self.steps],
            "p75_len_per_step": [m.response_len_p75 for m in self.steps],
            "time_s_per_step": [m.time_s for m in self.steps],
            "round_kinds": kinds,
            **({"scaledown": self.scaledown.summary(time_s)} if self.scaledown is not None else {}),
        }


def replay_sampling(max_len: int, seed: int) -> SamplingFactory:
    """Response j of a prompt generates exactly min(response_lens[j], max_len) tokens."""

    def make(prompt: Prompt, j: int) -> SamplingSpec:
        if j >= len(prompt.response_lens):
            raise ConfigError(
                f"prompt {prompt.prompt_id!r}: response {j} has no traced length "
                f"({len(prompt.response_lens)} given)"
            )
        return SamplingSpec(
            max_tokens=min(prompt.response_lens[j], max_len),
            temperature=1.0,
            ignore_eos=True,
            logprobs=True,
        )

    return make


def measure_scaling(
    engine: RolloutEngine, batches: Sequence[int], tokens: int, prompt_len: int = 32, tag: str = "scale"
) -> list[ScalingPoint]:
    """Decode ``tokens`` tokens for ``b`` concurrent requests, for each ``b``; time it."""
    points = []
    for b in batches:
        prompt = Prompt(prompt_id=f"{tag}-b{b}", token_ids=tuple(3 + (i % 200) for i in range(prompt_len)))
        for i in range(b):
            engine.add_request(
                GenerationRequest(
                    request_id=f"{tag}-b{b}-{i}-{time.monotonic_ns()}",
                    prompt=prompt,
                    sample_index=i,
                    sampling=SamplingSpec(max_tokens=tokens, ignore_eos=True),
                )
            )
        n_tok = 0
        n_steps = 0
        t0 = engine.now()
        while engine.has_unfinished():
            updates, _ = engine.step()
            n_steps += 1
            n_tok += sum(len(u.new_token_ids) for u in updates)
        points.append(ScalingPoint(batch=b, tokens=n_tok, time_s=engine.now() - t0, engine_steps=n_steps))
    return points


def run_policy(
    engine: RolloutEngine,
    policy: RolloutPolicy,
    stop: Callable[[RolloutPolicy, list[RolloutMetrics]], bool],
    max_steps: int,
    progress: Callable[[str, RolloutMetrics], None] | None = None,
    label: str | None = None,
    scaledown: ScaleDownObserver | None = None,
    keep_tokens: int = 0,
) -> PolicyRun:
    """Run ``policy`` until ``stop`` says so, ``max_steps`` steps, or the trace cannot fill the next
    step (``trace_used_up``). The policy version is the step index: one update per step, so the
    lag of resumed tokens is measured as in training. With a ``scaledown`` observer (fresh, on
    this ``engine``), Algorithm 1 is observed on every round; it changes nothing a round does.
    With ``keep_tokens`` > 0, every response a round generated (trained or discarded) is kept in
    ``responses`` with its first ``keep_tokens`` tokens."""
    name = label or policy.name
    obs = scaledown
    run = PolicyRun(policy=name, scaledown=obs)
    t0 = time.perf_counter()
    for step in range(max_steps):
        if isinstance(policy, PartialPolicy):
            policy.policy_version = step  # its staleness bound and prompt priority read it
        try:
            plan = policy.plan_step(step)
        except PolicyError as e:
            if "used up" not in str(e):
                raise
            run.trace_used_up = True
            break
        rnd = policy.open_round(plan)
        if obs is None:
            rr = run_round(engine, rnd, policy_version=step)
        else:
            obs.begin_round()
            rr = run_round(obs.engine, rnd, step, on_step=obs.on_step, on_response=obs.on_response)
            obs.end_round(step, rr.metrics.round_kind)
        policy.commit(rr.result)
        run.steps.append(rr.metrics)
        run.engine_steps.extend(rr.steps)
        run.engine_tokens += rr.engine_tokens
        run.trained_prompt_ids.extend(g.prompt.prompt_id for g in rr.result.groups)
        responses = [c for g in rr.result.groups for c in g.responses]
        run.step_trained_tokens.append(sum(c.num_tokens for c in responses))
        run.resumed_tokens += sum(c.resumed_tokens for c in responses)
        if keep_tokens > 0:
            run.responses.extend(
                SampledResponse(
                    step, c.prompt_id, c.num_tokens, c.finish_reason.is_natural, c.token_ids[:keep_tokens]
                )
                for c in (*responses, *rr.result.discarded)
            )
        if progress is not None:
            progress(name, rr.metrics)
        if stop(policy, run.steps):
            break
    if isinstance(policy, (SortedPolicy, PartialPolicy)):
        run.left_cached_tokens = sum(len(x.token_ids) for e in policy.buffer for x in e.samples)
    run.wall_s = time.perf_counter() - t0
    return run


@dataclass(frozen=True)
class _Arms:
    """What every arm of one benchmark run shares: the engine, the trace's prompts in file order,
    the replay sampling, the config and the callbacks."""

    engine: RolloutEngine
    prompts: list[Prompt]
    sampling: SamplingFactory
    cfg: BenchConfig
    progress: Callable[[str, RolloutMetrics], None] | None
    observer: Callable[[], ScaleDownObserver | None]  # a fresh scale-down observer per arm
    log: Callable[[str], None]

    def run(
        self,
        policy: RolloutPolicy,
        stop: Callable[[RolloutPolicy, list[RolloutMetrics]], bool],
        max_steps: int,
        label: str | None = None,
    ) -> PolicyRun:
        return run_policy(
            self.engine, policy, stop, max_steps, self.progress, label=label, scaledown=self.observer()
        )


@dataclass(frozen=True)
class _BufferedSizing:
    """How long the buffered arms run: ``n_steps`` (tail batching's length), the sorted arms rounded
    up to ``groups`` whole SortedRL groups of ``group_size`` steps when the trace holds them
    (``whole``), and partial rollout's requests in flight."""

    n_steps: int
    group_size: int
    groups: int
    whole: bool
    sorted_steps: int
    in_flight: int


def run_benchmark(
    engine: RolloutEngine,
    records: Sequence[TraceRecord],
    cfg: BenchConfig,
    source: str = "<trace>",
    progress: Callable[[str, RolloutMetrics], None] | None = None,
    log: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:
    rc = cfg.rollout
    check_serves(records, rc.launched_responses, source)
    prompts = to_prompts(records, vocab_size=min(engine.vocab_size, 256 + 3), seed=cfg.seed)
    sampling = replay_sampling(rc.max_tokens, cfg.seed)
    scaling, sat = _measure_engine(engine, cfg, log)
    layout, sd_info = _scaledown_setup(engine, cfg, log)

    def observer() -> ScaleDownObserver | None:
        return None if layout is None else ScaleDownObserver(engine, layout, ScaleDownConfig(), rc.max_tokens)

    arms = _Arms(engine, prompts, sampling, cfg, progress, observer, log)
    tb_run = _run_tail_batching(arms)
    sync_run = _run_sync(arms, tb_run)
    runs = {"sync": sync_run, "tail_batching": tb_run}
    sizing = _buffered_sizing(rc, len(tb_run.steps), len(prompts), engine.concurrency)
    _run_buffered_arms(arms, sizing, runs)
    return _report(engine, records, cfg, source, scaling, sat, sd_info, sizing, runs)


def _measure_engine(
    engine: RolloutEngine, cfg: BenchConfig, log: Callable[[str], None]
) -> tuple[list[ScalingPoint], float]:
    """The engine's batch-scaling curve and its saturated tokens/s (at most the concurrency limit)."""
    log("measuring the engine's batch-scaling curve")
    measure_scaling(engine, (8,), 16, tag="warmup")  # first steps pay one-off costs
    batches = sorted(set(SCALING_BATCHES) | {engine.concurrency})
    scaling = measure_scaling(engine, batches, cfg.scaling_tokens)
    sat = max(p.tokens_per_s for p in scaling if p.batch <= engine.concurrency)
    return scaling, sat


def _run_tail_batching(arms: _Arms) -> PolicyRun:
    """Tail batching first: it decides which prompts a whole number of periods trains."""
    cfg, rc = arms.cfg, arms.cfg.rollout
    tb_cfg = replace(rc, policy=PolicyName.TAIL_BATCHING)
    cursor = PromptCursor(arms.prompts, shuffle=False, epochs=1)
    tb = TailBatchingPolicy(tb_cfg, cursor, arms.sampling, namespace="tb")
    speculates_prompts = tb_cfg.launched_prompts > tb_cfg.prompts_per_step

    def tb_stop(_policy: RolloutPolicy, steps: list[RolloutMetrics]) -> bool:
        done_periods = (
            sum(1 for m in steps if m.round_kind == RoundKind.LONG.value)
            if speculates_prompts
            else len(steps)
        )
        if done_periods >= cfg.periods:
            return len(tb.queue) < rc.prompts_per_step  # a period ends with the queue drained
        remaining = tb.cursor.remaining() or 0
        return len(tb.queue) < rc.prompts_per_step and remaining < tb_cfg.launched_prompts

    arms.log("running tail batching")
    tb_run = arms.run(tb, tb_stop, cfg.max_steps)
    if not any(m.round_kind == RoundKind.LONG.value for m in tb_run.steps) and speculates_prompts:
        arms.log("note: no long round completed; the trace is too short for a whole period")
    return tb_run


def _run_sync(arms: _Arms, tb_run: PolicyRun) -> PolicyRun:
    """The baseline trains exactly the same prompts, in dataset order, in as many steps."""
    trained = set(tb_run.trained_prompt_ids)
    same = [p for p in arms.prompts if p.prompt_id in trained]
    sync_cfg = replace(arms.cfg.rollout, policy=PolicyName.SYNC)
    sync = SyncPolicy(sync_cfg, PromptCursor(same, shuffle=False, epochs=1), arms.sampling, namespace="sync")
    arms.log("running the synchronous baseline on the same prompts")
    n_steps = len(tb_run.steps)
    return arms.run(sync, _after(n_steps), n_steps)


def _buffered_sizing(rc: RolloutConfig, n_steps: int, num_prompts: int, concurrency: int) -> _BufferedSizing:
    n = rc.sorted.group_size
    groups = -(-n_steps // n)
    whole = groups * n * rc.prompts_per_step <= num_prompts
    sorted_steps = groups * n if whole else n_steps
    in_flight = rc.partial.in_flight or min(concurrency, rc.prompts_per_step * rc.responses_per_prompt)
    return _BufferedSizing(n_steps, n, groups, whole, sorted_steps, in_flight)


def _run_buffered_arms(arms: _Arms, sizing: _BufferedSizing, runs: dict[str, PolicyRun]) -> None:
    """The buffered arms: the whole trace in file order, their own choice of prompts; each run is
    added to ``runs`` under its name."""
    by_id = {p.prompt_id: p for p in arms.prompts}
    for name in arms.cfg.policies:
        if name in runs:
            continue
        policy, steps = _buffered_policy(arms, name, sizing, by_id)
        runs[name] = arms.run(policy, _after(steps), steps, label=name)
        if runs[name].trace_used_up:
            arms.log(f"note: {name} used up the trace after {len(runs[name].steps)} steps")


def _buffered_policy(
    arms: _Arms, name: str, sizing: _BufferedSizing, by_id: dict[str, Prompt]
) -> tuple[RolloutPolicy, int]:
    """The buffered arm ``name`` (sorted, sorted_partial or partial) on a fresh cursor over the
    trace, and how many steps it runs (logged)."""
    rc = arms.cfg.rollout
    cursor = PromptCursor(arms.prompts, shuffle=False, epochs=1)
    n = sizing.group_size
    if name in ("sorted", "sorted_partial"):
        mode = SortedMode.PARTIAL if name == "sorted_partial" else SortedMode.ON_POLICY
        pcfg = replace(rc, policy=PolicyName.SORTED, sorted=SortedConfig(mode=mode, group_size=n))
        steps = sizing.sorted_steps
        short = f" (the trace holds fewer than {sizing.groups} groups of {n * rc.prompts_per_step})"
        arms.log(
            f"running {name} (SortedRL {mode.value}, n={n}) for {steps} steps"
            + ("" if sizing.whole else short)
        )
        return SortedPolicy(pcfg, cursor, arms.sampling, by_id, namespace=name), steps
    pcfg = replace(rc, policy=PolicyName.PARTIAL)
    policy = PartialPolicy(pcfg, cursor, arms.sampling, by_id, in_flight=sizing.in_flight, namespace=name)
    steps = sizing.n_steps
    arms.log(f"running partial rollout ({sizing.in_flight} requests in flight) for {steps} steps")
    return policy, steps


def _summaries(
    runs: dict[str, PolicyRun], concurrency: int, sat: float, group_size: int
) -> dict[str, dict[str, Any]]:
    """Each arm's summary in report order, with its speedup over sync and its ``speedup_note``."""
    summaries = {name: runs[name].summary(concurrency, sat) for name in ALL_POLICIES if name in runs}
    for name, s in summaries.items():
        buffered = name in ("sorted", "sorted_partial")
        s["bubble_ratio_before_drain"] = bubble_before_drain(runs[name], group_size) if buffered else None
        s["bubble_in_drains"] = bubble_in_drains(runs[name], group_size) if buffered else None
    base = summaries["sync"]
    for s in summaries.values():
        s["speedup"], s["speedup_note"] = _speedup(s, base, group_size)
    return summaries


def bubble_before_drain(run: PolicyRun, group_size: int) -> float:
    """Eq. 4 over a sorted arm's rounds except each group's last, weighted by their seconds (Q is
    the same). The last round holds only the group's longest ``P0`` prompts and nothing more to
    feed (the cache-aware loading rule): every other round has the buffer's work to keep Q
    requests running, so this is where oversubscription shows, and the rest of the arm's bubble
    is the groups' drains."""
    kept = [m for i, m in enumerate(run.steps) if i % group_size != group_size - 1]
    t = sum(m.time_s for m in kept)
    return sum(m.bubble_ratio * m.time_s for m in kept) / t if t > 0 else 0.0


def bubble_in_drains(run: PolicyRun, group_size: int) -> float:
    """The part of a sorted arm's bubble ratio spent in its groups' last rounds (their idle
    slot-seconds over the arm's): with ``bubble_ratio_before_drain`` weighted by the other rounds'
    share of the time, the arm's bubble ratio."""
    t = run.time_s
    last = [m for i, m in enumerate(run.steps) if i % group_size == group_size - 1]
    return sum(m.bubble_ratio * m.time_s for m in last) / t if t > 0 else 0.0


def _speedup(arm: dict[str, Any], sync: dict[str, Any], group_size: int) -> tuple[float | None, str | None]:
    """Sync's rollout seconds per step over the arm's, and a note when the arm trained a different
    number of steps: fewer (it ran out of trace) gives no speedup, since its steps are not the ones
    sync's mean is over; more (the sorted arms' whole SortedRL groups) gives the per-step speedup
    over its own steps, and says so."""
    n, n_sync = arm["steps"], sync["steps"]
    if n < n_sync:
        why = "the trace ran out" if arm["trace_used_up"] else "stopped early"
        return None, f"{n} trained steps vs {n_sync} for sync ({why}): no speedup given"
    per_step = arm["rollout_s_per_step"]
    speedup = sync["rollout_s_per_step"] / per_step if per_step > 0 else None
    if n > n_sync:
        return speedup, (
            f"{n} trained steps vs {n_sync} for sync (it runs whole SortedRL groups of {group_size} "
            "steps): the speedup compares seconds per step"
        )
    return speedup, None


def simulated_by(engine: RolloutEngine) -> str | None:
    """What simulates ``engine`` (None: a real engine, whose seconds are measured)."""
    return f"FakeEngine ({engine.timing_model})" if isinstance(engine, FakeEngine) else None


def _report(
    engine: RolloutEngine,
    records: Sequence[TraceRecord],
    cfg: BenchConfig,
    source: str,
    scaling: list[ScalingPoint],
    sat: float,
    sd_info: dict[str, Any] | None,
    sizing: _BufferedSizing,
    runs: dict[str, PolicyRun],
) -> dict[str, Any]:
    """The benchmark's JSON report."""
    rc = cfg.rollout
    summaries = _summaries(runs, engine.concurrency, sat, sizing.group_size)
    trace_stats = length_stats(records, rc.launched_responses)
    trained = set(runs["tail_batching"].trained_prompt_ids)
    sim = simulated_by(engine)
    return {
        "simulated": sim is not None,
        "simulated_by": sim,
        "config": {
            "P0": rc.prompts_per_step,
            "R0": rc.responses_per_prompt,
            "eta_p": rc.eta_p,
            "eta_r": rc.eta_r,
            "max_tokens": rc.max_tokens,
            "periods": cfg.periods,
            "policies": list(summaries),
            "group_size": sizing.group_size,
            "sorted_steps": sizing.sorted_steps,
            "partial_in_flight": sizing.in_flight,
            "partial_max_staleness": rc.partial.max_staleness,
            "concurrency": engine.concurrency,
            "tp_size": engine.tp_size,
            "seed": cfg.seed,
            "scaledown": sd_info,
        },
        "trace": {"source": source, "prompts": len(records), **trace_stats},
        "batch_scaling": [
            {
                "batch": p.batch,
                "tokens_per_s": p.tokens_per_s,
                "step_ms": p.step_ms,
                "tokens": p.tokens,
                "time_s": p.time_s,
            }
            for p in scaling
        ],
        "saturated_tokens_per_s": sat,
        "step_time_ratio_128_vs_1": _ratio(scaling, 128, 1),
        "trained_prompts_identical": sorted(trained) == sorted(runs["sync"].trained_prompt_ids),
        "policies": summaries,
        "sortedrl_reference": sortedrl_reference(summaries),
        "per_step": {name: [m.as_dict() for m in runs[name].steps] for name in summaries},
    }


def _after(k: int) -> Callable[[RolloutPolicy, list[RolloutMetrics]], bool]:
    """A stop rule: after ``k`` steps."""
    return lambda _policy, steps: len(steps) >= k


def sortedrl_reference(summaries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The SortedRL paper's bubble-ratio reduction beside ours: baseline (sync) -> each sorted arm
    that ran; ``reduction`` is ``1 - sorted / baseline``."""

    def cut(base: float, x: float) -> float | None:
        return 1.0 - x / base if base > 0 else None

    paper = dict(SORTEDRL_PAPER_BUBBLE)
    measured = {"baseline": summaries["sync"]["bubble_ratio"]}
    measured.update({k: summaries[k]["bubble_ratio"] for k in ("sorted", "sorted_partial") if k in summaries})
    return {
        "source": "SortedRL (arXiv:2603.23414) section 4.4.1: 512 samples in 4 batches, max length 8k, "
        "lengths replayed; bubble ratio eq. 4",
        "paper": {
            "bubble_ratio": paper,
            "reduction": {k: cut(paper["baseline"], v) for k, v in paper.items() if k != "baseline"},
        },
        "measured": {
            "bubble_ratio": measured,
            "reduction": {k: cut(measured["baseline"], v) for k, v in measured.items() if k != "baseline"},
        },
    }


def _ratio(points: Sequence[ScalingPoint], a: int, b: int) -> float | None:
    pa = next((p for p in points if p.batch == a), None)
    pb = next((p for p in points if p.batch == b), None)
    if pa is None or pb is None or pb.step_ms == 0:
        return None
    return pa.step_ms / pb.step_ms


def render_table(report: dict[str, Any]) -> str:
    """The human-readable summary printed by ``rollpacker lab bench rollout-replay``: a title saying whether
    the seconds were simulated or measured, then tables at most ``MAX_COLUMNS`` wide, each with a
    legend."""
    lines = _title_lines(report)
    lines += _trace_and_scaling_lines(report)
    lines += ["", *_time_table_lines(report["policies"])]
    lines += ["", *_token_table_lines(report["policies"])]
    lines += [
        "",
        *throughput_table(report["policies"], f"throughput per arm (Q = {report['config']['concurrency']}):"),
    ]
    lines += _tail_batching_lines(report["policies"]["tail_batching"])
    lines += _scaledown_lines(report)
    lines += _sortedrl_lines(report)
    return "\n".join(lines)


def _title_lines(report: dict[str, Any]) -> list[str]:
    """The title: SIMULATED and by what, or measured on a real engine."""
    if report["simulated"]:
        text = (
            f"rollout benchmark: SIMULATED on {report['simulated_by']}; no real decoding, so every "
            "second below is the simulator's, not a measurement"
        )
    else:
        text = "rollout benchmark: measured on a real engine (wall-clock seconds of real decoding)"
    return [*wrap(text), ""]


def _trace_and_scaling_lines(report: dict[str, Any]) -> list[str]:
    """The trace, the configuration and the engine's batch-scaling curve."""
    c = report["config"]
    t = report["trace"]
    lines = wrap(
        f"trace {t['source']}: {t['prompts']} prompts; response length max {t['max']:.0f}, "
        f"P75 {t['p75']:.0f}, median {t['p50']:.0f}"
    )
    lines += wrap(
        f"P0={c['P0']} R0={c['R0']} eta_p={c['eta_p']} eta_r={c['eta_r']} max_tokens={c['max_tokens']} "
        f"concurrency Q={c['concurrency']} TP={c['tp_size']}"
    )
    lines += ["", "engine batch scaling (decode):", f"  {'batch':>6} {'tokens/s':>10} {'ms/step':>9}"]
    for p in report["batch_scaling"]:
        lines.append(f"  {p['batch']:>6} {p['tokens_per_s']:>10.0f} {p['step_ms']:>9.2f}")
    r = report.get("step_time_ratio_128_vs_1")
    if r is not None:
        lines.append(f"  step time at batch 128 / batch 1 = {r:.2f}x (1.0 = perfectly memory-bound)")
    return lines


_TIME_LEGEND = (
    ("steps", "trained RL steps (each trains P0 prompts x R0 responses)"),
    ("s/step", "rollout seconds per trained step"),
    ("speedup", "sync's s/step / this arm's (> 1 = faster than sync); - = not comparable, see the note"),
    (
        "bubble",
        "bubble ratio (SortedRL eq. 4): the share of the engine's Q request slots left idle over the "
        "rollout; lower is better",
    ),
    (
        "efficiency",
        "(trained tokens / the saturated tokens/s of the batch-scaling curve) / rollout seconds; "
        "100% = decoding trained tokens at full batch all the time",
    ),
    (
        "lag mean",
        "policy lag: updates between the weights that generated a trained token and the weights it "
        "is trained from, token-weighted mean (0 = on-policy; one update per step)",
    ),
    ("lag max", "the largest policy lag of any trained token"),
    ("off-policy", "the share of the trained tokens generated by an older policy (lag > 0)"),
    ("max length", "the longest trained response of each step, in tokens, mean over the steps"),
)


def _time_table_lines(policies: dict[str, dict[str, Any]]) -> list[str]:
    """Rollout time, speedup, bubble, efficiency and policy lag per arm; a note for each arm not
    compared over sync's number of steps; the legend."""
    hdr = (
        f"{'policy':<14}  {'steps':>5}  {'s/step':>7}  {'speedup':>7}  {'bubble':>6}  {'efficiency':>10}  "
        f"{'lag mean':>8}  {'lag max':>7}  {'off-policy':>10}  {'max length':>10}"
    )
    lines = [hdr, "-" * len(hdr)]
    for name, s in policies.items():
        mx = s["max_len_per_step"]
        speedup = "-" if s["speedup"] is None else f"{s['speedup']:.2f}x"
        lines.append(
            f"{name:<14}  {s['steps']:>5}  {s['rollout_s_per_step']:>7.2f}  {speedup:>7}  "
            f"{s['bubble_ratio']:>6.1%}  {s['efficiency']:>10.1%}  {s['policy_lag']:>8.2f}  "
            f"{s['policy_lag_max']:>7}  {s['off_policy_frac']:>10.1%}  {sum(mx) / max(1, len(mx)):>10.0f}"
        )
    for name, s in policies.items():
        if s["speedup_note"]:
            lines += wrap(f"note: {name}: {s['speedup_note']}")
    return lines + legend(_TIME_LEGEND)


_TOKEN_LEGEND = (
    ("generated", "tokens the engine decoded = useful + wasted + cached"),
    ("trained", "tokens of the trained responses = useful + resumed"),
    ("useful", "tokens generated and trained in the same step"),
    ("wasted", "tokens generated, then thrown away (aborted or scavenged responses)"),
    ("cached", "tokens generated and kept for a later step = resumed + left cached + dropped stale"),
    ("resumed", "cached tokens trained in a later step"),
    ("left cached", "cached tokens still in the rollout buffer when the arm ended"),
    ("dropped stale", "cached tokens dropped by partial rollout's staleness bound (and regenerated)"),
)


def _token_table_lines(policies: dict[str, dict[str, Any]]) -> list[str]:
    """Where each arm's generated tokens went (totals over its own steps); the legend."""
    keys = (
        "tokens_generated",
        "tokens_trained",
        "tokens_useful",
        "tokens_wasted",
        "tokens_cached",
        "tokens_resumed",
        "tokens_left_cached",
        "tokens_dropped_stale",
    )
    widths = [(key, max(9, len(term))) for key, (term, _) in zip(keys, _TOKEN_LEGEND, strict=True)]
    hdr = f"{'policy':<14}" + "".join(
        f"  {term:>{w}}" for (_, w), (term, _) in zip(widths, _TOKEN_LEGEND, strict=True)
    )
    lines = ["tokens per arm (totals over the arm's own steps):", hdr, "-" * len(hdr)]
    for name, s in policies.items():
        lines.append(f"{name:<14}" + "".join(f"  {s[key]:>{w}}" for key, w in widths))
    return lines + legend(_TOKEN_LEGEND)


def _tail_batching_lines(tb: dict[str, Any]) -> list[str]:
    """Tail batching's round kinds."""
    return [
        "",
        *wrap(
            f"tail batching: {tb['short_rounds']} short + {tb['long_rounds']} long rounds; "
            f"P75 length per step {percentile(tb['p75_len_per_step'], 50):.0f} (median over steps)"
        ),
    ]


def _sortedrl_lines(report: dict[str, Any]) -> list[str]:
    """The measured SortedRL bubble ratios beside the paper's (empty when no sorted arm ran)."""
    ref = report.get("sortedrl_reference")
    if ref is None or len(ref["measured"]["bubble_ratio"]) <= 1:
        return []
    m, pp = ref["measured"]["bubble_ratio"], ref["paper"]["bubble_ratio"]
    pol = report["policies"]
    ours = ", ".join(
        f"{k} {v:.1%} ({pol[k]['bubble_ratio_before_drain']:.1%} before each group's drain)"
        for k, v in m.items()
        if k != "baseline"
    )
    parts = "; ".join(
        f"{k} {pol[k]['bubble_ratio']:.1%} = {pol[k]['bubble_outside_steps']:.1%} outside engine steps + "
        f"{pol[k]['bubble_under_filled']:.1%} under-filled steps"
        + (
            f" ({pol[k]['bubble_in_drains']:.1%} of it in the groups' last rounds)"
            if pol[k].get("bubble_in_drains") is not None
            else ""
        )
        for k in ("sync", *(k for k in m if k != "baseline"))
        if "bubble_outside_steps" in pol.get(k, {})
    )
    return [
        "",
        *wrap(
            f"SortedRL bubble ratio: measured sync {m['baseline']:.1%} -> {ours}; "
            "the SortedRL paper (arXiv:2603.23414 sec. 4.4.1) "
            f"baseline {pp['baseline']:.0%} -> sorted {pp['sorted']:.2%}, "
            f"sorted_partial {pp['sorted_partial']:.2%}"
        ),
        *(wrap(f"where the idle slots went: {parts}") if parts else []),
    ]


_SCALEDOWN_LEGEND = (
    ("rounds", "rounds the arm ran"),
    ("scaled", "rounds that scaled down"),
    ("done at", "mean share of the round's requests completed (|R_comp|/|R|) at the decision"),
    ("freed", "replicas freed, summed over the rounds"),
    ("migrated", "running requests moved from the freed replicas to the kept ones"),
    (
        "freed replica-s",
        "freed replicas x (round end - decision), seconds: the time the trainer could have used",
    ),
    ("of rollout", "freed replica-s as a share of all replica-seconds of the rollout"),
    (
        "KV refused",
        "attempts refused by the KV-fit criterion (the projected KV does not fit on the kept replicas)",
    ),
    ("pick aborted", "attempts with fewer than 2 replicas to split"),
)


def _scaledown_lines(report: dict[str, Any]) -> list[str]:
    """The scale-down block of ``render_table``: Algorithm 1's decisions, per arm (empty when off)."""
    info = report["config"].get("scaledown")
    if not info:
        return []
    lo, hi, step = info["milestones"]
    kv = (
        f"{info['replica_kv_tokens']} KV tokens each ({info['kv_source']})"
        if info["kv_checked"]
        else "KV capacity unknown (the engine reports no KV usage; fit not checked)"
    )
    lines = [
        "",
        *wrap(
            "scale-down: Algorithm 1's decision on this trace (computed on the rounds, not enacted: "
            "no measured speedup)"
        ),
        *wrap(f"layout: {info['replicas']} DP replicas x TP {info['tp_size']}, {kv}", indent="  "),
        *wrap(
            f"milestones {lo:.0%}-{hi:.0%} of |R| every {step:.0%}; frees {info['fraction']:.0%} of the "
            "replicas (whole replicas only)",
            indent="  ",
        ),
    ]
    hdr = (
        f"  {'policy':<14} {'rounds':>6} {'scaled':>6} {'done at':>7} {'freed':>6} {'migrated':>8} "
        f"{'freed replica-s':>15} {'of rollout':>10} {'KV refused':>10} {'pick aborted':>12}"
    )
    lines += [hdr, "  " + "-" * (len(hdr) - 2)]
    for name, s in report["policies"].items():
        sd = s.get("scaledown")
        if sd is None:
            continue
        frac = sd["completed_frac_mean"]
        lines.append(
            f"  {name:<14} {sd['rounds']:>6} {sd['rounds_scaled_down']:>6} "
            f"{'-' if frac is None else f'{frac:.1%}':>7} {sd['replicas_freed']:>6} "
            f"{sd['requests_migrated']:>8} {sd['freed_replica_s']:>15.2f} {sd['freed_share']:>10.1%} "
            f"{sd['refused_kv']:>10} {sd['aborted_pick']:>12}"
        )
    return lines + legend(_SCALEDOWN_LEGEND, indent="  ")


def write_report(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


def load_trace(trace: Path | None, preset: str, seed: int) -> tuple[list[TraceRecord], str]:
    """A trace file, or a preset's seeded trace; and where it came from."""

    if trace is not None:
        if not trace.is_file():
            raise RollpackerError(f"trace file {trace} does not exist")
        return list(parse_lines(trace.read_text().splitlines(), source=str(trace))), str(trace)
    if preset not in TRACE_PRESETS:
        raise RollpackerError(f"unknown preset {preset!r}; use one of {sorted(TRACE_PRESETS)}")
    return list(generate(TRACE_PRESETS[preset], seed=seed)), f"preset:{preset}"


def make_engine(
    kind: str, model: str, concurrency: int, kv_gib: int, max_model_len: int, seed: int
) -> RolloutEngine:
    """The engine to replay on: ``vllm`` (a tiny-model preset or a model directory) or ``fake``
    (the simulated engine, for dry runs)."""

    if kind == "fake":
        return FakeEngine(concurrency=concurrency, base_s=0.0025, per_seq_s=0.00007)
    if kind != "vllm":
        raise RollpackerError(f"--engine {kind!r}: use `vllm` or `fake`")

    model_dir = str(build_tiny_model(model)) if model in MODEL_PRESETS else model
    cfg = EngineConfig(
        model_dir=model_dir,
        max_num_seqs=concurrency,
        max_model_len=max(256, max_model_len),
        kv_cache_gib=kv_gib,
        seed=seed,
    )
    return VLLMEngine(cfg)
