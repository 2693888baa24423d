"""The replay benchmark: sync vs tail batching on the same prompts, on a real engine.

Each response is replayed at its traced length (``ignore_eos`` with ``max_tokens`` = the length),
so the scheduling effect is measured on real decoding whatever the model says. Tail batching runs
first for whole periods (short rounds up to and including a long round); the synchronous baseline
then trains exactly the prompts tail batching trained, in dataset order, in the same number of
steps. In the same run the engine's batch-scaling curve is measured, and its saturated throughput
(tokens/s at the concurrency limit) is the yardstick of rollout efficiency:

    efficiency = (useful tokens / saturated tokens-per-second) / actual rollout seconds

1.0 is the physical floor (every second spent decoding trained tokens at full batch).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rollpacker.core.config import PolicyName, RolloutConfig
from rollpacker.core.errors import ConfigError
from rollpacker.core.metrics import RolloutMetrics, percentile
from rollpacker.core.policies.base import RolloutPolicy, SamplingFactory
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


@dataclass(frozen=True)
class BenchConfig:
    rollout: RolloutConfig
    periods: int = 2  # whole tail-batching periods (short rounds ending with a long round)
    max_steps: int = 200
    scaling_tokens: int = 64  # decode tokens per request when measuring the batch-scaling curve
    seed: int = 0

    def __post_init__(self) -> None:
        if self.periods < 1:
            raise ConfigError(f"bench.periods = {self.periods}: must be >= 1")
        if self.max_steps < 1:
            raise ConfigError(f"bench.max_steps = {self.max_steps}: must be >= 1")


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

    @property
    def time_s(self) -> float:
        return sum(m.time_s for m in self.steps)

    def summary(self, concurrency: int, saturated_tps: float) -> dict[str, Any]:
        from rollpacker.core.metrics import bubble_ratio

        n = len(self.steps)
        useful = sum(m.tokens_useful for m in self.steps)
        time_s = self.time_s
        kinds = [m.round_kind for m in self.steps]
        return {
            "steps": n,
            "short_rounds": kinds.count(RoundKind.SHORT.value),
            "long_rounds": kinds.count(RoundKind.LONG.value),
            "rollout_time_s": time_s,
            "rollout_s_per_step": time_s / n if n else 0.0,
            "tokens_generated": sum(m.tokens_generated for m in self.steps),
            "tokens_useful": useful,
            "tokens_wasted": sum(m.tokens_wasted for m in self.steps),
            "engine_tokens": self.engine_tokens,
            "aborted_requests": sum(m.aborted_requests for m in self.steps),
            "preemptions": sum(m.preemptions for m in self.steps),
            "bubble_ratio": bubble_ratio(self.engine_steps, time_s, concurrency),
            "efficiency": (useful / saturated_tps) / time_s if time_s > 0 and saturated_tps > 0 else 0.0,
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
) -> PolicyRun:
    run = PolicyRun(policy=policy.name)
    t0 = time.perf_counter()
    for step in range(max_steps):
        plan = policy.plan_step(step)
        rr = run_round(engine, policy.open_round(plan))
        policy.commit(rr.result)
        run.steps.append(rr.metrics)
        run.engine_steps.extend(rr.steps)
        run.engine_tokens += rr.engine_tokens
        run.trained_prompt_ids.extend(g.prompt.prompt_id for g in rr.result.groups)
        if progress is not None:
            progress(policy.name, rr.metrics)
        if stop(policy, run.steps):
            break
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
    tb_cfg = RolloutConfig(**{**asdict(rc), "policy": PolicyName.TAIL_BATCHING})
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
    sync_cfg = RolloutConfig(**{**asdict(rc), "policy": PolicyName.SYNC})
    sync = SyncPolicy(sync_cfg, PromptCursor(same, shuffle=False, epochs=1), sampling, namespace="sync")
    log("running the synchronous baseline on the same prompts")
    n_steps = len(tb_run.steps)
    sync_run = run_policy(engine, sync, lambda _p, steps: len(steps) >= n_steps, n_steps, progress)

    summaries = {
        "sync": sync_run.summary(engine.concurrency, sat),
        "tail_batching": tb_run.summary(engine.concurrency, sat),
    }
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
        "per_step": {
            "sync": [m.as_dict() for m in sync_run.steps],
            "tail_batching": [m.as_dict() for m in tb_run.steps],
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
        f"{'generated':>10} {'wasted':>8} {'max len/step (mean)':>20}"
    )
    lines.append(hdr)
    lines.append("-" * len(hdr))
    for name, s in report["policies"].items():
        mx = s["max_len_per_step"]
        lines.append(
            f"{name:<14} {s['steps']:>5} {s['rollout_s_per_step']:>8.2f} {s['speedup']:>7.2f}x "
            f"{s['bubble_ratio']:>7.1%} {s['efficiency']:>7.1%} {s['tokens_generated']:>10} "
            f"{s['tokens_wasted']:>8} {sum(mx) / max(1, len(mx)):>20.0f}"
        )
    tb = report["policies"]["tail_batching"]
    lines.append("")
    lines.append(
        f"tail batching: {tb['short_rounds']} short + {tb['long_rounds']} long rounds; "
        f"P75 length per step {percentile(tb['p75_len_per_step'], 50):.0f} (median over steps)"
    )
    return "\n".join(lines)


def write_report(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
