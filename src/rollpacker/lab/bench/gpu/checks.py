"""The trainer, megatron and judge phases: the CUDA paths of training and the judge, checked on the device.

``trainer``: the torch backend the stream trainer drives (``TorchTrainer.accumulate`` per chunk,
``reduce_grads``), on the device in bf16 and in fp32: the gradient of the batch streamed in random
chunks in a random order against the monolithic batch's; then the ``StreamTrainer`` itself
(worker thread, one deferred AdamW step) on the same chunks, for its tokens/s. The bf16 tolerance:
each chunk's gradient is added into bf16 ``.grad`` buffers (unit roundoff ``u = 2**-8``) and the
micro-batches are padded differently, so the sums are rounded in a different order; with at most
``CHUNKS`` chunks the expected relative difference is a few ``u`` (``BF16_TOL = 2e-2`` ~ 5u); the
fp32 run is the control (``FP32_TOL``).

``megatron``: one megatron-core rank (TP=1, no Ray: ``RankWorker`` driven directly, NCCL on a GPU,
gloo on the CPU) in a child process (its process group and CUDA shim stay out of this one) against
the torch backend: the gradient, and the weights after one SGD step.

``judge``: the layer-wise offload (``rewards.offload.bench_offload``): outputs vs the resident
model, the achieved host-to-device bandwidth (the offloaded layers' bytes over the time NAIVE adds
to the resident forward) vs the probe's pinned peak, and the share of that transfer time PIPELINED
hides behind compute.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rollpacker.core.advantages import TrainSample
from rollpacker.lab.bench.gpu.context import Context, Skip
from rollpacker.lab.bench.gpu.samples import chunks, make_samples

BF16_TOL = 2e-2
FP32_TOL = 1e-4
MEGATRON_TOL = 1e-4  # fp32 on both sides; megatron's fused layout sums in another order
NOISE_SHARE = 0.05  # NAIVE must add more than this share of the resident forward to time the copies


SMALL_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4},
    "gpu": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 12},
}
SMALL_SHAPES["tiny"].update(num_key_value_heads=2, head_dim=8, vocab_size=63)
SMALL_SHAPES["gpu"].update(num_key_value_heads=4, head_dim=64, vocab_size=32000)


def small_model(out: Path, tiny: bool) -> Path:
    """A small Qwen2 (GQA) saved in HF format: ~0.1M parameters tiny, ~120M on a GPU."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if (out / "config.json").is_file():
        return out
    shape = SMALL_SHAPES["tiny" if tiny else "gpu"]
    config_cls: Any = Qwen2Config
    model_cls: Any = Qwen2ForCausalLM
    cfg = config_cls(
        **shape, max_position_embeddings=2048, tie_word_embeddings=False, pad_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    model_cls(cfg).save_pretrained(str(out), safe_serialization=True)
    return out


def _batch(ctx: Context) -> list[list[TrainSample]]:
    if ctx.tiny:
        return make_samples(8, 4, seed=1, vocab=63)
    return make_samples(32, 8, seed=1, vocab=32000, prompt_lens=(16, 256), response_lens=range(1, 513))


def _grads(tr: Any) -> Any:
    import torch

    return torch.cat([p.grad.float().reshape(-1) for p in tr.model.parameters() if p.grad is not None])


def _gradient_check(
    model_dir: Path, batch: list[list[TrainSample]], device: str, dtype: Any
) -> dict[str, Any]:
    """Monolithic vs streamed gradient in ``dtype`` on ``device``; monolithic tokens/s."""
    from rollpacker.core.config import TrainerConfig
    from rollpacker.trainers.torch_trainer import TorchTrainer

    cfg = TrainerConfig(grad_clip=0.0, tokens_per_micro_batch=16384)
    samples = [s for g in batch for s in g]
    mono = TorchTrainer(model_dir, cfg, temperature=0.8, dtype=dtype, device=device)
    t0 = time.perf_counter()
    mono.accumulate(samples)
    mono.reduce_grads()
    _sync(device)
    seconds = time.perf_counter() - t0
    ref = _grads(mono)
    del mono
    streamed = TorchTrainer(model_dir, cfg, temperature=0.8, dtype=dtype, device=device)
    for chunk in chunks(batch, seed=7):
        streamed.accumulate(chunk)
    streamed.reduce_grads()
    rel = float((_grads(streamed) - ref).norm() / ref.norm())
    tokens = sum(s.num_tokens for s in samples)
    return {"grad_rel_error": rel, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def trainer(ctx: Context) -> dict[str, Any]:
    import torch

    from rollpacker.core.config import TrainerConfig
    from rollpacker.trainers.stream import StreamTrainer
    from rollpacker.trainers.torch_trainer import TorchTrainer

    model_dir = small_model(ctx.out / "models" / "trainer", ctx.tiny)
    batch = _batch(ctx)
    bf16 = _gradient_check(model_dir, batch, ctx.device, torch.bfloat16)
    fp32 = _gradient_check(model_dir, batch, ctx.device, torch.float32)
    tr = TorchTrainer(model_dir, TrainerConfig(tokens_per_micro_batch=16384), 0.8, torch.bfloat16, ctx.device)
    stream = StreamTrainer(tr, stream=True)
    t0 = time.perf_counter()
    for chunk in chunks(batch, seed=7):
        stream.submit(chunk)
    report = stream.finish()
    stream.close()
    stream_s = time.perf_counter() - t0
    ok = bf16["grad_rel_error"] <= BF16_TOL and fp32["grad_rel_error"] <= FP32_TOL
    if not ok:
        raise AssertionError(f"streamed vs monolithic gradient: bf16 {bf16}, fp32 {fp32}")
    finite = all(bool(torch.isfinite(p).all()) for p in tr.model.parameters())
    return {
        "model_dir": str(model_dir),
        "bf16": bf16,
        "fp32": fp32,
        "bf16_tolerance": BF16_TOL,
        "fp32_tolerance": FP32_TOL,
        "stream_trainer": {
            "samples": report.stats.samples,
            "tokens": report.stats.tokens,
            "seconds": stream_s,
            "tokens_per_s": report.stats.tokens / stream_s,
            "weights_finite": finite,
            "policy_version": report.stats.policy_version,
        },
        "headline": f"streamed vs monolithic: bf16 {bf16['grad_rel_error']:.1e} (tol {BF16_TOL}), "
        f"fp32 {fp32['grad_rel_error']:.1e}; {bf16['tokens_per_s']:.0f} train tok/s bf16",
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def megatron(ctx: Context) -> dict[str, Any]:
    """The one-rank check in a child process (``megatron_rank``), killed at the deadline."""
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        raise Skip("megatron-core is not installed: bring its wheel (docs/benchmarks.md)")
    model_dir = small_model(ctx.out / "models" / "megatron", tiny=True)
    from rollpacker.lab.bench.gpu.megatron_rank import MegatronCheck, RankJob

    job = RankJob(model_dir=str(model_dir), cuda=ctx.device == "cuda", port=_free_port())
    cmd = [sys.executable, "-m", "rollpacker.lab.bench.gpu.megatron_rank", job.to_json()]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(ctx.left_s() - 2, 1))
    except subprocess.TimeoutExpired as e:
        raise TimeoutError(f"the megatron rank ran past the phase's deadline ({e.timeout:.0f} s)") from e
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-8:]
        raise RuntimeError(f"the megatron rank exited {proc.returncode}: " + " | ".join(tail))
    check = MegatronCheck.from_json(proc.stdout.strip().splitlines()[-1])
    got = dataclasses.asdict(check)
    ok = check.grad_rel_error <= MEGATRON_TOL and check.update_rel_error <= MEGATRON_TOL
    if not ok:
        raise AssertionError(f"megatron vs torch beyond {MEGATRON_TOL}: {got}")
    return {
        **got,
        "tolerance": MEGATRON_TOL,
        "headline": f"TP=1 vs torch ({got['backend']}): gradient {got['grad_rel_error']:.1e}, "
        f"update {got['update_rel_error']:.1e}",
    }


def judge(ctx: Context) -> dict[str, Any]:
    from rollpacker.rewards.offload import bench_offload
    from rollpacker.tasks.tiny_model import TinyModelSpec

    if ctx.tiny:
        spec = TinyModelSpec(
            hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=256
        )
        batch, seq = 1, 32
    else:
        spec = TinyModelSpec(
            hidden_size=1536, num_layers=12, num_heads=12, num_kv_heads=4, intermediate_size=4096
        )
        batch, seq = 4, 1024
    cuda = ctx.device == "cuda"
    k = spec.num_layers // 4
    threads = None if cuda else 1
    rep = bench_offload(
        spec,
        batch=batch,
        seq_len=seq,
        resident_layers=k,
        repeats=3,
        device=ctx.device,
        threads=threads,
        cache_dir=ctx.out / "models",
    )
    return judge_figures(rep, ctx.results.get("probe", {}).get("ceilings", {}).get("h2d_pinned_gb_s"))


def judge_figures(rep: dict[str, Any], pinned_gb_s: float | None) -> dict[str, Any]:
    """Equality, achieved H2D bandwidth and hidden share from ``bench_offload``'s report."""
    c, res, naive, pipe = rep["config"], rep["resident"], rep["naive"], rep["pipelined"]
    streamed = (c["num_layers"] - c["resident_layers"]) * naive["layer_bytes"]
    transfer_s = naive["time_s"] - res["time_s"]
    if transfer_s > NOISE_SHARE * res["time_s"]:
        hidden: float | None = (naive["time_s"] - pipe["time_s"]) / transfer_s
        bw: float | None = streamed / transfer_s / 1e9
    else:  # the copies cost less than the timing noise: no bandwidth to report
        hidden = bw = None
    diff = max(naive["max_abs_diff"], pipe["max_abs_diff"])
    if diff > 1e-5:
        raise AssertionError(f"offloaded outputs differ from the resident model's by {diff:.2e} (> 1e-5)")
    return {
        "config": c,
        "max_abs_diff": diff,
        "forward_s": {"resident": res["time_s"], "naive": naive["time_s"], "pipelined": pipe["time_s"]},
        "streamed_bytes_per_forward": streamed,
        "h2d_achieved_gb_s": bw,
        "h2d_pinned_peak_gb_s": pinned_gb_s,
        "hidden_share": hidden,
        "peak_resident_weight_bytes": {
            k: rep[k]["peak_resident_weight_bytes"] for k in ("resident", "naive", "pipelined")
        },
        "headline": f"outputs equal (max diff {diff:.1e}); "
        + (
            f"H2D {bw:.1f} GB/s"
            + (f" of {pinned_gb_s:.1f} pinned" if pinned_gb_s else "")
            + f"; {hidden:.0%} hidden"
            if bw is not None and hidden is not None
            else "the transfer is below the timing noise here"
        ),
    }
