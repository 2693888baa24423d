"""The probe phase: what the machine is, and the ceilings it reaches (to set beside the spec files).

Ceilings, measured (best of a few repeats): ``copy_gb_s`` is a device-to-device copy's memory
traffic (bytes read + bytes written per second: what decode's weight and KV reads compete for);
``gemm_tflops`` a square matmul in the model's dtype (bf16 on a GPU, fp32 on the CPU);
``h2d_pinned_gb_s`` a pinned host-to-device copy (the judge's offload streams at this at best).
On the CPU the "device" is host memory and the H2D figure is absent.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from typing import Any

from rollpacker.lab.bench.gpu.context import Context

SHIPPED_GPUS = ("h200", "h100", "h800", "a100")  # spec names, matched against the device name


def _best_s(fn: Callable[[], object], sync: Callable[[], object], repeats: int) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def _copy_s(device: str, nbytes: int, sync: Callable[[], object]) -> float:
    """Best seconds of one ``nbytes`` copy on ``device`` (the buffers are freed on return)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return _best_s(lambda: dst.copy_(src), sync, 5)


def ceilings(device: str, tiny: bool) -> dict[str, float]:
    """Copy traffic GB/s, GEMM TFLOP/s and (CUDA) pinned H2D GB/s on ``device``."""
    import torch

    cuda = device == "cuda"
    sync: Callable[[], object] = torch.cuda.synchronize if cuda else (lambda: None)
    nbytes = (1 << 30) if cuda else (32 << 20)
    out = {"copy_gb_s": 2 * nbytes / _copy_s(device, nbytes, sync) / 1e9, "copy_bytes": float(nbytes)}
    n = 8192 if cuda else (256 if tiny else 1024)
    dtype = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t = _best_s(lambda: a @ b, sync, 5)
    out["gemm_tflops"] = 2 * n**3 / t / 1e12
    out["gemm_n"] = float(n)
    if cuda:
        host = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(256 << 20, dtype=torch.uint8, device=device)
        t = _best_s(lambda: dev.copy_(host, non_blocking=True), sync, 5)
        out["h2d_pinned_gb_s"] = (256 << 20) / t / 1e9
        torch.cuda.empty_cache()
    return out


def _driver_api() -> int | None:
    """The CUDA driver API version the installed driver supports (13000 = CUDA 13.0), from torch."""
    import torch

    get = getattr(torch._C, "_cuda_getDriverVersion", None)
    return int(get()) if get is not None else None


def attention_kernels() -> dict[str, Any]:
    """Which fused attention paths torch (and flash-attn, if installed) offer here."""
    import importlib.util

    import torch

    out: dict[str, Any] = {"flash_attn_package": importlib.util.find_spec("flash_attn") is not None}
    if torch.cuda.is_available():
        b: Any = torch.backends.cuda
        out.update(
            sdpa_flash=bool(b.flash_sdp_enabled()),
            sdpa_mem_efficient=bool(b.mem_efficient_sdp_enabled()),
            sdpa_cudnn=bool(getattr(b, "cudnn_sdp_enabled", lambda: False)()),
        )
    return out


def matched_spec(gpu_name: str) -> str | None:
    """The shipped hardware spec whose name the device name contains (``NVIDIA H100 80GB HBM3`` ->
    ``h100``), or None."""
    low = gpu_name.lower().replace(" ", "")
    return next((s for s in SHIPPED_GPUS if s in low), None)


def run(ctx: Context) -> dict[str, Any]:
    import torch
    import transformers

    out: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda_runtime": torch.version.cuda,
        "attention": attention_kernels(),
        "cpu_threads": torch.get_num_threads(),
    }
    if ctx.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        out.update(
            gpu=props.name,
            gpu_memory_bytes=int(props.total_memory),
            multiprocessors=int(props.multi_processor_count),
            capability=f"{props.major}.{props.minor}",
            cuda_driver_api=_driver_api(),
            spec=matched_spec(props.name),
        )
    else:
        out.update(gpu=None, cpu=platform.processor() or platform.machine(), spec=None)
    out["ceilings"] = ceilings(ctx.device, ctx.tiny)
    c = out["ceilings"]
    out["headline"] = (
        f"{out['gpu'] or 'cpu'}: copy {c['copy_gb_s']:.0f} GB/s, GEMM {c['gemm_tflops']:.3g} TFLOP/s"
    )
    return out
