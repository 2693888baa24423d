"""Cost models of one rollout engine for the what-if simulator, pure.

A ``StepCost`` prices what one engine replica does in one iteration: a decode step of ``batch``
requests holding ``tokens`` context tokens in all, and the prefill of newly admitted contexts. Two
implementations:

- ``ProfileCost``: the measured profile of ``rollpacker lab profile`` through the planner's latency
  predictor (``core.latency``): what the machine the profile was taken on does;
- ``RooflineCost``: a roofline of a named accelerator and model (spec files in
  ``rollpacker/lab/bench/whatif/specs/``, every number cited):
  a decode step is bound by the bytes it reads (the weights of one TP rank plus the KV of the
  batch) at the achievable memory bandwidth, or by its FLOPs at the achievable peak, whichever is
  slower; TP adds two ring all-reduces per layer; every step pays a fixed overhead (scheduler,
  sampling, kernel launches).

Roofline, per TP rank (``tp`` ranks, ``s = min(tp, kv_heads)`` KV shards)::

    decode_s(B, T)  = overhead + max(bytes / (bw * eff_bw), flops / (peak * eff_flops)) + comm(B)
    bytes           = weight_bytes / tp + T * kv_bytes_per_token / s
    flops           = (2 * matmul_params * B + 4 * layers * heads * head_dim * T) / tp
    comm(B)         = 2 * layers * (latency + 2 (tp-1)/tp * B * hidden * act_bytes / link_bw)   (tp > 1)
    prefill_s(cs)   = max(weight_bytes / tp / bw_eff, (2 * matmul_params * sum(cs)
                          + 2 * layers * heads * head_dim * sum(c^2)) / tp / peak_eff) + comm(sum(cs))
    kv_capacity     = (tp * memory * utilization - weight_bytes) / (kv_bytes_per_token * tp / s)

Invariants (tests/lab/bench/whatif/test_costmodel.py):
- a spec with a missing, unknown or non-physical field (bandwidth <= 0, efficiency outside (0, 1],
  a declared parameter count the architecture does not add up to) is refused by name;
- roofline decode time is monotone non-decreasing in batch and in context tokens;
- at batch 1 and short context a decode step is memory-bound: weight bytes / bandwidth + overhead;
- more TP never makes the memory-bound part of a step slower;
- a model that does not fit on ``tp`` devices is refused, naming the devices needed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from rollpacker.core.errors import ConfigError
from rollpacker.core.latency import Layout, Predictor

GIB = 1 << 30
PARAM_TOLERANCE = 0.05  # declared vs architecture-derived parameter count


class SpecError(ConfigError):
    """A hardware or model spec file that cannot be used: the message names the file and field."""


class StepCost(Protocol):
    """Seconds one engine replica spends per iteration (the what-if simulator's clock)."""

    @property
    def label(self) -> str: ...

    @property
    def tp(self) -> int: ...

    @property
    def kv_capacity_tokens(self) -> int: ...

    def decode_s(self, batch: int, tokens: float) -> float: ...

    def prefill_s(self, contexts: Sequence[int]) -> float: ...


# ---------------------------------------------------------------------------------------------
# spec files


def _number(d: Mapping[str, Any], key: str, where: str, *, positive: bool = True) -> float:
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise SpecError(f"{where}: field {key!r} = {v!r}: must be a number")
    if positive and v <= 0:
        raise SpecError(f"{where}: field {key!r} = {v!r}: must be > 0 (not physical otherwise)")
    if not positive and v < 0:
        raise SpecError(f"{where}: field {key!r} = {v!r}: must be >= 0")
    return float(v)


def _integer(d: Mapping[str, Any], key: str, where: str) -> int:
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise SpecError(f"{where}: field {key!r} = {v!r}: must be an integer >= 1")
    return v


def _fraction(d: Mapping[str, Any], key: str, where: str) -> float:
    v = _number(d, key, where)
    if v > 1.0:
        raise SpecError(f"{where}: field {key!r} = {v!r}: must be in (0, 1]")
    return v


def _check_keys(d: Any, cls: type, where: str) -> Mapping[str, Any]:
    """``d`` as a mapping with exactly ``cls``'s fields (``sources`` included); the first missing or
    unknown key is named."""
    if not isinstance(d, Mapping):
        raise SpecError(f"{where}: expected a mapping of fields, got {type(d).__name__}")
    names = [f.name for f in fields(cls)]
    _same_keys(d, names, where, f"unknown field {{!r}}; allowed: {', '.join(names)}", "missing field {!r}")
    return d


def _same_keys(have: Mapping[str, Any], want: Sequence[str], where: str, unknown: str, missing: str) -> None:
    """Raise naming the first key of ``have`` not in ``want`` (``unknown``), then the first of
    ``want`` not in ``have`` (``missing``); both messages take the key through ``{!r}``."""
    extra = sorted(set(have) - set(want))
    if extra:
        raise SpecError(f"{where}: " + unknown.format(extra[0]))
    absent = [n for n in want if n not in have]
    if absent:
        raise SpecError(f"{where}: " + missing.format(absent[0]))


def _sources(d: Mapping[str, Any], numeric: Sequence[str], where: str) -> dict[str, str]:
    """Every numeric field needs a citation: ``sources`` maps field names to where it comes from."""
    src = d["sources"]
    if not isinstance(src, Mapping) or not all(isinstance(v, str) and v.strip() for v in src.values()):
        raise SpecError(f"{where}: field 'sources' must map field names to non-empty citations")
    _same_keys(
        src,
        numeric,
        where,
        "sources cites unknown field {!r}",
        "field {!r} has no source in 'sources'; cite where it comes from",
    )
    return {str(k): str(v) for k, v in src.items()}


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator: datasheet figures and the efficiencies a real engine reaches on them."""

    name: str
    memory_gib: float  # device memory (HBM), GiB
    memory_bandwidth_gb_s: float  # peak HBM bandwidth, GB/s (1e9 bytes)
    peak_bf16_tflops: float  # dense BF16 tensor throughput, TFLOP/s
    link_bandwidth_gb_s: float  # NVLink, one direction per device, GB/s
    devices_per_node: int  # TP stays within one node
    bandwidth_efficiency: float  # achievable share of the peak bandwidth in decode kernels
    compute_efficiency: float  # achievable share of the peak FLOPs
    memory_utilization: float  # share of device memory the engine may use (vLLM gpu_memory_utilization)
    step_overhead_s: float  # per-iteration fixed cost: scheduler, sampling, launches
    allreduce_latency_s: float  # latency of one small all-reduce among the TP ranks
    sources: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_mapping(cls, d: Any, where: str = "hardware spec") -> HardwareSpec:
        m = _check_keys(d, cls, where)
        nums = ("memory_gib", "memory_bandwidth_gb_s", "peak_bf16_tflops", "link_bandwidth_gb_s")
        fracs = ("bandwidth_efficiency", "compute_efficiency", "memory_utilization")
        lat = ("step_overhead_s", "allreduce_latency_s")
        name = m["name"]
        if not isinstance(name, str) or not name.strip():
            raise SpecError(f"{where}: field 'name' must be a non-empty string")
        return cls(
            name=name,
            **{k: _number(m, k, where) for k in nums},
            devices_per_node=_integer(m, "devices_per_node", where),
            **{k: _fraction(m, k, where) for k in fracs},
            **{k: _number(m, k, where, positive=False) for k in lat},
            sources=_sources(m, (*nums, "devices_per_node", *fracs, *lat), where),
        )


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer (Qwen2 architecture): its shapes, from the model's config."""

    name: str
    num_params: int  # declared total parameters (checked against the shapes)
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    bytes_per_param: int  # 2 = bf16 weights
    kv_bytes_per_value: int  # 2 = bf16 KV cache
    sources: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_mapping(cls, d: Any, where: str = "model spec") -> ModelSpec:
        m = _check_keys(d, cls, where)
        ints = [f.name for f in fields(cls) if f.name not in ("name", "tie_word_embeddings", "sources")]
        name, tie = m["name"], m["tie_word_embeddings"]
        if not isinstance(name, str) or not name.strip():
            raise SpecError(f"{where}: field 'name' must be a non-empty string")
        if not isinstance(tie, bool):
            raise SpecError(f"{where}: field 'tie_word_embeddings' = {tie!r}: must be true or false")
        spec = cls(
            name=name,
            tie_word_embeddings=tie,
            sources=_sources(m, (*ints, "tie_word_embeddings"), where),
            **{k: _integer(m, k, where) for k in ints},
        )
        spec._check_shapes(where)
        return spec

    def _check_shapes(self, where: str) -> None:
        if self.num_attention_heads % self.num_kv_heads:
            raise SpecError(
                f"{where}: num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_kv_heads {self.num_kv_heads}"
            )
        derived = self.derived_params
        if abs(derived - self.num_params) > PARAM_TOLERANCE * self.num_params:
            raise SpecError(
                f"{where}: field 'num_params' = {self.num_params:,} but the shapes add up to {derived:,} "
                f"(more than {PARAM_TOLERANCE:.0%} apart): a shape or the count is wrong"
            )

    @property
    def layer_params(self) -> int:
        """One layer's matmul weights: q and o (hidden^2 each), k and v, gate/up/down."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attn = 2 * h * self.num_attention_heads * self.head_dim + 2 * h * kv
        return attn + 3 * h * self.intermediate_size

    @property
    def derived_params(self) -> int:
        emb = self.vocab_size * self.hidden_size
        return self.num_layers * self.layer_params + emb * (1 if self.tie_word_embeddings else 2)

    @property
    def matmul_params(self) -> int:
        """Parameters a token multiplies through: every layer and the LM head (not the lookup)."""
        return self.num_layers * self.layer_params + self.vocab_size * self.hidden_size

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token (whole model)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes_per_value


# ---------------------------------------------------------------------------------------------
# cost models


@dataclass(frozen=True)
class RooflineCost:
    """``model`` on ``tp`` devices of ``hardware`` (one replica); see the module docstring."""

    hardware: HardwareSpec
    model: ModelSpec
    tp: int = 1
    act_bytes: int = 2  # bytes per activation value all-reduced (bf16)

    def __post_init__(self) -> None:
        hw = self.hardware
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ConfigError(f"tp = {self.tp!r}: must be a positive integer")
        if self.tp > hw.devices_per_node:
            raise ConfigError(
                f"tp = {self.tp}: {hw.name} has {hw.devices_per_node} devices per node "
                "and TP stays in one node"
            )
        if self.model.num_attention_heads % self.tp:
            raise ConfigError(
                f"tp = {self.tp}: {self.model.name}'s {self.model.num_attention_heads} attention heads "
                "do not split evenly"
            )
        if self.kv_capacity_tokens < 1:
            usable = hw.memory_gib * hw.memory_utilization
            need = math.ceil(self.model.weight_bytes / GIB / usable)
            raise ConfigError(
                f"{self.model.name} ({self.model.weight_bytes / GIB:.1f} GiB of weights) leaves no KV cache "
                f"on {self.tp} x {hw.name} ({usable:.0f} GiB usable each): use tp >= {need + 1}"
            )

    @property
    def label(self) -> str:
        return f"roofline {self.model.name} on {self.tp} x {self.hardware.name}"

    @property
    def _kv_shards(self) -> int:
        return min(self.tp, self.model.num_kv_heads)

    @property
    def kv_capacity_tokens(self) -> int:
        hw = self.hardware
        free = self.tp * hw.memory_gib * GIB * hw.memory_utilization - self.model.weight_bytes
        per_token = self.model.kv_bytes_per_token * self.tp / self._kv_shards  # replicated heads
        return int(free // per_token) if free > 0 else 0

    def _bw(self) -> float:
        return self.hardware.memory_bandwidth_gb_s * 1e9 * self.hardware.bandwidth_efficiency

    def _peak(self) -> float:
        return self.hardware.peak_bf16_tflops * 1e12 * self.hardware.compute_efficiency

    def comm_s(self, tokens: float) -> float:
        """Two ring all-reduces per layer of ``tokens`` hidden vectors among the TP ranks."""
        if self.tp == 1:
            return 0.0
        hw, m = self.hardware, self.model
        nbytes = tokens * m.hidden_size * self.act_bytes
        ring = 2.0 * (self.tp - 1) / self.tp * nbytes / (hw.link_bandwidth_gb_s * 1e9)
        return 2 * m.num_layers * (hw.allreduce_latency_s + ring)

    def decode_s(self, batch: int, tokens: float) -> float:
        if batch <= 0:
            return 0.0
        m = self.model
        nbytes = m.weight_bytes / self.tp + tokens * m.kv_bytes_per_token / self._kv_shards
        attn = 4.0 * m.num_layers * m.num_attention_heads * m.head_dim * tokens
        flops = (2.0 * m.matmul_params * batch + attn) / self.tp
        return (
            self.hardware.step_overhead_s
            + max(nbytes / self._bw(), flops / self._peak())
            + self.comm_s(batch)
        )

    def prefill_s(self, contexts: Sequence[int]) -> float:
        if not contexts:
            return 0.0
        m = self.model
        n = float(sum(contexts))
        attn = 2.0 * m.num_layers * m.num_attention_heads * m.head_dim * sum(c * c for c in contexts)
        flops = (2.0 * m.matmul_params * n + attn) / self.tp
        return max(m.weight_bytes / self.tp / self._bw(), flops / self._peak()) + self.comm_s(n)


@dataclass(frozen=True)
class ProfileCost:
    """One replica of a profiled ``layout``, timed by the latency predictor on the measured table."""

    predictor: Predictor
    layout: Layout

    def __post_init__(self) -> None:
        self.predictor.table.layout(self.layout)  # raises naming what the profile has

    @property
    def label(self) -> str:
        t = self.predictor.table
        return f"profile {t.model} on {t.hardware}, {self.layout.name}"

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def kv_capacity_tokens(self) -> int:
        return self.predictor.kv_capacity(self.layout)

    def decode_s(self, batch: int, tokens: float) -> float:
        return self.predictor.decode_step_s(self.layout, batch, tokens)

    def prefill_s(self, contexts: Sequence[int]) -> float:
        """What prefilling the admitted contexts adds to the step that carries them: the profile's
        prefill of one batch of their RMS length, less its prefill at the shortest profiled context.
        The profiler times a prefill from submission until every request has started, which
        includes the engine's fixed submit-to-first-step latency (a few decode steps on vLLM's
        CPU build, whatever the length); a request admitted into a running batch does not pay it."""
        if not contexts:
            return 0.0
        rms = math.sqrt(sum(c * c for c in contexts) / len(contexts))
        full = self.predictor.prefill_s(self.layout, len(contexts), rms)
        return max(0.0, full - self.predictor.prefill_s(self.layout, len(contexts), self._shortest))

    @property
    def _shortest(self) -> float:
        return float(min(p.context for p in self.predictor.table.layout(self.layout).points))


def decode_run_s(cost: StepCost, batch: int, tokens: float, steps: int) -> float:
    """``steps`` decode iterations of an unchanging batch whose context grows by ``batch`` tokens
    each: priced at the midpoint context (exact where the cost is linear in context, as the
    roofline is and the profile is piecewise)."""
    if steps <= 0 or batch <= 0:
        return 0.0
    return steps * cost.decode_s(batch, tokens + batch * (steps - 1) / 2.0)
