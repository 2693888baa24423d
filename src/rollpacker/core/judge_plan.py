"""How many judge layers stay resident on the device: the layer-wise pipelined offload's plan.

The judge LLM shares the actor's devices (RollPacker §4.3). Its first ``k`` decoder layers stay
resident; the other ``L - k`` live in host memory and are streamed, layer by layer, into
``n_buffers`` reusable device buffers (double buffering: the copy of layer ``i + 1`` overlaps the
compute of layer ``i``). Its device memory is then::

    need(k) = fixed_bytes                                 # embeddings, final norm, head
            + (k + min(n_buffers, L - k)) * layer_bytes   # resident layers + streaming buffers
            + kv_bytes_per_token * seq_len * batch        # activations / KV of one forward

``choose_resident_layers`` returns the largest ``k`` whose ``need(k)`` fits the budget, so longer
sequences or bigger batches offload more layers, as the paper adjusts the number of offloaded
layers to the input length.

Invariants:
- ``need(k)`` is non-decreasing in ``k`` (a buffer only exists for a layer that is offloaded),
  so the fitting ``k`` form a prefix ``0..k*``;
- the result ``k*`` is in ``[0, num_layers]``, ``need(k*) <= budget_bytes``, and ``k*`` is maximal:
  ``k* == num_layers`` or ``need(k* + 1) > budget_bytes``;
- ``k*`` is non-decreasing in ``budget_bytes`` and non-increasing in ``seq_len``, ``batch`` and
  ``kv_bytes_per_token``;
- when even ``k = 0`` does not fit, ``ConfigError`` says how many bytes are missing and what to
  change; invalid arguments (negative sizes, no layers, ``n_buffers < 1``) raise ``ConfigError``.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollpacker.core.errors import ConfigError


@dataclass(frozen=True)
class JudgeMemory:
    """The judge's device memory at ``resident_layers`` = k, split by use (all in bytes)."""

    resident_layers: int
    buffers: int  # streaming buffers, each holding one offloaded layer
    weight_bytes: int  # fixed + (resident_layers + buffers) * layer_bytes
    activation_bytes: int  # kv_bytes_per_token * seq_len * batch

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.activation_bytes


def _check(name: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise ConfigError(f"{name} = {value}: must be >= {minimum}")


def stream_buffers(resident_layers: int, num_layers: int, n_buffers: int = 2) -> int:
    """Device buffers the offloaded layers need: ``min(n_buffers, num_layers - resident_layers)``."""
    return min(n_buffers, num_layers - resident_layers)


def resident_weight_bytes(
    resident_layers: int, num_layers: int, layer_bytes: int, fixed_bytes: int, n_buffers: int = 2
) -> int:
    """Device-resident weight bytes with ``resident_layers`` resident: fixed + (k + buffers) layers."""
    _check("num_layers", num_layers, 1)
    _check("n_buffers", n_buffers, 1)
    if not 0 <= resident_layers <= num_layers:
        raise ConfigError(f"resident_layers = {resident_layers}: must be in [0, {num_layers}]")
    _check("layer_bytes", layer_bytes, 0)
    _check("fixed_bytes", fixed_bytes, 0)
    return (
        fixed_bytes + (resident_layers + stream_buffers(resident_layers, num_layers, n_buffers)) * layer_bytes
    )


def judge_memory(
    resident_layers: int,
    *,
    num_layers: int,
    layer_bytes: int,
    fixed_bytes: int,
    kv_bytes_per_token: int,
    seq_len: int,
    batch: int,
    n_buffers: int = 2,
) -> JudgeMemory:
    """The judge's device memory with ``resident_layers`` resident (see the module docstring)."""
    for name, value in (("kv_bytes_per_token", kv_bytes_per_token), ("seq_len", seq_len), ("batch", batch)):
        _check(name, value, 0)
    weights = resident_weight_bytes(resident_layers, num_layers, layer_bytes, fixed_bytes, n_buffers)
    return JudgeMemory(
        resident_layers=resident_layers,
        buffers=stream_buffers(resident_layers, num_layers, n_buffers),
        weight_bytes=weights,
        activation_bytes=kv_bytes_per_token * seq_len * batch,
    )


def choose_resident_layers(
    budget_bytes: int,
    layer_bytes: int,
    fixed_bytes: int,
    kv_bytes_per_token: int,
    seq_len: int,
    batch: int,
    n_buffers: int = 2,
    *,
    num_layers: int,
) -> int:
    """The largest number of resident layers ``k`` whose device memory fits ``budget_bytes``.

    Raises ``ConfigError`` when even ``k = 0`` (every layer streamed) does not fit.
    """
    _check("budget_bytes", budget_bytes, 0)

    def need(k: int) -> int:
        return judge_memory(
            k,
            num_layers=num_layers,
            layer_bytes=layer_bytes,
            fixed_bytes=fixed_bytes,
            kv_bytes_per_token=kv_bytes_per_token,
            seq_len=seq_len,
            batch=batch,
            n_buffers=n_buffers,
        ).total_bytes

    floor = need(0)
    if floor > budget_bytes:
        raise ConfigError(
            f"the judge does not fit in {budget_bytes} bytes even with every layer offloaded: it needs "
            f"{floor} bytes ({fixed_bytes} fixed + {stream_buffers(0, num_layers, n_buffers)} stream "
            f"buffer(s) of {layer_bytes} + {kv_bytes_per_token * seq_len * batch} for {batch} x {seq_len} "
            f"tokens), {floor - budget_bytes} too many; raise the judge's memory budget, score smaller "
            "batches or shorter prompts, or use fewer stream buffers"
        )
    lo, hi = 0, num_layers  # need(lo) fits; find the largest k that fits (need is non-decreasing)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if need(mid) <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo
