"""The engine/trainer mismatch by engine precision (docs/training.md, "Rollout-trainer fidelity").

For each ``engine.dtype`` the benchmark starts the rollout engine (vLLM) on the config's model,
samples ``prompts`` of the task's training prompts at the rollout temperature, times the decode,
and scores the sampled tokens with the float32 trainer on the same weights (its ``pi_old``). The
mismatch metrics are the trainer's (``core.fidelity.fidelity_metrics``): what a training step on
those tokens would log. Run it by hand; it prints one line per dtype and writes JSON:

    python -m rollpacker.lab.bench.fidelity --config experiment --dtypes float32,bfloat16 --out f.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

from rollpacker.core.advantages import TrainSample
from rollpacker.core.config import ExperimentConfig, TrainerConfig
from rollpacker.core.fidelity import fidelity_metrics, merge_sums
from rollpacker.core.types import GenerationRequest, SamplingSpec


def _sample(engine: Any, prompts: Sequence[Any], sp: SamplingSpec, tag: str) -> tuple[list[Any], float]:
    from rollpacker.rollout.driver import generate

    reqs = [GenerationRequest(f"{tag}/{p.prompt_id}", p, 0, sp) for p in prompts]
    t0 = time.perf_counter()
    comps = generate(engine, reqs)
    return comps, time.perf_counter() - t0


def run_fidelity_bench(
    cfg: ExperimentConfig,
    dtypes: Sequence[str] = ("float32", "bfloat16"),
    prompts: int = 32,
    max_tokens: int = 512,
    log: Callable[[str], None] = lambda _s: None,
) -> dict[str, Any]:
    """The mismatch metrics and decode speed per engine dtype (JSON-able)."""
    import torch

    from rollpacker.engines.vllm_engine import VLLMEngine
    from rollpacker.tasks.models import task_data
    from rollpacker.tasks.prepare import prepare_model
    from rollpacker.trainers.correction import mismatch_sums
    from rollpacker.trainers.torch_trainer import TorchTrainer

    model = prepare_model(cfg, quiet=True)
    data = task_data(cfg.task.name, cfg.seed, cfg.task.num_examples, 8, str(model), cfg.task.shape.items())
    chosen = data.train_prompts[:prompts]
    sp = SamplingSpec(max_tokens=max_tokens, temperature=cfg.rollout.temperature, seed=cfg.seed)
    trainer = TorchTrainer(model, TrainerConfig(device="cpu"), temperature=cfg.rollout.temperature)
    rows = []
    for dtype in dtypes:
        eng = VLLMEngine(dataclasses.replace(cfg.engine, model_dir=str(model), dtype=dtype))
        try:
            _sample(eng, chosen[:2], dataclasses.replace(sp, max_tokens=8), f"warm/{dtype}")
            comps, wall = _sample(eng, chosen, sp, f"fidelity/{dtype}")
        finally:
            eng.close()
        by_id = {p.prompt_id: p for p in chosen}
        samples = [
            TrainSample(
                c.request_id, c.prompt_id, by_id[c.prompt_id].token_ids, c.token_ids, c.logprobs, 0.0, 0.0
            )
            for c in comps
            if c.token_ids
        ]
        old = trainer.logprobs(samples)
        sums: dict[str, float] = {}
        for s, q in zip(samples, old, strict=True):
            t = torch.tensor([q], dtype=torch.float64)
            b = torch.tensor([s.behaviour_logprobs], dtype=torch.float64)
            got = mismatch_sums(t, b, torch.ones_like(t))
            sums = merge_sums(sums, {k: float(v) for k, v in got.items()})
        tokens = sum(s.num_tokens for s in samples)
        row = {
            "engine_dtype": dtype,
            "tokens": tokens,
            "tokens_per_s": tokens / wall,
            **fidelity_metrics(sums),
        }
        rows.append(row)
        log(
            f"{dtype}: {tokens} tokens, {row['tokens_per_s']:.0f} tok/s, |d| mean "
            f"{row['mismatch/abs_logp_mean']:.2e} max {row['mismatch/abs_logp_max']:.2e}, "
            f"kl {row['mismatch/kl_k3']:.2e}, out of [0.5, 2] {row['mismatch/ratio_out_frac']:.4f}"
        )
    settings = {"task": cfg.task.name, "prompts": len(chosen), "max_tokens": max_tokens}
    return {"rows": rows, "settings": {**settings, "temperature": cfg.rollout.temperature}}


def main(argv: Sequence[str] | None = None) -> None:
    from rollpacker.core.config import load_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="experiment")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--out", default="fidelity.json")
    a = ap.parse_args(argv)
    cfg = load_config(a.config)
    report = run_fidelity_bench(cfg, a.dtypes.split(","), a.prompts, a.max_tokens, log=print)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
