"""One megatron-core rank (TP=1, world size 1, no Ray) against the torch backend, in its own process.

``python -m rollpacker.lab.bench.gpu.megatron_rank RANKJOB_JSON`` prints one ``MegatronCheck`` JSON line:
the relative error of the megatron rank's gradient (the batch streamed in random
chunks, reduced once with ``1 / D``) and of its update after one SGD step (lr ``LR``) against the
torch backend's gradient and ``w - LR * g`` on the same device, fp32 (the megatron backend's
exactness setting, docs/megatron.md). The megatron worker is ``RankWorker``, driven directly.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

from rollpacker.core.serde import Message


@dataclass(frozen=True)
class RankJob(Message):
    """What the parent asks of the child: the model, CUDA or not, the rendezvous port."""

    model_dir: str
    cuda: bool
    port: int


@dataclass(frozen=True)
class MegatronCheck(Message):
    """What the child answers (its last stdout line): the errors against the torch backend."""

    backend: str  # nccl | gloo
    device: str
    tensors_compared: int
    grad_rel_error: float
    update_rel_error: float
    seconds: float


def _rel(got: dict[str, Any], want: dict[str, Any]) -> float:
    num = sum(float((got[n].double().cpu() - t.double().cpu()).norm() ** 2) for n, t in want.items())
    den = sum(float(t.double().cpu().norm() ** 2) for t in want.values())
    return float((num / den) ** 0.5)


def check(job: RankJob) -> MegatronCheck:
    import torch

    from rollpacker.core.config import MegatronConfig, TrainerConfig
    from rollpacker.core.stream_math import LossNorm, denominator
    from rollpacker.lab.bench.gpu.samples import LR, chunks, make_samples
    from rollpacker.trainers.megatron.source import StoreSource
    from rollpacker.trainers.megatron.worker import RankSpec, RankWorker
    from rollpacker.trainers.torch_trainer import TorchTrainer

    mcfg = MegatronConfig(optimizer="sgd", distributed_optimizer=False)
    cfg = TrainerConfig(lr=LR, grad_clip=0.0, tokens_per_micro_batch=64, backend="megatron", megatron=mcfg)
    batch = make_samples(6, 3, seed=1, vocab=63)
    samples = [s for g in batch for s in g]
    model_dir, cuda = job.model_dir, job.cuda
    device = "cuda" if cuda else "cpu"
    tr = TorchTrainer(
        model_dir, TrainerConfig(lr=LR, grad_clip=0.0, tokens_per_micro_batch=64), 0.8, torch.float32, device
    )
    tr.accumulate(samples)
    tr.reduce_grads()
    g_ref = {n: p.grad.detach().clone() for n, p in tr.model.named_parameters()}
    w_ref = {n: p.detach() - LR * g_ref[n] for n, p in tr.model.named_parameters()}
    spec = RankSpec(
        model=StoreSource.local(model_dir),
        train=cfg,
        tp=1,
        pp=1,
        dp=1,
        temperature=0.8,
        master_addr="127.0.0.1",
        master_port=job.port,
        optimizer="sgd",
        distributed_optimizer=False,
        use_cuda=cuda,
    )
    t0 = time.perf_counter()
    w = RankWorker(spec, 0)
    lens = [len(s.response_ids) for s in samples]
    d = float(denominator(LossNorm(cfg.loss_norm), lens, cfg.loss_budget_tokens))
    for chunk in chunks(batch, seed=3, n=4):
        w.accumulate(chunk)
    grads = w.grads_hf(d) or {}
    w.reset_accum()
    for chunk in chunks(batch, seed=4, n=4):
        w.accumulate(chunk)
    w.finish_step(d)
    weights: dict[str, Any] = {}
    for names in w.bucket_plan(1 << 30):
        weights.update(w.export_bucket(names) or {})
    seconds = time.perf_counter() - t0
    w.close()
    want = {n: g for n, g in g_ref.items() if n in grads}
    w0 = {n: p.detach() for n, p in tr.model.named_parameters()}
    upd = {n: weights[n].to(w0[n].device) - w0[n] for n in w_ref if n in weights}
    upd_ref = {n: w_ref[n] - w0[n] for n in upd}
    return MegatronCheck(
        backend="nccl" if cuda else "gloo",
        device=device,
        tensors_compared=len(want),
        grad_rel_error=_rel(grads, want),
        update_rel_error=_rel(upd, upd_ref),
        seconds=seconds,
    )


if __name__ == "__main__":
    print(check(RankJob.from_json(sys.argv[1])).to_json(), flush=True)
