"""The reward-tail benchmark: reward time left after rollout, with and without reference anchors.

A code step's reward tail (``reward/tail_s``) is the scoring left when rollout ends. Its worst
part is a doomed (never-terminating) response whose test cases have no adaptive-timeout anchor
yet -- no correct sibling has finished -- so it runs to ``T_max``. Reference anchors
(``reward.sandbox.reference_anchors``, ``rewards/reference.py``) time each example's reference
solution first, so such a response is cut at ``max(T_min, lambda * T_reference)`` instead.

``run_reward_tail_bench`` drives the real ``RewardService`` (in this process, the real nsjail
sandbox, the config's ``reward.sandbox`` settings; configs/code.yaml by default) through the calls
a rollout makes: for each of ``steps`` steps, fresh prompts of the synthetic code task (``P0`` of
them, ``R0`` responses each, from the config), each response arriving at a time drawn from a
long-tailed (log-normal) length distribution scaled to ``rollout_s``, ``score`` at its arrival and
``group`` when a prompt's last response has arrived; then ``drain`` with ``measure_sync_stage``,
whose ``reward/tail_s`` and ``reward/sync_stage_s`` (the same responses scored again all at once
from the anchors the step began with: the synchronous stage) are what training logs. Anchors go
from each step's drain to the next step's ``begin``, as in the controller state. The two arms --
reference anchors off, then on -- run the same responses with the same arrival times, step by step
interleaved (so load drift on a shared machine hits both alike), each from empty anchors.

Responses: the reference program (correct; up to +25 % loop work, as correct programs differ),
``slow_share`` correct ones with extra work of ``slow_case_s`` seconds per test case (inefficient
but correct: what an adaptive limit may wrongly cut), ``wrong_share`` wrong ones (fail at once) and
``doomed_share`` never-terminating ones (``synthetic_code.nonterminating_variant``), in fences as a
model writes them. The defaults follow docs/benchmarks.md's code run (6-11 timeouts of 64
responses per step, rollout 2.5-6 s).

Verified cuts: every response a limit cut (``cut_at_s > 0``) is run again alone at ``t_max_s`` (the
limit a fixed-timeout stage would give it); ``correct_cut`` counts those that then pass -- correct
responses the adaptive limit misjudged. Nothing online can tell this without such a re-run (which
would cost the tail it saves), so training logs only ``reward/cut``.
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from rollpacker.core.config import ExperimentConfig, apply_overrides, config_from_text, resolve_config
from rollpacker.core.errors import ConfigError
from rollpacker.core.tasks import TaskExample
from rollpacker.core.types import Completion, FinishReason, Group, Prompt
from rollpacker.lab.bench.tables import legend, wrap
from rollpacker.tasks import synthetic_code

if TYPE_CHECKING:
    from rollpacker.rewards.base import RewardResult
    from rollpacker.services.api import Anchors, DrainReport, Peers
    from rollpacker.services.reward import RewardService

ARMS: tuple[tuple[str, bool], ...] = (("no_reference", False), ("reference", True))
KINDS: tuple[str, ...] = ("correct", "slow", "wrong", "doomed")


@dataclass(frozen=True)
class Response:
    request_id: str
    example: TaskExample
    index: int
    text: str
    kind: str  # one of KINDS
    arrive_s: float  # seconds after the step's rollout started


class _NoTrainer:
    def submit(self, attempt: str, prompt_id: str, samples: tuple[Any, ...]) -> None:
        pass


class _Peers:
    """The reward service's peers here: a trainer that takes the rewarded groups and drops them."""

    def trainer(self) -> _NoTrainer:
        return _NoTrainer()

    def rollout(self) -> Any:
        raise RuntimeError("the reward-tail bench has no rollout service")

    def reward(self, role: str) -> Any:
        raise RuntimeError("the reward-tail bench has one reward service")

    def cast_failure(self, attempt: str) -> str | None:
        return None  # the trainer here never fails

    def refresh(self) -> None:
        pass


def _config_text(text: str, where: str, references: bool) -> str:
    import yaml

    data = yaml.safe_load(text) or {}
    overrides = {"reward.sandbox.reference_anchors": references, "reward.measure_sync_stage": True}
    apply_overrides(data, overrides, where)
    return str(yaml.safe_dump(data, sort_keys=False))


def _loop_s() -> float:
    """Seconds per iteration of ``for _k in range(n): pass`` here."""
    n = 2_000_000
    t0 = time.perf_counter()
    for _ in range(n):
        pass
    return (time.perf_counter() - t0) / n


def _program(
    ex: TaskExample, kind: str, rng: random.Random, loop_s: float, slow_case_s: tuple[float, float]
) -> str:
    from rollpacker.lab.bench.reward import _with_extra_work

    if kind == "doomed":
        return synthetic_code.nonterminating_variant(ex)
    if kind == "wrong":
        return synthetic_code.wrong_variant(ex)
    ref = synthetic_code.reference_solution(ex)
    if kind == "slow":
        target = math.exp(rng.uniform(math.log(slow_case_s[0]), math.log(slow_case_s[1])))
        return _with_extra_work(ref, max(1, round(target / loop_s)))
    steps_x_stride = int(ex.metadata["steps"]) * int(ex.metadata["stride"])
    extra = round(rng.uniform(0.0, 0.25) * steps_x_stride)
    return _with_extra_work(ref, extra) if extra else ref


def make_steps(
    cfg: ExperimentConfig,
    steps: int,
    rollout_s: float,
    shares: dict[str, float],
    slow_case_s: tuple[float, float],
    seed: int,
) -> list[list[Response]]:
    """Each step's responses in arrival order (see the module docstring)."""
    from rollpacker.tasks.registry import load_task

    t = cfg.task
    examples = [
        ex
        for ex in load_task(t.name, seed=t.seed, num_examples=t.num_examples, shape=t.shape.items())
        if "stride" in ex.metadata
    ]
    if not examples:
        raise ConfigError(
            f"task {t.name!r}: the reward-tail bench needs synthetic code examples (task.name: "
            "synthetic_code, as in configs/code.yaml) to write wrong and never-terminating responses"
        )
    rng = random.Random(f"bench-reward-tail:{seed}")
    rng.shuffle(examples)
    p0, r0 = cfg.rollout.prompts_per_step, cfg.rollout.responses_per_prompt
    if steps * p0 > len(examples):
        raise ConfigError(
            f"{steps} steps x {p0} prompts need {steps * p0} examples; the task has {len(examples)}"
        )
    loop_s = _loop_s()
    out = []
    for s in range(steps):
        lengths: list[tuple[float, TaskExample, int, str]] = []
        for ex in examples[s * p0 : (s + 1) * p0]:
            for j in range(r0):
                kind = _kind(rng.random(), shares)
                lengths.append((math.exp(rng.gauss(0.0, 0.6)), ex, j, kind))
        longest = max(x[0] for x in lengths)
        step = [
            Response(
                f"s{s}/{ex.example_id}/r{j}",
                ex,
                j,
                f"```python\n{_program(ex, kind, rng, loop_s, slow_case_s)}\n```\n",
                kind,
                rollout_s * length / longest,
            )
            for length, ex, j, kind in lengths
        ]
        out.append(sorted(step, key=lambda r: r.arrive_s))
    return out


def _kind(u: float, shares: dict[str, float]) -> str:
    """The response kind for a uniform draw ``u``: doomed, wrong, slow, then correct."""
    for k in ("doomed", "wrong", "slow"):
        if u < shares[k]:
            return k
        u -= shares[k]
    return "correct"


def _group(ex: TaskExample, rs: list[Response]) -> Group:
    prompt = Prompt(ex.example_id, (1,))
    return Group(
        prompt,
        tuple(
            Completion(r.request_id, ex.example_id, r.index, (1,), (0.0,), FinishReason.STOP)
            for r in sorted(rs, key=lambda r: r.index)
        ),
    )


def _run_step(
    svc: RewardService, attempt: str, anchors: Anchors, responses: list[Response]
) -> tuple[DrainReport, list[RewardResult]]:
    """One step's rollout-shaped calls on the service; its drain report and results."""
    svc.begin(attempt, anchors)
    per_prompt: dict[str, list[Response]] = {}
    want = {r.example.example_id: sum(x.example is r.example for x in responses) for r in responses}
    t0 = time.perf_counter()
    for r in responses:
        time.sleep(max(0.0, t0 + r.arrive_s - time.perf_counter()))
        svc.score(attempt, r.request_id, r.example.example_id, r.text)
        got = per_prompt.setdefault(r.example.example_id, [])
        got.append(r)
        if len(got) == want[r.example.example_id]:
            group = _group(r.example, got)
            svc.group(attempt, group, tuple(x.text for x in sorted(got, key=lambda x: x.index)))
    end_wall = time.time()
    report = svc.drain(attempt, tuple(per_prompt), end_wall)
    return report, list(svc.results(attempt))


def _verify(cut: dict[str, Response], t_max_s: float, workers: int) -> dict[str, bool]:
    """Request id -> whether its program passes when run alone at ``t_max_s`` (one run per program)."""
    from rollpacker.rewards.code import extract_program
    from rollpacker.rewards.sandbox import Sandbox, SandboxLimits

    sb = Sandbox(SandboxLimits(wall_s=2 * t_max_s + 5, cpu_s=2 * t_max_s + 5))
    programs = {(r.example.example_id, extract_program(r.example, r.text)): r for r in cut.values()}
    with ThreadPoolExecutor(workers) as pool:
        passed = dict(
            zip(
                programs,
                pool.map(lambda key: sb.run(key[1], programs[key].example.tests, t_max_s).passed, programs),
                strict=True,
            )
        )
    return {rid: passed[(r.example.example_id, extract_program(r.example, r.text))] for rid, r in cut.items()}


def _run_arms(
    text: str, where: str, arm: str, workload: list[list[Response]], progress: bool
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, list[RewardResult]]]:
    """Every step through one reward service per arm (steps interleaved): each arm's per-step
    metrics and its grouped responses' results."""
    from tqdm import tqdm

    from rollpacker.services.reward import RewardService

    services = {name: RewardService(_config_text(text, where, on), arm) for name, on in ARMS}
    for svc in services.values():
        svc.bind(cast("Peers", _Peers()))
    per_step: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in ARMS}
    results: dict[str, list[RewardResult]] = {name: [] for name, _ in ARMS}
    anchors: dict[str, Anchors] = {name: () for name, _ in ARMS}
    bar = tqdm(total=len(workload) * len(ARMS), desc="reward-tail bench", unit="step", disable=not progress)
    try:
        for s, responses in enumerate(workload):
            for name, _ in ARMS:
                report, res = _run_step(services[name], f"{name}-{s}", anchors[name], responses)
                anchors[name] = report.timeout_anchors
                per_step[name].append(
                    {"drain_s": report.drain_s, "anchors": len(report.timeout_anchors), **report.metrics}
                )
                results[name].extend(res)
                bar.update(1)
    finally:
        bar.close()
        for svc in services.values():
            svc.close()
    return per_step, results


def run_reward_tail_bench(
    config: str | os.PathLike[str] = "code",
    steps: int = 3,
    rollout_s: float = 4.0,
    doomed_share: float = 0.15,
    wrong_share: float = 0.3,
    slow_share: float = 0.05,
    slow_case_s: tuple[float, float] = (0.2, 3.0),
    seed: int = 0,
    verify: bool = True,
    out: str | os.PathLike[str] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Reward tail and synchronous stage, reference anchors off vs on (module docstring); the
    report as a dict, also written as JSON to ``out`` when given."""
    shares = {"doomed": doomed_share, "wrong": wrong_share, "slow": slow_share}
    if any(not 0 <= v <= 1 for v in shares.values()) or sum(shares.values()) > 1:
        raise ConfigError(f"response shares {shares}: each in [0, 1], together at most 1")
    shares["correct"] = 1 - sum(shares.values())
    if steps < 1 or not rollout_s > 0:
        raise ConfigError(f"steps = {steps}, rollout_s = {rollout_s}: need steps >= 1 and rollout_s > 0")
    path = resolve_config(config)
    text = path.read_text()
    cfg = config_from_text(text, str(path))
    workload = make_steps(cfg, steps, rollout_s, shares, slow_case_s, seed)
    per_step, results = _run_arms(text, str(path), cfg.arm_names[0], workload, progress)
    report = _report(cfg, workload, per_step, results, verify, progress)
    report["config"] = {
        "path": str(path),
        "steps": steps,
        "rollout_s": rollout_s,
        "shares": shares,
        "slow_case_s": list(slow_case_s),
        "seed": seed,
    }
    if out is not None:
        Path(out).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    return report


def _report(
    cfg: ExperimentConfig,
    workload: list[list[Response]],
    per_step: dict[str, list[dict[str, Any]]],
    results: dict[str, list[RewardResult]],
    verify: bool,
    progress: bool,
) -> dict[str, Any]:
    sb = cfg.reward.sandbox
    by_id = {r.request_id: r for step in workload for r in step}
    cut = {r.sample_id: by_id[r.sample_id] for rs in results.values() for r in rs if r.cut_at_s > 0}
    if verify and progress:
        print(f"verifying {len(cut)} cut responses at t_max_s = {sb.t_max_s:g} s ...", flush=True)
    passes = _verify(cut, sb.t_max_s, sb.workers) if verify and cut else {}
    arms: dict[str, Any] = {}
    for name, _ in ARMS:
        steps = per_step[name]
        rs = results[name]
        my_cut = [r for r in rs if r.cut_at_s > 0]

        def total(key: str, steps: list[dict[str, Any]] = steps) -> float:
            return float(sum(m.get(key, 0.0) for m in steps))

        arms[name] = {
            "tail_s": [m.get("reward/tail_s", 0.0) for m in steps],
            "tail_s_total": total("reward/tail_s"),
            "sync_stage_s": [m.get("reward/sync_stage_s", 0.0) for m in steps],
            "sync_stage_s_total": total("reward/sync_stage_s"),
            "timeouts": total("reward/timeouts"),
            "cut": len(my_cut),
            "cut_by_kind": {k: sum(by_id[r.sample_id].kind == k for r in my_cut) for k in KINDS},
            "correct_cut": sum(passes.get(r.sample_id, False) for r in my_cut) if verify else None,
            "correct_misjudged": sorted(
                r.sample_id for r in rs if by_id[r.sample_id].kind in ("correct", "slow") and not r.correct
            ),
            "reference_runs": total("reward/reference_runs"),
            "reference_failed": total("reward/reference_failed"),
            "reference_s": total("reward/reference_s"),
            "doomed_scoring_s_mean": _mean([r.elapsed_s for r in rs if by_id[r.sample_id].kind == "doomed"]),
            "per_step": steps,
        }
    kinds = {k: sum(r.kind == k for step in workload for r in step) for k in KINDS}
    return {
        "workload": {
            "task": cfg.task.name,
            "prompts_per_step": cfg.rollout.prompts_per_step,
            "responses_per_prompt": cfg.rollout.responses_per_prompt,
            "kinds": kinds,
            "sandbox": {"workers": sb.workers, "lam": sb.lam, "t_min_s": sb.t_min_s, "t_max_s": sb.t_max_s},
        },
        "arms": arms,
        "verified": verify,
        "load_avg_1m": os.getloadavg()[0],
    }


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else 0.0


_LEGEND = (
    (
        "anchors",
        "no_reference: anchors from finished responses only; reference: reference solutions timed first",
    ),
    ("tail s", "reward seconds left after rollout ended (reward/tail_s), summed over the steps"),
    (
        "sync stage s",
        "seconds a synchronous reward stage took on the same responses (reward/sync_stage_s), summed",
    ),
    ("cut", "responses cut by their adaptive timeout"),
    ("correct cut", "cut responses that pass when run again alone at t_max: misjudged (- = not verified)"),
    ("refs", "reference solutions timed into anchors"),
)


def render(report: dict[str, Any]) -> str:
    """The arms' tails against the synchronous stage, a line of per-step seconds per arm, a legend."""
    w = report["workload"]
    sb = w["sandbox"]
    kinds = ", ".join(f"{n} {k}" for k, n in w["kinds"].items())
    lines = wrap(
        f"workload: {report['config']['steps']} steps x {w['prompts_per_step']} prompts x "
        f"{w['responses_per_prompt']} responses of {w['task']} ({kinds}); sandbox workers "
        f"{sb['workers']}, lambda {sb['lam']}, t_min {sb['t_min_s']} s, t_max {sb['t_max_s']} s"
    )
    hdr = (
        f"{'anchors':<13}  {'tail s':>8}  {'sync stage s':>12}  {'cut':>4}  {'correct cut':>11}  {'refs':>5}"
    )
    lines += [hdr, "-" * len(hdr)]
    for name, a in report["arms"].items():
        cc = "-" if a["correct_cut"] is None else str(a["correct_cut"])
        lines.append(
            f"{name:<13}  {a['tail_s_total']:>8.2f}  {a['sync_stage_s_total']:>12.1f}  {a['cut']:>4}  "
            f"{cc:>11}  {int(a['reference_runs']):>5}"
        )
    for name, a in report["arms"].items():
        tails = ", ".join(f"{x:.2f}" for x in a["tail_s"])
        syncs = ", ".join(f"{x:.1f}" for x in a["sync_stage_s"])
        lines += wrap(f"{name} per step: tail s {tails}; sync stage s {syncs}")
    return "\n".join(lines + legend(_LEGEND))
