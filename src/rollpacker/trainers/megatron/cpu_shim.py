"""The CPU shim for megatron-core: the only place rollpacker patches megatron, pinned to one version.

megatron-core is written for CUDA. On a CPU (gloo, this machine, CI) a handful of call sites fail;
this module maps them to the CPU, in the worker process only, and only when no GPU is used:

- ``torch.cuda.synchronize()`` (p2p shape exchange with variable sequence lengths): a no-op;
- ``torch.cuda.current_device()`` (rotary embedding, attention buffers, p2p, grad buffers): returns
  ``"cpu"``, which every caller passes on as a ``device=`` argument;
- hard-coded ``device="cuda"`` / ``.cuda()`` tensors in the schedules, p2p and the optimizer: a
  ``TorchFunctionMode`` rewrites a ``cuda`` device argument of tensor factories and ``.to``/``.cuda``
  to ``cpu``;
- ``param.type() == "torch.cuda.FloatTensor"`` checks in the distributed optimizer and grad
  clipping: the mode answers ``t.type()`` (no argument) with the ``torch.cuda.*`` name;
- the RNG tracker's ``model_parallel_cuda_manual_seed`` (``torch.cuda.get_rng_state``): the tracker
  stores CPU generator states instead (``_get_cuda_rng_state`` / ``_set_cuda_rng_state``);
- the default causal mask built with ``device="cuda"`` is never used: the backend passes a mask.

The GPU path never imports this module's patches (``apply`` is a no-op when CUDA is used).

Invariants:
- ``apply()`` refuses any megatron-core other than ``PINNED_VERSION`` by name (the call sites above
  were checked for that version only); tests/trainers/megatron/test_cpu_shim.py pins it;
- ``apply()`` is idempotent and never runs on a process that uses CUDA;
- ``fix_torch_adam_reload``, ``restore_torch_adam_step`` and ``init_torch_adam_state`` are the
  only fixes that are not CPU-only: megatron's torch-AdamW fallback (no Transformer Engine, no
  apex) cannot reload a distributed-optimizer checkpoint exactly in 0.16.1 without them (see
  their docstrings). They touch one optimizer instance each, never megatron's modules.
"""

from __future__ import annotations

from typing import Any

PINNED_VERSION = "0.16.1"
_APPLIED = False


class ShimError(RuntimeError):
    pass


def megatron_version() -> str:
    from importlib.metadata import version

    return version("megatron-core")


def check_version() -> None:
    got = megatron_version()
    if got != PINNED_VERSION:
        raise ShimError(
            f"megatron-core {got} is installed, the CPU shim was written for {PINNED_VERSION}: re-check "
            "the CUDA-only call sites listed in rollpacker/trainers/megatron/cpu_shim.py against the new "
            "version, then bump PINNED_VERSION (and requirements/lock.txt)"
        )


def apply(use_cuda: bool = False) -> bool:
    """Patch megatron-core's CUDA-only call sites to run on CPU; returns whether patches are on."""
    global _APPLIED
    if use_cuda:
        return False
    check_version()
    if _APPLIED:
        return True
    import torch

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    _patch_rng()
    _CudaToCpu().__enter__()  # process-wide: this process never uses a GPU
    _APPLIED = True
    return True


def _patch_rng() -> None:
    import torch
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> Any:
        return torch.get_rng_state()

    def set_state(new_state: Any, device: int = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state
    torch.cuda.manual_seed = torch.manual_seed  # type: ignore[assignment]
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()  # type: ignore[assignment]
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)  # type: ignore[assignment]


def _cpu(device: Any) -> Any:
    import torch

    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"
    return device


def _mode_base() -> type:
    from torch.overrides import TorchFunctionMode

    return TorchFunctionMode


class _CudaToCpu(_mode_base()):  # type: ignore[misc]
    """Rewrite ``device=cuda`` (and ``.cuda()`` / ``.to("cuda")``) to the CPU."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        import torch

        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        name = getattr(func, "__name__", "")
        if name == "cuda":
            return args[0]
        if name == "to" and len(args) > 1 and not isinstance(args[1], (torch.Tensor, torch.dtype)):
            args = (args[0], _cpu(args[1]), *args[2:])
        if name in ("pin_memory",):
            return args[0]
        if name == "type" and len(args) == 1 and not kwargs:  # ``t.type() == "torch.cuda.FloatTensor"``
            got = func(*args)
            return got.replace("torch.", "torch.cuda.", 1) if "cuda" not in got else got
        return func(*args, **kwargs)


def fix_torch_adam_reload(optimizer: Any) -> int:
    """Let megatron's distributed optimizer reload a checkpoint when its inner optimizer is torch's
    ``AdamW`` (megatron's fallback without Transformer Engine or apex: on this CPU, and on a GPU
    image without them, like ours). In 0.16.1 ``load_parameter_state_from_fully_reshardable``
    restores ``step`` from the param groups and then copies every per-parameter state key from
    the checkpoint's tensors, which leave ``step`` out: ``KeyError: 'step'``. The wrapper hands the
    already-restored ``step`` back for that copy (a no-op copy). Instance-level, on CPU and GPU;
    returns the number of optimizers wrapped (0 when none falls back to torch's AdamW)."""
    import torch

    check_version()
    wrapped = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.AdamW) or not hasattr(
            opt, "_set_main_param_and_optimizer_states"
        ):
            continue
        orig = opt._set_main_param_and_optimizer_states

        def set_states(model_param: Any, tensors: dict[str, Any], opt: Any = opt, orig: Any = orig) -> None:
            group_index, group_order = opt.model_param_group_index_map[model_param]
            main_param = opt.optimizer.param_groups[group_index]["params"][group_order]
            state = opt.optimizer.state[main_param]
            orig(model_param, {**{k: v for k, v in state.items() if k not in tensors}, **tensors})

        opt._set_main_param_and_optimizer_states = set_states
        wrapped += 1
    return wrapped


def restore_torch_adam_step(optimizer: Any, step: int) -> None:
    """The other half of the torch-AdamW reload gap: 0.16.1 saves Adam's ``step`` in the param
    groups but, for torch's AdamW, never writes it back into the per-parameter state on load, so
    the bias correction after a resume would use the step count from before it. ``step`` is the
    checkpoint's optimizer step count (one Adam step per ``finish_step``; a skipped step raises)."""
    import torch

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if isinstance(inner, torch.optim.AdamW):
            for state in inner.state.values():
                if "step" in state:
                    state["step"] = torch.full_like(state["step"], float(step))


def init_torch_adam_state(optimizer: Any) -> None:
    """Give a torch-AdamW fallback that has not stepped yet the state a checkpoint load expects:
    0.16.1's distributed optimizer reads ``step`` from every parameter's state when it builds the
    sharded state dict to load into, and megatron's own state initializer leaves ``step`` out
    (a gang resumed from a checkpoint before its first step would fail with an AssertionError)."""
    import torch

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.AdamW):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                st = inner.state[p]
                if not st:
                    st["exp_avg"] = torch.zeros_like(p.data)
                    st["exp_avg_sq"] = torch.zeros_like(p.data)
                st.setdefault("step", torch.tensor(0.0))
