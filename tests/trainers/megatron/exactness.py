"""The megatron backend's exactness checks against the torch backend, shared by the tests and by the
table in docs/megatron.md (``python -m tests.trainers.megatron.exactness``).

One RL update from the same samples (tiny GQA Qwen2, fp32, gloo): the gradient (scaled by
``1 / D``, no clipping) and the weights after one SGD step (lr ``LR``, no momentum) of the megatron
gang at a given TP/PP/DP, against the torch backend's gradient and ``w - LR * g``.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rollpacker.core.advantages import TrainSample
from rollpacker.core.config import MegatronConfig, TrainerConfig
from rollpacker.trainers.torch_trainer import TorchTrainer

LR = 0.1
TEMPERATURE = 0.8


def batch() -> list[list[TrainSample]]:
    from tests.trainers.conftest import make_batch

    return make_batch(num_groups=6, group_size=3, seed=1, vocab=63)


def train_config(**megatron: Any) -> TrainerConfig:
    m = MegatronConfig(**{"optimizer": "sgd", "distributed_optimizer": False, **megatron})
    return TrainerConfig(lr=LR, grad_clip=0.0, tokens_per_micro_batch=64, backend="megatron", megatron=m)


@dataclass
class Run:
    grads: dict[str, torch.Tensor]  # HF names, the reduced gradient before the step
    weights: dict[str, torch.Tensor]  # after one SGD step
    logprobs: list[list[float]]  # before the step
    w0: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


def torch_run(model_dir: Path) -> Run:
    tr = TorchTrainer(
        model_dir, dataclasses.replace(train_config(), backend="torch"), temperature=TEMPERATURE
    )
    samples = [s for g in batch() for s in g]
    lp = tr.logprobs(samples)
    tr.accumulate(samples)
    tr.reduce_grads()
    grads = {n: p.grad.detach().clone() for n, p in tr.model.named_parameters()}
    w0 = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    weights = {n: w0[n] - LR * grads[n] for n in grads}
    return Run(grads, weights, lp, w0)


def megatron_run(model_dir: Path, seed: int = 0, **megatron: Any) -> tuple[Run, Any]:
    """Gradient (streamed: groups in a random order, random chunks), then one SGD step; returns the
    run and the still-open trainer (close it)."""
    from rollpacker.trainers.megatron.gang import MegatronTrainer

    mt = MegatronTrainer(model_dir, train_config(**megatron), temperature=TEMPERATURE)
    try:
        samples = [s for g in batch() for s in g]
        lp = mt.logprobs(samples)
        stream(mt, seed)
        grads = mt.grads_hf()
        stream(mt, seed + 1)
        mt.finish_step()
        weights = dict(mt.weights())
    except BaseException:
        mt.close()
        raise
    return Run(grads, weights, lp), mt


def stream(mt: Any, seed: int) -> None:
    """Accumulate the batch as the stream trainer would: groups in a random order, 1-3 per chunk."""
    rng = random.Random(seed)
    groups = batch()
    rng.shuffle(groups)
    i = 0
    while i < len(groups):
        k = rng.randint(1, 3)
        mt.accumulate([s for g in groups[i : i + k] for s in g])
        i += k


def rel(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Relative L2 error over every tensor of ``want``."""
    num = sum(float((got[n].double() - t.double()).norm() ** 2) for n, t in want.items())
    den = sum(float(t.double().norm() ** 2) for t in want.values())
    return (num / den) ** 0.5


def update_rel(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], w0: dict[str, torch.Tensor]
) -> float:
    """Relative error of the update ``w1 - w0`` (far stricter than the weights' relative error)."""
    return rel(
        {n: got[n].double() - w0[n].double() for n in want},
        {n: want[n].double() - w0[n].double() for n in want},
    )


def logprob_err(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for u, v in zip(a, b, strict=True) for x, y in zip(u, v, strict=True))


LAYOUTS = {"TP=1": {}, "TP=2": {"tp": 2}, "PP=2": {"pp": 2}, "DP=2": {"dp": 2}}


def main() -> None:
    import sys
    import tempfile

    from tests.trainers.megatron.conftest import build_gqa_model

    tied = "--untied" not in sys.argv
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_gqa_model(Path(tmp) / "m", tied=tied)
        ref = torch_run(model_dir)
        runs: dict[str, Run] = {}
        print(
            f"| layout ({'tied' if tied else 'untied'}) | grad rel. vs torch | weights rel. vs torch (SGD) "
            "| update rel. vs torch | grad rel. vs megatron TP=1 | weights rel. vs megatron TP=1 "
            "| logprob max abs vs torch |"
        )
        print("|---|---|---|---|---|---|---|")
        for name, kw in LAYOUTS.items():
            run, mt = megatron_run(model_dir, **kw)
            mt.close()
            runs[name] = run
            base = runs["TP=1"]
            print(
                f"| {name} | {rel(run.grads, ref.grads):.1e} | {rel(run.weights, ref.weights):.1e} | "
                f"{update_rel(run.weights, ref.weights, ref.w0):.1e} | {rel(run.grads, base.grads):.1e} | "
                f"{rel(run.weights, base.weights):.1e} | {logprob_err(run.logprobs, ref.logprobs):.1e} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
