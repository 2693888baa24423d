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

The SortedRL paper's bubble-ratio reduction (74 % baseline -> 5.81 % on-policy, 3.37 % partial,
paper 003 section 4.4.1) is reported beside the measured sync -> sorted figures
(``sortedrl_reference``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rollpacker.core.config import PolicyName, RolloutConfig, SortedConfig, SortedMode
from rollpacker.core.errors import ConfigError, PolicyError
from rollpacker.core.metrics import RolloutMetrics, percentile
from rollpacker.core.policies.base import RolloutPolicy, SamplingFactory
from rollpacker.core.policies.partial import PartialPolicy
from rollpacker.core.policies.sorted import SortedPolicy
from rollpacker.core.policies.sync import SyncPolicy
from rollpacker.core.policies.tail_batching import TailBatchingPolicy
from rollpacker.core.prompts import PromptCursor
from rollpacker.core.trace import TraceRecord, check_serves, length_stats, to_prompts
from rollpacker.core.types import (
    EngineStepStats,
    GenerationRequest,
    Prompt,
    RoundKind,
    SamplingSpec,
)
from rollpacker.engines.base import RolloutEngine
from rollpacker.rollout.driver import run_round

SCALING_BATCHES = (1, 8, 32, 128)

# Every arm the benchmark knows, in report order; the first two are the baseline and always run.
ALL_POLICIES = ("sync", "tail_batching", "sorted", "sorted_partial", "partial")
BASELINE_POLICIES = ("sync", "tail_batching")

# SortedRL (paper 003), section 4.4.1: bubble ratio (eq. 4) of the synchronous baseline and of the
# two SortedRL modes, 512 samples in 4 batches, max generation length 8k, lengths replayed.
SORTEDRL_PAPER_BUBBLE = {"baseline": 0.74, "sorted": 0.0581, "sorted_partial": 0.0337}


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

    def __post_init__(self) -> None:
        if self.periods < 1:
            raise ConfigError(f"bench.periods = {self.periods}: must be >= 1")
        if self.max_steps < 1:
            raise ConfigError(f"bench.max_steps = {self.max_steps}: must be >= 1")
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

    @property
    def time_s(self) -> float:
        return sum(m.time_s for m in self.steps)

    def summary(self, concurrency: int, saturated_tps: float) -> dict[str, Any]:
        from rollpacker.core.metrics import bubble_ratio

        n = len(self.steps)
        useful = sum(m.tokens_useful for m in self.steps)
        cached = sum(m.tokens_cached for m in self.steps)
        time_s = self.time_s
        kinds = [m.round_kind for m in self.steps]
        # token-weighted over the whole arm: each step's mean lag weighs by its trained tokens
        trained = sum(self.step_trained_tokens)
        lag = sum(m.policy_lag * t for m, t in zip(self.steps, self.step_trained_tokens, strict=True))
        off = sum(m.off_policy_frac * t for m, t in zip(self.steps, self.step_trained_tokens, strict=True))
        return {
            "steps": n,
            "short_rounds": kinds.count(RoundKind.SHORT.value),
            "long_rounds": kinds.count(RoundKind.LONG.value),
            "rollout_time_s": time_s,
            "rollout_s_per_step": time_s / n if n else 0.0,
            "tokens_generated": sum(m.tokens_generated for m in self.steps),
            "tokens_useful": useful,
            "tokens_wasted": sum(m.tokens_wasted for m in self.steps),
            "tokens_cached": cached,
            "tokens_trained": trained,
            "tokens_resumed": self.resumed_tokens,
            "tokens_left_cached": self.left_cached_tokens,
            "tokens_dropped_stale": cached - self.resumed_tokens - self.left_cached_tokens,
            "engine_tokens": self.engine_tokens,
            "aborted_requests": sum(m.aborted_requests for m in self.steps),
            "preemptions": sum(m.preemptions for m in self.steps),
            "bubble_ratio": bubble_ratio(self.engine_steps, time_s, concurrency),
            "efficiency": ((trained / saturated_tps) / time_s if time_s > 0 and saturated_tps > 0 else 0.0),
            "policy_lag": lag / trained if trained else 0.0,
            "policy_lag_max": max((m.policy_lag_max for m in self.steps), default=0),
            "off_policy_frac": off / trained if trained else 0.0,
            "trace_used_up": self.trace_used_up,
            "max_len_per_step": [m.response_len_max for m in self.steps],
            "p75_len_per_step": [m.response_len_p75 for m in self.steps],
            "time_s_per_step": [m.time_s for m in self.steps],
            "round_kinds": kinds,
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
) -> PolicyRun:
    """Run ``policy`` until ``stop`` says so, ``max_steps`` steps, or the trace cannot fill the next
    step (``trace_used_up``). The policy version is the step index: one update per step, so the
    lag of resumed tokens is measured as in training."""
    name = label or policy.name
    run = PolicyRun(policy=name)
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
        rr = run_round(engine, policy.open_round(plan), policy_version=step)
        policy.commit(rr.result)
        run.steps.append(rr.metrics)
        run.engine_steps.extend(rr.steps)
        run.engine_tokens += rr.engine_tokens
        run.trained_prompt_ids.extend(g.prompt.prompt_id for g in rr.result.groups)
        responses = [c for g in rr.result.groups for c in g.responses]
        run.step_trained_tokens.append(sum(c.num_tokens for c in responses))
        run.resumed_tokens += sum(c.resumed_tokens for c in responses)
        if progress is not None:
            progress(name, rr.metrics)
        if stop(policy, run.steps):
            break
    if isinstance(policy, (SortedPolicy, PartialPolicy)):
        run.left_cached_tokens = sum(len(x.token_ids) for e in policy.buffer for x in e.samples)
    run.wall_s = time.perf_counter() - t0
    return run


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

    log("measuring the engine's batch-scaling curve")
    measure_scaling(engine, (8,), 16, tag="warmup")  # first steps pay one-off costs
    batches = sorted(set(SCALING_BATCHES) | {engine.concurrency})
    scaling = measure_scaling(engine, batches, cfg.scaling_tokens)
    sat = max(p.tokens_per_s for p in scaling if p.batch <= engine.concurrency)

    # Tail batching first: it decides which prompts a whole number of periods trains.
    tb_cfg = replace(rc, policy=PolicyName.TAIL_BATCHING)
    tb = TailBatchingPolicy(tb_cfg, PromptCursor(prompts, shuffle=False, epochs=1), sampling, namespace="tb")
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

    log("running tail batching")
    tb_run = run_policy(engine, tb, tb_stop, cfg.max_steps, progress)
    if not any(m.round_kind == RoundKind.LONG.value for m in tb_run.steps) and speculates_prompts:
        log("note: no long round completed; the trace is too short for a whole period")

    # The baseline trains exactly the same prompts, in dataset order, in as many steps.
    trained = set(tb_run.trained_prompt_ids)
    same = [p for p in prompts if p.prompt_id in trained]
    sync_cfg = replace(rc, policy=PolicyName.SYNC)
    sync = SyncPolicy(sync_cfg, PromptCursor(same, shuffle=False, epochs=1), sampling, namespace="sync")
    log("running the synchronous baseline on the same prompts")
    n_steps = len(tb_run.steps)
    sync_run = run_policy(engine, sync, _after(n_steps), n_steps, progress)

    runs = {"sync": sync_run, "tail_batching": tb_run}

    # The buffered arms: the whole trace in file order, their own choice of prompts.
    by_id = {p.prompt_id: p for p in prompts}
    n = rc.sorted.group_size
    groups = -(-n_steps // n)
    whole = groups * n * rc.prompts_per_step <= len(prompts)
    sorted_steps = groups * n if whole else n_steps
    in_flight = rc.partial.in_flight or min(engine.concurrency, rc.prompts_per_step * rc.responses_per_prompt)
    for name in cfg.policies:
        if name in runs:
            continue
        cursor = PromptCursor(prompts, shuffle=False, epochs=1)
        policy: RolloutPolicy
        if name in ("sorted", "sorted_partial"):
            mode = SortedMode.PARTIAL if name == "sorted_partial" else SortedMode.ON_POLICY
            pcfg = replace(rc, policy=PolicyName.SORTED, sorted=SortedConfig(mode=mode, group_size=n))
            policy = SortedPolicy(pcfg, cursor, sampling, by_id, namespace=name)
            steps = sorted_steps
            log(
                f"running {name} (SortedRL {mode.value}, n={n}) for {steps} steps"
                + (
                    ""
                    if whole
                    else f" (the trace holds fewer than {groups} groups of {n * rc.prompts_per_step})"
                )
            )
        else:
            pcfg = replace(rc, policy=PolicyName.PARTIAL)
            policy = PartialPolicy(pcfg, cursor, sampling, by_id, in_flight=in_flight, namespace=name)
            steps = n_steps
            log(f"running partial rollout ({in_flight} requests in flight) for {steps} steps")
        runs[name] = run_policy(engine, policy, _after(steps), steps, progress, label=name)
        if runs[name].trace_used_up:
            log(f"note: {name} used up the trace after {len(runs[name].steps)} steps")

    summaries = {name: runs[name].summary(engine.concurrency, sat) for name in ALL_POLICIES if name in runs}
    base = summaries["sync"]["rollout_s_per_step"]
    for s in summaries.values():
        s["speedup"] = base / s["rollout_s_per_step"] if s["rollout_s_per_step"] > 0 else 0.0
    trace_stats = length_stats(records, rc.launched_responses)
    return {
        "config": {
            "P0": rc.prompts_per_step,
            "R0": rc.responses_per_prompt,
            "eta_p": rc.eta_p,
            "eta_r": rc.eta_r,
            "max_tokens": rc.max_tokens,
            "periods": cfg.periods,
            "policies": list(summaries),
            "group_size": n,
            "sorted_steps": sorted_steps,
            "partial_in_flight": in_flight,
            "partial_max_staleness": rc.partial.max_staleness,
            "concurrency": engine.concurrency,
            "tp_size": engine.tp_size,
            "seed": cfg.seed,
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
        "trained_prompts_identical": sorted(trained) == sorted(sync_run.trained_prompt_ids),
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
        "source": "SortedRL (paper 003) section 4.4.1: 512 samples in 4 batches, max length 8k, "
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
    """The human-readable summary printed by ``rollpacker bench rollout``."""
    lines = []
    c = report["config"]
    t = report["trace"]
    lines.append(
        f"trace {t['source']}: {t['prompts']} prompts; response length max {t['max']:.0f}, "
        f"P75 {t['p75']:.0f}, median {t['p50']:.0f}"
    )
    lines.append(
        f"P0={c['P0']} R0={c['R0']} eta_p={c['eta_p']} eta_r={c['eta_r']} max_tokens={c['max_tokens']} "
        f"concurrency Q={c['concurrency']} TP={c['tp_size']}"
    )
    lines.append("")
    lines.append("engine batch scaling (decode):")
    lines.append(f"  {'batch':>6} {'tokens/s':>10} {'ms/step':>9}")
    for p in report["batch_scaling"]:
        lines.append(f"  {p['batch']:>6} {p['tokens_per_s']:>10.0f} {p['step_ms']:>9.2f}")
    r = report.get("step_time_ratio_128_vs_1")
    if r is not None:
        lines.append(f"  step time at batch 128 / batch 1 = {r:.2f}x (1.0 = perfectly memory-bound)")
    lines.append("")
    hdr = (
        f"{'policy':<14} {'steps':>5} {'s/step':>8} {'speedup':>8} {'bubble':>7} {'effic.':>7} "
        f"{'lag':>5} {'lag max':>7} {'off-pol':>7} "
        f"{'generated':>10} {'useful':>9} {'wasted':>8} {'cached':>8} {'max len/step (mean)':>20}"
    )
    lines.append(hdr)
    lines.append("-" * len(hdr))
    for name, s in report["policies"].items():
        mx = s["max_len_per_step"]
        lines.append(
            f"{name:<14} {s['steps']:>5} {s['rollout_s_per_step']:>8.2f} {s['speedup']:>7.2f}x "
            f"{s['bubble_ratio']:>7.1%} {s['efficiency']:>7.1%} "
            f"{s['policy_lag']:>5.2f} {s['policy_lag_max']:>7} {s['off_policy_frac']:>7.1%} "
            f"{s['tokens_generated']:>10} {s['tokens_useful']:>9} {s['tokens_wasted']:>8} "
            f"{s['tokens_cached']:>8} {sum(mx) / max(1, len(mx)):>20.0f}"
            + ("  (trace used up)" if s.get("trace_used_up") else "")
        )
    tb = report["policies"]["tail_batching"]
    lines.append("")
    lines.append(
        f"tail batching: {tb['short_rounds']} short + {tb['long_rounds']} long rounds; "
        f"P75 length per step {percentile(tb['p75_len_per_step'], 50):.0f} (median over steps)"
    )
    buffered = [k for k in ("sorted", "sorted_partial", "partial") if k in report["policies"]]
    if buffered:
        lines.append(
            "buffered arms (lag = token-weighted policy-version lag of trained tokens, one update per "
            "step): "
            + "; ".join(
                f"{k} {report['policies'][k]['tokens_resumed']} resumed, "
                f"{report['policies'][k]['tokens_left_cached']} left cached"
                + (
                    f", {report['policies'][k]['tokens_dropped_stale']} dropped as stale"
                    if report["policies"][k]["tokens_dropped_stale"]
                    else ""
                )
                for k in buffered
            )
        )
    ref = report.get("sortedrl_reference")
    if ref is not None and len(ref["measured"]["bubble_ratio"]) > 1:
        m, pp = ref["measured"]["bubble_ratio"], ref["paper"]["bubble_ratio"]
        ours = ", ".join(f"{k} {v:.1%}" for k, v in m.items() if k != "baseline")
        lines.append(
            f"SortedRL bubble ratio: measured sync {m['baseline']:.1%} -> {ours}; paper (003 sec. 4.4.1) "
            f"baseline {pp['baseline']:.0%} -> sorted {pp['sorted']:.2%}, "
            f"sorted_partial {pp['sorted_partial']:.2%}"
        )
    return "\n".join(lines)


def write_report(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
