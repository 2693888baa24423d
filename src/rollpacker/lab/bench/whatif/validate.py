"""``rollpacker lab bench whatif``: does the simulator predict the real engine?

One real vLLM engine (a tiny-model preset, one replica) is started once. Then, per validation
trace, in this order (a fresh fit per trace: on a shared machine the load drifts over minutes):

1. **fit**: ``rollpacker lab profile``'s measurement (``engines.profiler.profile_engines``: random
   prefixes of L tokens for B requests, prefill timed, then a decode window) over a batch x context
   grid: the only thing the simulator learns from the machine;
   ``fits`` of them, half before the replay and half after, and their point-wise median: the
   shared machine's load comes in bursts and drifts over minutes, and neither is the simulator's
   error;
2. **measure**: the replay benchmark's arms on the real engine (between the fits);
3. **predict**: the same arms, trace and settings on the simulated engine priced by the median
   profile (``ProfileCost``); the trace never touches a fit;
4. **error** per policy: ``|simulated - real| / real`` of rollout seconds per trained step, for each
   trace; the mean over the traces is the policy's mean absolute (relative) error.

The acceptance bar is a mean absolute error <= 10 % per policy on two traces.
Timings on a shared CPU are noisy: the report keeps every trace's figures, the profile, and the
engine's measured batch-scaling curve beside the simulated one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from rollpacker.core.costmodel import ProfileCost
from rollpacker.core.errors import ConfigError
from rollpacker.core.latency import Layout, Predictor, ProfilePoint, ProfileTable
from rollpacker.core.trace import TraceRecord, generate
from rollpacker.lab.bench.replay import BenchConfig, run_benchmark
from rollpacker.lab.bench.whatif.run import WhatIfConfig, simulate
from rollpacker.lab.bench.whatif.specfiles import Deployment
from rollpacker.lab.bench.whatif.traces import PRESETS

VALIDATION_POLICIES = ("sync", "tail_batching", "sorted", "partial")
LAYOUT = Layout(1, 1)
ACCEPT_MAE = 0.10


@dataclass(frozen=True)
class WhatIfValidation:
    model: str = "bench"  # tiny-model preset (tasks.tiny_model)
    traces: tuple[tuple[str, int], ...] = (("paper-cpu", 1), ("paper-cpu", 2))  # (preset, seed)
    p0: int = 8
    r0: int = 4
    max_tokens: int = 512
    periods: int = 3
    concurrency: int = 64
    kv_cache_gib: int = 2
    policies: tuple[str, ...] = VALIDATION_POLICIES
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    contexts: tuple[int, ...] = (16, 64, 256, 512)
    window: int = 32  # decode steps timed per profile point
    fits: int = 4  # profiles per trace, half before and half after the replay; their median prices it
    seed: int = 0

    def __post_init__(self) -> None:
        if self.fits < 1 or self.window < 1:
            raise ConfigError(f"validation: fits = {self.fits}, window = {self.window}: both must be >= 1")

    def whatif(self) -> WhatIfConfig:
        return WhatIfConfig(
            p0=self.p0,
            r0=self.r0,
            max_tokens=self.max_tokens,
            concurrency=self.concurrency,
            periods=self.periods,
            policies=self.policies,
            seed=self.seed,
        )


def parse_traces(text: str) -> tuple[tuple[str, int], ...]:
    """``paper-cpu:1,smoke:2`` -> ((preset, seed), ...); unknown presets and bad seeds are named."""
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        preset, _, seed = item.partition(":")
        if preset not in PRESETS or not seed.lstrip("-").isdigit():
            raise ConfigError(
                f"--traces item {item!r}: use PRESET:SEED with a preset of {', '.join(sorted(PRESETS))}"
            )
        out.append((preset, int(seed)))
    if not out:
        raise ConfigError("--traces: give at least one PRESET:SEED")
    return tuple(out)


def _start(vc: WhatIfValidation, max_len: int, say: Callable[[str], None]) -> Any:
    """The real engine: one replica of the tiny model, warmed."""
    from rollpacker.core.config import EngineConfig
    from rollpacker.engines.layout import EnginePool, node_devices
    from rollpacker.tasks.tiny_model import build_tiny_model

    cfg = EngineConfig(
        model_dir=str(build_tiny_model(vc.model)),
        max_num_seqs=vc.concurrency,
        max_model_len=max(256, max_len),
        kv_cache_gib=vc.kv_cache_gib,
        seed=vc.seed,
    )
    t0 = time.perf_counter()
    pool = EnginePool(cfg, [LAYOUT], node_devices())
    pool.warm()
    say(f"engine up in {time.perf_counter() - t0:.1f} s")
    return pool


def _profile(pool: Any, vc: WhatIfValidation, say: Callable[[str], None]) -> ProfileTable:
    from rollpacker.engines.profiler import ProfileSpec, profile_engines

    spec = ProfileSpec(
        layouts=(LAYOUT,), batches=vc.batches, contexts=vc.contexts, window=vc.window, seed=vc.seed
    )
    return profile_engines(pool.cfg, spec, pool=pool, progress=say)


def compare(
    real: dict[str, Any], sim: dict[str, Any], policies: Sequence[str]
) -> dict[str, dict[str, float]]:
    """Per policy: real and simulated rollout seconds per trained step and the relative error."""
    out = {}
    for name in policies:
        r, s = real[name]["rollout_s_per_step"], sim[name]["rollout_s_per_step"]
        out[name] = {
            "real_s_per_step": r,
            "sim_s_per_step": s,
            "error": abs(s - r) / r if r > 0 else float("inf"),
            "real_speedup": real[name]["speedup"],
            "sim_speedup": sim[name]["speedup"],
            "steps": real[name]["steps"],
        }
    return out


def mae(per_trace: Sequence[dict[str, dict[str, float]]], policies: Sequence[str]) -> dict[str, float]:
    """Mean over the traces of each policy's relative error."""
    return {n: sum(t[n]["error"] for t in per_trace) / len(per_trace) for n in policies}


def _drift(
    pred: Predictor, scaling: Sequence[dict[str, Any]], prompt_len: int = 32
) -> list[dict[str, float]]:
    """The replay's own batch-scaling measurement beside the profile's prediction at the same
    points: how much the machine changed between the fit and the replay (load, clocks)."""
    out = []
    for p in scaling:
        b = p["batch"]
        per = max(1, round(p["tokens"] / b))  # decode iterations of the measurement
        predicted = sum(pred.decode_step_s(LAYOUT, b, b * (prompt_len + i)) for i in range(per))
        out.append(
            {"batch": b, "real_step_ms": p["step_ms"], "profile_step_ms": 1e3 * predicted / max(1, per)}
        )
    return out


def median_table(tables: Sequence[ProfileTable]) -> ProfileTable:
    """The fits' point-wise median (the mean of the middle two for an even count): a burst of
    load during one fit does not move it. A point some fit lost is the median of the others."""

    def med(xs: list[float]) -> float:
        xs = sorted(xs)
        n = len(xs)
        return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2

    first = tables[0]
    layouts = []
    for la in first.layouts:
        others = [{(p.batch, p.context): p for p in t.layout(la.layout).points} for t in tables]
        pts = []
        for p in la.points:
            same = [o[(p.batch, p.context)] for o in others if (p.batch, p.context) in o]
            pts.append(
                ProfilePoint(
                    p.batch,
                    p.context,
                    med([q.tokens for q in same]),
                    med([q.prefill_s for q in same]),
                    med([q.decode_s for q in same]),
                )
            )
        layouts.append(replace(la, points=tuple(pts)))
    return replace(first, layouts=tuple(layouts), profile_seconds=sum(t.profile_seconds for t in tables))


def _trace_row(
    pool: Any, vc: WhatIfValidation, source: str, recs: list[TraceRecord], say: Callable[[str], None]
) -> Any:
    """Replay the trace on the real engine between fits of the profile (random prefixes, never the
    trace), then simulate it on their median; the comparison and the evidence behind it (the
    median profile's prediction of the replay's own batch-scaling steps)."""
    from rollpacker.lab.bench.whatif.run import policy_row

    before = [_profile(pool, vc, say) for _ in range(vc.fits // 2)]
    say(f"{source}: replaying on the real engine")
    wc = vc.whatif()
    bcfg = BenchConfig(wc.rollout(), vc.periods, seed=vc.seed, policies=vc.policies, scaledown_replicas=0)
    rep = run_benchmark(pool[LAYOUT], recs, bcfg, source=source)
    real = {n: policy_row(s) for n, s in rep["policies"].items()}
    after = [_profile(pool, vc, say) for _ in range(vc.fits - vc.fits // 2)]
    table = median_table([*before, *after])
    say(f"{source}: simulating")
    sim = simulate(recs, Deployment(ProfileCost(Predictor(table), LAYOUT), 1), wc.rollout(), wc, vc.policies,
                   vc.periods, source)  # fmt: skip
    return {
        "trace": source,
        "policies": compare(real, sim, vc.policies),
        "per_step_s": {
            n: {
                "real": rep["policies"][n]["time_s_per_step"],
                "kinds": rep["policies"][n]["round_kinds"],
            }
            for n in vc.policies
        },
        "drift": _drift(Predictor(table), rep["batch_scaling"]),
        "profile": asdict(table),
    }


def validate(vc: WhatIfValidation, say: Callable[[str], None] = lambda _s: None) -> dict[str, Any]:
    """Per validation trace: fit a profile on the real engine, simulate on it, replay for real."""
    t0 = time.perf_counter()
    # prompt ids carry the trace's index: request ids are single-use on the one real engine
    traces: list[tuple[str, list[TraceRecord]]] = [
        (
            f"preset:{p} seed {s}",
            [replace(r, prompt_id=f"t{i}-{r.prompt_id}") for r in generate(PRESETS[p], seed=s)],
        )
        for i, (p, s) in enumerate(vc.traces)
    ]
    longest = max(r.prompt_len for _, recs in traces for r in recs)
    pool = _start(vc, longest + vc.max_tokens + 8, say)
    try:
        rows = [_trace_row(pool, vc, source, recs, say) for source, recs in traces]
    finally:
        pool.close()
    errors = mae([r["policies"] for r in rows], vc.policies)
    return {
        "config": {k: getattr(vc, k) for k in vc.__dataclass_fields__},
        "traces": rows,
        "mae": errors,
        "accept_mae": ACCEPT_MAE,
        "passed": all(e <= ACCEPT_MAE for e in errors.values()),
        "seconds": time.perf_counter() - t0,
    }


def render(report: dict[str, Any]) -> str:
    from rollpacker.lab.bench.tables import legend, wrap

    pols = list(report["mae"])
    lines = wrap(
        "what-if validation: simulated (profile-priced SimEngine) vs measured (real vLLM engine) rollout "
        "seconds per trained step, per policy"
    )
    hdr = (
        f"{'trace':<24}  {'policy':<14}  {'real s/step':>11}  {'sim s/step':>10}  {'error':>6}  "
        f"{'real x':>6}  {'sim x':>6}"
    )
    lines += ["", hdr, "-" * len(hdr)]
    for t in report["traces"]:
        for n in pols:
            r = t["policies"][n]
            rx = "-" if r["real_speedup"] is None else f"{r['real_speedup']:.2f}"
            sx = "-" if r["sim_speedup"] is None else f"{r['sim_speedup']:.2f}"
            lines.append(
                f"{t['trace']:<24}  {n:<14}  {r['real_s_per_step']:>11.3f}  {r['sim_s_per_step']:>10.3f}  "
                f"{r['error']:>6.1%}  {rx:>6}  {sx:>6}"
            )
    lines += ["", "mean absolute error per policy over the traces:"]
    lines += [f"  {n:<14} {e:6.1%}" for n, e in report["mae"].items()]
    verdict = "PASS" if report["passed"] else "FAIL"
    lines += wrap(
        f"{verdict}: every policy within {report['accept_mae']:.0%}"
        if report["passed"]
        else f"{verdict}: some policy above {report['accept_mae']:.0%}"
    )
    lines += legend(
        (
            ("real s/step", "measured rollout seconds per trained step on the real engine"),
            (
                "sim s/step",
                "the simulator's, priced by the median of the profile fits (random prefixes, not the trace)",
            ),
            ("error", "|sim - real| / real"),
            ("real x / sim x", "speedup over sync, measured / simulated"),
        )
    )
    lines += ["", "machine drift: the replay's decode step (ms) beside the profile's prediction, per trace:"]
    for t in report["traces"]:
        d = ", ".join(
            f"B={x['batch']} {x['real_step_ms']:.1f}/{x['profile_step_ms']:.1f}" for x in t["drift"]
        )
        lines += wrap(f"{t['trace']}: {d}", indent="  ")
    lines.append(f"validation took {report['seconds']:.0f} s")
    return "\n".join(lines)
