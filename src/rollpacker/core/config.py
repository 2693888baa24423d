"""The config tree: frozen dataclasses, validated on construction.

Invariants:
- every field is checked when the object is built; an invalid value raises ``ConfigError`` naming
  the field, the value and what is allowed;
- ``from_mapping`` rejects unknown keys by name (a typo never silently falls back to a default);
- each component receives only its own sub-tree.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from rollpacker.core.errors import ConfigError


class PolicyName(enum.Enum):
    SYNC = "sync"
    TAIL_BATCHING = "tail_batching"


@dataclass(frozen=True)
class RolloutConfig:
    """How one rollout step is shaped (the paper's P0, R0, eta)."""

    policy: PolicyName = PolicyName.TAIL_BATCHING
    prompts_per_step: int = 16  # P0
    responses_per_prompt: int = 4  # R0
    eta_p: float = 1.25  # prompt speculation factor (1.0 disables)
    eta_r: float = 1.25  # response speculation factor (1.0 disables)
    max_tokens: int = 1024  # max response length
    temperature: float = 1.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        _positive_int("rollout.prompts_per_step (P0)", self.prompts_per_step)
        _positive_int("rollout.responses_per_prompt (R0)", self.responses_per_prompt)
        _positive_int("rollout.max_tokens", self.max_tokens)
        for name, v in (("rollout.eta_p", self.eta_p), ("rollout.eta_r", self.eta_r)):
            if not (isinstance(v, (int, float)) and math.isfinite(v) and 1.0 <= v <= 8.0):
                raise ConfigError(
                    f"{name} = {v!r}: the speculation factor must be a number in [1.0, 8.0] "
                    "(1.0 disables speculation; the paper's default is 1.25)"
                )
        if self.temperature < 0:
            raise ConfigError(f"rollout.temperature = {self.temperature!r}: must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"rollout.top_p = {self.top_p!r}: must be in (0, 1]")

    @property
    def launched_prompts(self) -> int:
        """Prompts launched in a short round: ceil(eta_p * P0)."""
        return speculative_count(self.eta_p, self.prompts_per_step)

    @property
    def launched_responses(self) -> int:
        """Responses launched per prompt in a short round: ceil(eta_r * R0)."""
        return speculative_count(self.eta_r, self.responses_per_prompt)


@dataclass(frozen=True)
class EngineConfig:
    """How the rollout engine is sized (vLLM's knobs, engine-neutral names)."""

    model_dir: str = ""
    max_num_seqs: int = 128  # engine concurrency limit: Q in the bubble ratio
    max_model_len: int = 2048
    kv_cache_gib: float = 1.0  # VLLM_CPU_KVCACHE_SPACE on CPU
    tensor_parallel_size: int = 1
    seed: int = 0
    dtype: str = "float32"

    def __post_init__(self) -> None:
        _positive_int("engine.max_num_seqs", self.max_num_seqs)
        _positive_int("engine.max_model_len", self.max_model_len)
        _positive_int("engine.tensor_parallel_size", self.tensor_parallel_size)
        if not (self.kv_cache_gib > 0):
            raise ConfigError(f"engine.kv_cache_gib = {self.kv_cache_gib!r}: must be > 0 (GiB)")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"engine.dtype = {self.dtype!r}: use one of float32, bfloat16, float16")


def speculative_count(eta: float, base: int) -> int:
    """ceil(eta * base), robust to float noise (1.25 * 16 is exactly 20, never 21)."""
    return max(base, math.ceil(round(eta * base, 9)))


def _positive_int(name: str, v: object) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"{name} = {v!r}: must be a positive integer")


T = TypeVar("T")


def from_mapping(cls: type[T], data: Mapping[str, Any], where: str = "") -> T:
    """Build a config dataclass from a mapping, rejecting unknown keys by name.

    Nested dataclasses and enums are converted; ``where`` prefixes key names in errors.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a config dataclass")
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where or cls.__name__}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown config key(s) {', '.join(repr(where + k) for k in unknown)}; "
            f"known keys here: {', '.join(sorted(fields))}"
        )
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        kwargs[key] = _convert(hints[key], value, f"{where}{key}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{where or cls.__name__}: {e}") from e


def _convert(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        tp = args[0]
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return from_mapping(tp, value, where + ".")
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in tp)
            raise ConfigError(f"{where} = {value!r}: use one of {allowed}") from None
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool) and not isinstance(value, tp):
        raise ConfigError(f"{where} = {value!r}: expected {tp.__name__}")
    return value
