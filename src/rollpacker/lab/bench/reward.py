"""The reward benchmark: adaptive vs fixed sandbox timeouts on a code workload that sometimes hangs.

``rollpacker lab bench reward`` builds a code-reward workload from the synthetic code task: each
problem's test cases call the function many times, so a correct run takes from tens of
milliseconds to about a second (log-uniform per problem, as real test suites differ); each
response is correct (the reference, with a little extra work of its own, as correct programs
differ in speed), wrong (fails the tests at once) or doomed (its loop never ends). It then scores
the same responses, in the same seeded arrival order, twice through the real ``CodeReward`` on
the real sandbox: once with the fixed timeout (every case gets ``t_max_s``, the paper's 30 s) and
once with the adaptive one (``min(max(t_min_s, lambda * T_anchor), t_max_s)``), each from empty
anchors, epoch after epoch (anchors carry over between epochs, as they do between RL steps).

Reported: reward-stage seconds per epoch and in total for both, the speedup (fixed / adaptive),
timeouts, and misjudged responses (correct responses that were not scored correct, and any
response whose verdict differs from the fixed-timeout run other than doomed ones timing out
sooner). Both runs happen in one invocation, one after the other, on this machine.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollpacker.core.tasks import RewardKind, TaskExample
from rollpacker.core.timeout import AdaptiveTimeout, TimeoutConfig
from rollpacker.lab.bench.tables import MAX_COLUMNS, clip, legend, wrap
from rollpacker.tasks import synthetic_code


@dataclass(frozen=True)
class Sample:
    sample_id: str
    example: TaskExample
    response: str
    kind: str  # correct | wrong | doomed


def _per_call_s(example: TaskExample) -> float:
    """Seconds one call of the reference takes here (in this process; the jail adds little)."""
    ns: dict[str, Any] = {}
    exec(synthetic_code.reference_solution(example), ns)
    f = ns[synthetic_code.ENTRY_POINT]
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        f(3)
    return (time.perf_counter() - t0) / n


def _heavy(example: TaskExample, calls: int) -> TaskExample:
    """The example with test cases that each call the function ``calls`` times."""
    m = example.metadata
    add, steps = int(m["add"]), int(m["steps"])
    cases = tuple(
        f"for _ in range({calls}):\n    assert f({x0}) == {synthetic_code.answer(x0, add, steps)}\n"
        for x0 in m["starts"]
    )
    return TaskExample(
        example_id=example.example_id,
        prompt=example.prompt,
        reward_kind=RewardKind.CODE,
        tests=cases,
        entry_point=example.entry_point,
        metadata={**m, "calls": calls},
    )


def _with_extra_work(program: str, loops: int) -> str:
    """A correct program that does ``loops`` more harmless iterations per call."""
    head, body = program.split("\n", 1)
    return f"{head}\n    for _k in range({loops}):\n        pass\n{body}"


def make_workload(
    problems: int,
    responses: int,
    doomed_share: float,
    wrong_share: float,
    case_s: tuple[float, float],
    seed: int,
) -> list[Sample]:
    """``problems x responses`` samples in a seeded arrival order (see the module docstring)."""
    rng = random.Random(f"bench-reward:{seed}")
    base = synthetic_code.generate(synthetic_code.SyntheticCodeSpec(num_examples=problems), seed=seed)
    out: list[Sample] = []
    for ex in base:
        target_s = math.exp(rng.uniform(math.log(case_s[0]), math.log(case_s[1])))
        per_call = _per_call_s(ex)
        heavy = _heavy(ex, max(1, round(target_s / per_call)))
        ref = synthetic_code.reference_solution(ex)
        steps_x_stride = int(ex.metadata["steps"]) * int(ex.metadata["stride"])
        for j in range(responses):
            u = rng.random()
            if u < doomed_share:
                kind, resp = "doomed", synthetic_code.nonterminating_variant(ex)
            elif u < doomed_share + wrong_share:
                kind, resp = "wrong", synthetic_code.wrong_variant(ex)
            else:
                # up to +25 % work: correct programs of slightly different efficiency
                extra = round(rng.uniform(0.0, 0.25) * steps_x_stride)
                kind, resp = "correct", _with_extra_work(ref, extra) if extra else ref
            out.append(Sample(f"{ex.example_id}/r{j}", heavy, resp, kind))
    rng.shuffle(out)
    return out


def _score_epoch(reward: Any, samples: list[Sample], epoch: int) -> tuple[float, list[Any]]:
    from rollpacker.rewards.base import RewardRequest

    t0 = time.perf_counter()
    futs = [reward.submit(RewardRequest(f"e{epoch}/{s.sample_id}", s.example, s.response)) for s in samples]
    results = [f.result() for f in futs]
    return time.perf_counter() - t0, results


def run_reward_bench(
    problems: int = 8,
    responses: int = 8,
    epochs: int = 2,
    doomed_share: float = 0.1,
    wrong_share: float = 0.3,
    case_s: tuple[float, float] = (0.02, 0.8),
    workers: int = 2,
    lam: float = 1.5,
    t_min_s: float = 2.0,
    t_max_s: float = 30.0,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    from tqdm import tqdm

    from rollpacker.rewards.sandbox import Sandbox, SandboxLimits

    workload = make_workload(problems, responses, doomed_share, wrong_share, case_s, seed)
    limits = SandboxLimits(wall_s=2 * t_max_s + 5, cpu_s=2 * t_max_s + 5)
    sandbox = Sandbox(limits)
    modes: dict[str, dict[str, Any]] = {}
    verdicts: dict[str, dict[str, tuple[bool, str]]] = {}
    bar = tqdm(
        total=2 * epochs, desc="reward bench (fixed, then adaptive)", unit="epoch", disable=not progress
    )
    for mode in ("fixed", "adaptive"):
        tcfg = TimeoutConfig(adaptive=mode == "adaptive", lam=lam, t_min_s=t_min_s, t_max_s=t_max_s)
        modes[mode], verdicts[mode] = _run_mode(sandbox, tcfg, workload, epochs, workers, bar.update)
    bar.close()
    differ = _verdicts_differ(verdicts, {s.sample_id: s.kind for s in workload})
    counts = {k: sum(1 for s in workload if s.kind == k) for k in ("correct", "wrong", "doomed")}
    return {
        "workload": {
            "problems": problems,
            "responses_per_problem": responses,
            "epochs": epochs,
            "samples_per_epoch": len(workload),
            "kinds": counts,
            "case_s_range": list(case_s),
            "workers": workers,
            "seed": seed,
        },
        "timeout": {"lam": lam, "t_min_s": t_min_s, "t_max_s": t_max_s},
        "modes": modes,
        "speedup": modes["fixed"]["reward_stage_s"] / modes["adaptive"]["reward_stage_s"],
        "verdicts_differ": differ,
        "no_correct_misjudged": not modes["adaptive"]["misjudged_correct"] and not differ,
    }


def _run_mode(
    sandbox: Any,
    tcfg: TimeoutConfig,
    workload: list[Sample],
    epochs: int,
    workers: int,
    epoch_done: Callable[[int], object],
) -> tuple[dict[str, Any], dict[str, tuple[bool, str]]]:
    """Score ``workload`` for ``epochs`` epochs with one timeout mode, from empty anchors: the mode's
    summary, and each scored id's verdict ``(correct, status)``."""
    from rollpacker.rewards.code import CodeReward

    kinds = {s.sample_id: s.kind for s in workload}
    timeouts = AdaptiveTimeout(tcfg)
    reward = CodeReward(sandbox, timeouts, workers=workers)
    per_epoch: list[float] = []
    verdicts: dict[str, tuple[bool, str]] = {}
    n_timeouts = 0
    exec_s: dict[str, list[float]] = {"correct": [], "wrong": [], "doomed": []}
    try:
        for e in range(epochs):
            secs, results = _score_epoch(reward, workload, e)
            per_epoch.append(secs)
            for s, r in zip(workload, results, strict=True):
                verdicts[f"e{e}/{s.sample_id}"] = (r.correct, r.status.value)
                n_timeouts += r.status.value == "timeout"
                exec_s[s.kind].append(r.elapsed_s)
            epoch_done(1)
    finally:
        reward.close()
    misjudged = sorted(
        sid for sid, (ok, _) in verdicts.items() if kinds[_sample(sid)] == "correct" and not ok
    )
    summary = {
        "reward_stage_s": sum(per_epoch),
        "per_epoch_s": per_epoch,
        "timeouts": n_timeouts,
        "misjudged_correct": misjudged,
        "mean_scoring_s": {k: statistics.fmean(v) if v else 0.0 for k, v in exec_s.items()},
        "anchors": len(timeouts),
    }
    return summary, verdicts


def _verdicts_differ(verdicts: dict[str, dict[str, tuple[bool, str]]], kinds: dict[str, str]) -> list[str]:
    """Scored ids whose correctness differs between the fixed and adaptive runs, doomed ones aside."""
    return sorted(
        sid
        for sid, v in verdicts["fixed"].items()
        if v[0] != verdicts["adaptive"][sid][0] and kinds[_sample(sid)] != "doomed"
    )


def _sample(scored_id: str) -> str:
    """``e<epoch>/<sample id>`` -> ``<sample id>``."""
    return scored_id.split("/", 1)[1]


_LEGEND = (
    (
        "timeout",
        "fixed: every test case gets t_max; adaptive: min(max(t_min, lambda x anchor), t_max) per case",
    ),
    ("stage s", "reward-stage seconds over all the epochs"),
    ("timeouts", "sandbox runs cut by their timeout"),
    ("misjudged", "correct responses judged wrong"),
    ("per epoch s", "reward-stage seconds of each epoch"),
)


def render(report: dict[str, Any]) -> str:
    """Both timeout modes' reward-stage seconds, the speedup, a legend."""
    w = report["workload"]
    lines = wrap(
        f"workload: {w['problems']} problems x {w['responses_per_problem']} responses x {w['epochs']} epochs "
        f"({w['kinds']['correct']} correct, {w['kinds']['wrong']} wrong, {w['kinds']['doomed']} never "
        f"terminate per epoch), {w['workers']} sandbox workers"
    )
    hdr = f"{'timeout':<10}  {'stage s':>8}  {'timeouts':>8}  {'misjudged':>9}  per epoch s"
    lines += [hdr, "-" * len(hdr)]
    room = MAX_COLUMNS - len(hdr) + len("per epoch s")
    for mode, m in report["modes"].items():
        per = clip(", ".join(f"{x:.1f}" for x in m["per_epoch_s"]), room)
        bad = len(m["misjudged_correct"])
        lines.append(f"{mode:<10}  {m['reward_stage_s']:>8.1f}  {m['timeouts']:>8}  {bad:>9}  {per}")
    bad = len(report["modes"]["adaptive"]["misjudged_correct"]) + len(report["verdicts_differ"])
    lines += wrap(
        f"speedup (fixed / adaptive): {report['speedup']:.2f}x; correct responses misjudged: "
        f"{'none' if report['no_correct_misjudged'] else bad}"
    )
    return "\n".join(lines + legend(_LEGEND))
