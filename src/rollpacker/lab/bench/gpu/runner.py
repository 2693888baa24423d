"""The GPU bench's runner: phases in order, each under its own deadline, the JSON rewritten after each.

A phase is a function of the run's ``Context`` returning its figures (a JSON-able dict). It raises
``Skip`` when it cannot run here (a package the machine lacks, a phase before it that produced
nothing); any other exception, or running past its deadline, marks it ``failed`` with the error,
and the next phase starts. The deadline is enforced twice: cooperatively (``Context.left_s`` lets a
sweep stop early with what it has) and, in the main thread, by a timer signal that interrupts the
phase (a CUDA kernel in flight finishes first). Phase budgets are shares of ``--deadline-s``.

Before the first phase every phase is written as ``skipped`` ("not reached"), so a run killed from
outside still leaves a JSON that says how far it got.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rollpacker.core.errors import RollpackerError
from rollpacker.lab.bench.gpu.context import OPTIONAL_PACKAGES, Context, PhaseTimeout, Skip, write_json

BENCH_VERSION = 1
DEFAULT_DEADLINE_S = 300.0  # the command's budget on one GPU; machine start-up comes on top
TINY_DEADLINE_S = 175.0  # --tiny on this CPU: within the 3-minute bound


PhaseFn = Callable[[Context], dict[str, Any]]


def phases(tiny: bool = False) -> list[tuple[str, PhaseFn, float]]:
    """(name, function, share of the deadline), in order of value; shares sum to 1. ``--tiny`` gives
    the megatron phase the most: importing megatron-core takes ~20 s on a loaded 2-core CPU."""
    from rollpacker.lab.bench.gpu import analysis, checks, decode, probe

    fns: list[tuple[str, PhaseFn, float, float]] = [
        ("probe", probe.run, 0.05, 0.06),
        ("profile", decode.run, 0.30, 0.17),
        ("policies", analysis.policies, 0.16, 0.06),
        ("predictor", analysis.predictor, 0.02, 0.02),
        ("trainer", checks.trainer, 0.12, 0.17),
        ("megatron", checks.megatron, 0.17, 0.35),
        ("judge", checks.judge, 0.18, 0.17),
    ]
    return [(n, f, tiny_share if tiny else share) for n, f, share, tiny_share in fns]


@contextlib.contextmanager
def _alarm(seconds: float) -> Iterator[None]:
    """Raise ``PhaseTimeout`` in the main thread after ``seconds`` (no-op in another thread)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def fire(_sig: int, _frame: object) -> None:
        raise PhaseTimeout(f"ran past its deadline ({seconds:.0f} s)")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_phase(ctx: Context, name: str, fn: PhaseFn, budget_s: float) -> dict[str, Any]:
    """One phase under its deadline: its section of the JSON."""
    t0 = time.perf_counter()
    ctx.deadline_at = t0 + budget_s
    try:
        with _alarm(budget_s):
            figures = fn(ctx)
        section: dict[str, Any] = {"status": "ok", **figures}
    except Skip as e:
        section = {"status": "skipped", "why": str(e)}
    except Exception as e:  # a failed phase is recorded and the run goes on
        if isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] in OPTIONAL_PACKAGES:
            section = {"status": "skipped", "why": f"{e.name} is not installed here (docs/benchmarks.md)"}
            return _timed(section, t0, budget_s)
        tb = traceback.format_exc().strip().splitlines()[-6:]
        section = {"status": "failed", "error": f"{type(e).__name__}: {e}", "traceback_tail": tb}
    return _timed(section, t0, budget_s)


def _timed(section: dict[str, Any], t0: float, budget_s: float) -> dict[str, Any]:
    section["seconds"] = round(time.perf_counter() - t0, 3)
    section["deadline_s"] = round(budget_s, 1)
    return section


def run_bench(
    out: Path,
    tiny: bool = False,
    deadline_s: float | None = None,
    only: tuple[str, ...] = (),
    progress: Callable[[str], None] = lambda _s: None,
) -> dict[str, Any]:
    """Every phase (or ``only`` those) in order; ``out/bench-gpu.json`` after each. Returns the doc."""
    out.mkdir(parents=True, exist_ok=True)
    budget = deadline_s or (TINY_DEADLINE_S if tiny else DEFAULT_DEADLINE_S)
    plan = [p for p in phases(tiny) if not only or p[0] in only]
    if only and len(plan) != len(only):
        known = ", ".join(p[0] for p in phases(tiny))
        raise RollpackerError(f"--only {','.join(only)}: unknown phase (known: {known})")
    ctx = Context(out=out, tiny=tiny, device="cpu" if tiny else _device())
    doc: dict[str, Any] = {
        "bench": "gpu",
        "version": BENCH_VERSION,
        "tiny": tiny,
        "device": ctx.device,
        "deadline_s": budget,
        "started_s": time.time(),
        "phases": {
            n: {"status": "skipped", "why": "not reached (the run stopped before it)"} for n, *_ in plan
        },
    }
    path = out / "bench-gpu.json"
    write_json(doc, path)
    t0 = time.perf_counter()
    for name, fn, share in plan:
        progress(f"{name}: up to {share * budget:.0f} s")
        section = run_phase(ctx, name, fn, share * budget)
        ctx.results[name] = section
        doc["phases"][name] = section
        doc["total_s"] = round(time.perf_counter() - t0, 3)
        write_json(doc, path)
        progress(f"{name}: {section['status']} in {section['seconds']:.1f} s {_why(section)}")
    return doc


def _why(section: dict[str, Any]) -> str:
    return str(section.get("why") or section.get("error") or "")


def _device() -> str:
    """cuda where torch sees a GPU; the full run needs one (``--tiny`` is the CPU run)."""
    import torch

    if not torch.cuda.is_available():
        raise RollpackerError("no GPU visible to torch: run on a GPU machine, or pass --tiny for the CPU run")
    return "cuda"


def summary(doc: dict[str, Any]) -> str:
    """One line per phase: its status and its headline figures."""
    lines = [f"bench gpu ({'tiny, ' if doc['tiny'] else ''}{doc['device']}): {doc.get('total_s', 0):.0f} s"]
    for name, s in doc["phases"].items():
        head = s.get("headline", _why(s))
        lines.append(f"  {name:<9} {s['status']:<7} {s.get('seconds', 0):>6.1f} s  {head}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m rollpacker.lab.bench.gpu [calibrate] ...`` (argparse: no typer on the GPU machine)."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["calibrate"]:
        from rollpacker.lab.bench.gpu.calibrate import main as calibrate_main

        return calibrate_main(args[1:])
    p = argparse.ArgumentParser(prog="python -m rollpacker.lab.bench.gpu", description=__doc__)
    p.add_argument("--out", type=Path, required=True, help="directory for bench-gpu.json and profile.json")
    p.add_argument("--tiny", action="store_true", help="tiny models on the CPU (the dry run)")
    p.add_argument("--deadline-s", type=float, default=None, help="the whole run's budget (seconds)")
    p.add_argument("--only", default="", help="comma list of phases to run (default: all)")
    a = p.parse_args(args)
    try:
        only = tuple(x for x in a.only.split(",") if x)
        doc = run_bench(a.out, a.tiny, a.deadline_s, only, lambda s: print(f"[bench gpu] {s}", flush=True))
    except RollpackerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(summary(doc))
    print(f"wrote {a.out / 'bench-gpu.json'}")
    return 0
