"""The config tree: frozen dataclasses, validated on construction.

Invariants:
- every field is checked when the object is built; an invalid value raises ``ConfigError`` naming
  the field, the value and what is allowed;
- ``from_mapping`` rejects unknown keys by name (a typo never silently falls back to a default);
- each component receives only its own sub-tree.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from rollpacker.core.advantages import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, RewardShaping
from rollpacker.core.devices import (
    JUDGE_DTYPES,
    TRAIN_DTYPES,
    check_device_setting,
    check_judge,
    gpu_declarations,
    is_cuda,
)
from rollpacker.core.drafts import SpeculationConfig
from rollpacker.core.errors import ConfigError
from rollpacker.core.fidelity import RolloutCorrectionConfig, SyncProbeConfig
from rollpacker.core.planner import PlannerConfig
from rollpacker.core.scaledown import ScaleDownConfig
from rollpacker.core.tasks import BUILTIN_TASKS, FILE_SUFFIXES
from rollpacker.core.timeout import TimeoutConfig

# the registered objectives (rollpacker.trainers.objectives; a test keeps the two equal)
OBJECTIVE_NAMES = ("ppo", "decoupled_ppo", "gspo")


class PolicyName(enum.Enum):
    SYNC = "sync"
    TAIL_BATCHING = "tail_batching"
    SORTED = "sorted"  # SortedRL (docs/policies.md)
    PARTIAL = "partial"  # async partial rollout (docs/policies.md)


class SortedMode(enum.Enum):
    ON_POLICY = "on_policy"  # unfinished requests terminated, their prompts scavenged back
    PARTIAL = "partial"  # unfinished requests' tokens and logprobs cached and resumed


@dataclass(frozen=True)
class SortedConfig:
    """SortedRL (arXiv:2603.23414): ``group_size`` (n) update batches of prompts are loaded into the buffer
    at once and no new prompt is loaded until every one of them is trained."""

    mode: SortedMode = SortedMode.ON_POLICY
    group_size: int = 4  # n: prompt batches loaded together (the paper's default sensitivity: 2-8)

    def __post_init__(self) -> None:
        _positive_int("rollout.sorted.group_size", self.group_size)


@dataclass(frozen=True)
class PartialConfig:
    """Async partial rollout (verl's "Async Partial Rollout Trainer" recipe): supplementation,
    interruption, cached partial samples."""

    max_staleness: int = 2  # a cached sample older than this many policy versions is regenerated
    # requests supplementation keeps running; 0 = one update's worth (P0 x R0) within the engine's
    # max_num_seqs. More than that starts prompts faster than updates train them: more of them fall
    # due at once than one update holds, and their samples are regenerated (docs/policies.md)
    in_flight: int = 0

    def __post_init__(self) -> None:
        for name in ("max_staleness", "in_flight"):
            _non_negative_int(f"rollout.partial.{name}", getattr(self, name))


@dataclass(frozen=True)
class DynamicSamplingConfig:
    """DAPO's dynamic sampling (``rollout.dynamic_sampling``): a group whose rewards are all equal
    carries no signal and is dropped (not trained, not queued); the round draws a new prompt for
    it and runs until ``P0`` groups with signal are in (core/policies/dynamic.py)."""

    enabled: bool = False
    max_extra_prompts: int = 64  # prompts one step may draw to replace dropped groups

    def __post_init__(self) -> None:
        _positive_int("rollout.dynamic_sampling.max_extra_prompts", self.max_extra_prompts)


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
    sorted: SortedConfig = dataclasses.field(default_factory=SortedConfig)
    partial: PartialConfig = dataclasses.field(default_factory=PartialConfig)
    # one-off pipeline (RollPacker 6.7): the rollouts of step t are trained at step t+1, while
    # step t+1 rolls out with the weights before that update (one version of staleness)
    one_off: bool = False
    # RollPacker 4.4, Algorithm 1 at runtime: once 20-50 % of a round's requests completed and the
    # rest fit on fewer engine replicas, migrate them and hand the freed devices to the stream
    # trainer until the step ends (needs planner.devices >= 2; docs/parallelism.md)
    scale_down: ScaleDownConfig = dataclasses.field(default_factory=ScaleDownConfig)
    dynamic_sampling: DynamicSamplingConfig = dataclasses.field(default_factory=DynamicSamplingConfig)

    def __post_init__(self) -> None:
        self._check_dynamic_sampling()
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

    def _check_dynamic_sampling(self) -> None:
        if not self.dynamic_sampling.enabled:
            return
        if self.responses_per_prompt < 2:
            raise ConfigError(
                f"rollout.dynamic_sampling.enabled with rollout.responses_per_prompt (R0) = "
                f"{self.responses_per_prompt}: a group of one response never has reward variance, so "
                "no update could ever fill; set responses_per_prompt >= 2 or turn dynamic sampling off"
            )
        if self.policy is not PolicyName.TAIL_BATCHING:
            raise ConfigError(
                f"rollout.dynamic_sampling.enabled with rollout.policy = {self.policy.value!r}: dynamic "
                "sampling runs under tail_batching (its long-prompt queue takes the replacement prompts "
                "still running when the update is full); use policy: tail_batching (eta_p = eta_r = 1.0 "
                "for no speculation)"
            )

    @property
    def launched_prompts(self) -> int:
        """Prompts launched in a short round: ceil(eta_p * P0)."""
        return speculative_count(self.eta_p, self.prompts_per_step)

    @property
    def launched_responses(self) -> int:
        """Responses launched per prompt in a short round: ceil(eta_r * R0)."""
        return speculative_count(self.eta_r, self.responses_per_prompt)


ENGINE_KINDS = ("vllm", "simulated")


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
    speculation: SpeculationConfig = dataclasses.field(default_factory=SpeculationConfig)
    # where vLLM runs: auto (the installed vLLM's platform, or $ROLLPACKER_VLLM_DEVICE), cpu, cuda
    device: str = "auto"
    # on CUDA: the share of each of its GPUs' memory one engine takes (weights, activations, KV
    # cache); a GPU holds floor(1 / this) engines, so the engine pool keeps that many layouts warm
    # (docs/parallelism.md "Engines on GPUs"). On CPU kv_cache_gib sizes the KV cache instead.
    gpu_memory_utilization: float = 0.9
    cuda_graphs: str | bool = "auto"  # auto = on for CUDA, off on CPU (vLLM's enforce_eager)
    # vllm: the real engine; simulated: a deterministic stand-in in the model's vocabulary that
    # starts at once (engines/simulated.py): for dry runs and the interrupt tests, never for results
    kind: str = "vllm"

    def __post_init__(self) -> None:
        if self.kind not in ENGINE_KINDS:
            raise ConfigError(
                f"engine.kind = {self.kind!r}: use one of {', '.join(ENGINE_KINDS)} (simulated: a stand-in "
                "engine for dry runs, whose samples and logprobs are not the model's)"
            )
        _positive_int("engine.max_num_seqs", self.max_num_seqs)
        _positive_int("engine.max_model_len", self.max_model_len)
        _positive_int("engine.tensor_parallel_size", self.tensor_parallel_size)
        if not (self.kv_cache_gib > 0):
            raise ConfigError(f"engine.kv_cache_gib = {self.kv_cache_gib!r}: must be > 0 (GiB)")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"engine.dtype = {self.dtype!r}: use one of float32, bfloat16, float16")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"engine.device = {self.device!r}: use one of auto, cpu, cuda")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, int | float) or not 0 < u <= 1:
            raise ConfigError(
                f"engine.gpu_memory_utilization = {u!r}: the share of a GPU's memory one engine "
                "takes, in (0, 1] (0.9 for one engine per GPU; 0.45 keeps two layouts warm)"
            )
        if self.cuda_graphs not in ("auto", True, False):
            raise ConfigError(f"engine.cuda_graphs = {self.cuda_graphs!r}: use auto, true or false")


def speculative_count(eta: float, base: int) -> int:
    """ceil(eta * base), robust to float noise (1.25 * 16 is exactly 20, never 21)."""
    return max(base, math.ceil(round(eta * base, 9)))


def _positive_int(name: str, v: object) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"{name} = {v!r}: must be a positive integer")


def _non_negative_int(name: str, v: object, meaning: str = "") -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ConfigError(f"{name} = {v!r}: must be an integer >= 0{meaning}")


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
        if len(args) > 1 and type(value) in args:  # e.g. ``str | bool``: a value of one of them
            return value
        tp = args[0]
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if isinstance(value, str) and hasattr(tp, "from_name"):
            return tp.from_name(value, where)
        return from_mapping(tp, value, where + ".")
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in tp)
            raise ConfigError(f"{where} = {value!r}: use one of {allowed}") from None
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} = {value!r}: expected a list")
        (item,) = {a for a in typing.get_args(tp) if a is not Ellipsis}
        return tuple(_convert(item, v, f"{where}[{i}]") for i, v in enumerate(value))
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        # YAML 1.1 reads ``3e-5`` (no dot) as a string; accept any float literal.
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{where} = {value!r}: expected a number") from None
    if tp in (int, float, str, bool) and not isinstance(value, tp):
        raise ConfigError(f"{where} = {value!r}: expected {tp.__name__}")
    return value


RECOMPUTE_MODES = ("none", "selective", "full")
ATTENTION_KINDS = ("unfused", "sdpa")


WEIGHT_SYNC_PATHS = ("object_store", "collective")  # train.weight_sync
LOSS_NORMS = ("token_mean", "seq_mean", "constant")  # train.loss_norm (core/stream_math.py, LossNorm)


@dataclass(frozen=True)
class MegatronConfig:
    """The megatron-core backend's parallel layout (``train.backend: megatron``; docs/megatron.md):
    a gang of ``tp * pp * dp`` ranks, one Ray actor each. The model-dependent checks (TP dividing
    the heads and KV heads, PP dividing the layers) run when the config is loaded for a command
    (``core/model_fit.py``), and again with the architecture when the gang is built, against the
    model's ``config.json``, before any rank starts."""

    tp: int = 1  # tensor-parallel size
    pp: int = 1  # pipeline-parallel size
    dp: int = 0  # data-parallel size; 0 = world_size / (tp * pp)
    world_size: int = 0  # ranks (devices) of the gang; 0 = tp * pp * dp (dp 0 then means 1)
    optimizer: str = "adam"  # adam (AdamW, as the torch backend) | sgd (exactness checks)
    distributed_optimizer: bool = True  # optimizer state sharded over DP (megatron's ZeRO-1)
    bucket_mb: float = 256.0  # weight sync into the rollout engine in buckets of at most this
    cpus_per_rank: float = 1.0  # Ray resources of each rank's placement-group bundle
    gpus_per_rank: float = 0.0  # 0: gloo on CPU; 1: one GPU per rank, NCCL
    # float32 | bfloat16 (bf16 weights and activations, fp32 master weights, grads reduced in fp32)
    dtype: str = "float32"
    # a custom Ray resource every bundle also asks 1 of (the training worker group's, e.g.
    # rollpacker_training), so the ranks land on that group; "" = any node
    resource: str = ""
    # activation recompute (docs/megatron.md): none (keep every activation) | selective (recompute
    # the core attention in backward: no per-layer [heads, seq, seq] probabilities kept) | full
    # (keep each layer's input only, recompute the layer in backward)
    recompute: str = "none"
    # core attention: unfused (megatron's local DotProductAttention: [heads, seq, seq] scores kept)
    # | sdpa (torch's fused scaled_dot_product_attention: linear in the sequence length)
    attention: str = "unfused"
    # each rank's device memory; the gang refuses a plan whose estimate (core/memory.py) exceeds it
    gpu_memory_gib: float = 80.0

    def __post_init__(self) -> None:
        _positive_int("train.megatron.tp", self.tp)
        _positive_int("train.megatron.pp", self.pp)
        for name in ("dp", "world_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"train.megatron.{name} = {v!r}: must be an integer >= 0 (0: derived)")
        if self.world_size and self.world_size % (self.tp * self.pp):
            raise ConfigError(
                f"train.megatron.world_size = {self.world_size} is not a multiple of tp * pp = "
                f"{self.tp} * {self.pp}: the world size must be tp * pp * dp"
            )
        if self.world_size and self.dp and self.world_size != self.tp * self.pp * self.dp:
            raise ConfigError(
                f"train.megatron.world_size = {self.world_size} != tp * pp * dp = "
                f"{self.tp} * {self.pp} * {self.dp}: set them consistently (or dp: 0 to derive it)"
            )
        if self.optimizer not in ("adam", "sgd"):
            raise ConfigError(f"train.megatron.optimizer = {self.optimizer!r}: use 'adam' or 'sgd'")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"train.megatron.dtype = {self.dtype!r}: use 'float32' or 'bfloat16'")
        if self.attention not in ATTENTION_KINDS:
            raise ConfigError(
                f"train.megatron.attention = {self.attention!r}: use one of {', '.join(ATTENTION_KINDS)}"
            )
        if self.recompute not in RECOMPUTE_MODES:
            raise ConfigError(
                f"train.megatron.recompute = {self.recompute!r}: use one of {', '.join(RECOMPUTE_MODES)}"
            )
        if self.optimizer == "sgd" and self.distributed_optimizer:
            raise ConfigError(
                "train.megatron.optimizer = 'sgd' with distributed_optimizer: true: megatron's distributed "
                "optimizer is Adam-only; set distributed_optimizer: false"
            )
        for name in ("bucket_mb", "cpus_per_rank", "gpu_memory_gib"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ConfigError(f"train.megatron.{name} = {v!r}: must be a positive number")
        if self.gpus_per_rank not in (0, 1):
            raise ConfigError(f"train.megatron.gpus_per_rank = {self.gpus_per_rank!r}: use 0 (CPU) or 1")

    @property
    def data_parallel(self) -> int:
        return self.dp or (self.world_size // (self.tp * self.pp) if self.world_size else 1)

    @property
    def ranks(self) -> int:
        return self.tp * self.pp * self.data_parallel


@dataclass(frozen=True)
class TrainerConfig:
    """The policy-gradient trainer (GRPO with a PPO-clip ratio around the trainer's own ``pi_old``,
    or the decoupled PPO objective of partial rollout: docs/policies.md; rollout correction:
    docs/training.md)."""

    lr: float = 3e-5  # this tiny model destabilizes at >= 1e-4 (docs/training.md)
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    grad_clip: float = 1.0  # max global grad norm (0 disables)
    clip_eps_low: float = 0.2  # ratio clipped to [1 - low, 1 + high]
    clip_eps_high: float = 0.28
    kl_coef: float = 0.0  # k3 KL to the reference (the model RL started from); 0 disables
    # token_mean | seq_mean | constant (Dr. GRPO's: budget x responses; core/stream_math.py)
    loss_norm: str = "token_mean"
    loss_budget_tokens: int = 0  # the constant normaliser's budget per response; 0 = rollout.max_tokens
    scale_advantages: bool = True  # GRPO's /std; false = Dr. GRPO
    mini_batches: int = 1  # optimizer steps per RL step (monolithic mode only)
    tokens_per_micro_batch: int = 8192  # padded tokens per forward/backward
    stream: bool = True  # gradients during rollout, one deferred update
    seed: int = 0
    # ppo: clip(pi / pi_old); decoupled_ppo: pi_old / pi_behav * clip(pi / pi_old) (AReaL);
    # gspo: sequence-level ratio and clipping; auto: decoupled where tokens can be stale (partial,
    # sorted partial, one-off), ppo otherwise (pi_old: the trainer's logprobs at the start of the
    # update; core/fidelity.py)
    objective: str = "auto"
    # importance weights pi_old / pi_rollout (TIS / MIS) against the engine/trainer mismatch; off
    correction: RolloutCorrectionConfig = dataclasses.field(default_factory=RolloutCorrectionConfig)
    # after each weight push: the engine's logprobs on probe prompts vs the trainer's (core/fidelity.py)
    sync_probe: SyncProbeConfig = dataclasses.field(default_factory=SyncProbeConfig)
    # grpo | dr_grpo | reinforce_pp (core/advantages.py); auto: grpo, or dr_grpo when
    # scale_advantages is false
    advantage: str = "auto"
    reward_kl_coef: float = 0.0  # beta of the KL in the reward (reinforce_pp only); 0 disables
    kl_estimator: str = "k1"  # k1 | k2 | k3: the reward KL's per-token estimate
    # DAPO: soft overlong penalty over the last overlong_buffer tokens before rollout.max_tokens
    overlong_buffer: int = 0  # L_cache in tokens; 0 disables
    overlong_penalty: float = 1.0  # the penalty at max_tokens (DAPO: 1.0)
    overlong_filter: bool = False  # truncated responses left out of the loss
    backend: str = "torch"  # torch (one device) | megatron (a TP/PP/DP gang: train.megatron)
    megatron: MegatronConfig = dataclasses.field(default_factory=MegatronConfig)
    # the torch backend's device and dtype (megatron: train.megatron); auto = cuda when the trainer
    # sees a GPU, and refused when it sees none on a config that declares GPUs (docs/training.md)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "float32"  # float32 | bfloat16 (as the engine samples on GPUs: engine.dtype)
    # how new weights reach the rollout engine after each update (docs/megatron.md, "Weights pushed
    # by collectives"): object_store (one Ray call through the object store: works wherever Ray
    # does) | collective (a broadcast over a process group with the engine's workers, NCCL on
    # GPUs, gloo on CPU: bucketed, checked by digest, no object store; the megatron gang sends
    # from one rank per pipeline stage; engines in layouts all receive it)
    weight_sync: str = "object_store"

    def __post_init__(self) -> None:
        if self.backend not in ("torch", "megatron"):
            raise ConfigError(f"train.backend = {self.backend!r}: use 'torch' or 'megatron'")
        if self.weight_sync not in WEIGHT_SYNC_PATHS:
            raise ConfigError(
                f"train.weight_sync = {self.weight_sync!r}: use one of {', '.join(WEIGHT_SYNC_PATHS)}"
            )
        check_device_setting("train.device", self.device)
        if self.dtype not in TRAIN_DTYPES:
            raise ConfigError(f"train.dtype = {self.dtype!r}: use one of {', '.join(TRAIN_DTYPES)}")
        if self.backend == "megatron" and self.kl_coef > 0:
            raise ConfigError(
                f"train.kl_coef = {self.kl_coef} with train.backend: megatron: the megatron backend has "
                "no reference model yet; set kl_coef: 0 or backend: torch"
            )
        for name in ("lr", "adam_beta1", "adam_beta2"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ConfigError(f"train.{name} = {v!r}: must be a positive number")
        for name in ("weight_decay", "grad_clip", "kl_coef", "clip_eps_low", "clip_eps_high"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ConfigError(f"train.{name} = {v!r}: must be a number >= 0")
        if self.clip_eps_low >= 1:
            raise ConfigError(f"train.clip_eps_low = {self.clip_eps_low!r}: must be < 1")
        self._check_algorithm()
        if self.loss_norm not in LOSS_NORMS:
            raise ConfigError(f"train.loss_norm = {self.loss_norm!r}: use one of {', '.join(LOSS_NORMS)}")
        _non_negative_int("train.loss_budget_tokens", self.loss_budget_tokens, " (0: rollout.max_tokens)")
        _positive_int("train.mini_batches", self.mini_batches)
        _positive_int("train.tokens_per_micro_batch", self.tokens_per_micro_batch)
        if self.stream and self.mini_batches != 1:
            raise ConfigError(
                f"train.mini_batches = {self.mini_batches} with train.stream = true: the stream "
                "trainer takes exactly one deferred optimizer step per RL step; set mini_batches: 1 "
                "or stream: false"
            )

    def _check_algorithm(self) -> None:
        """The objective, the advantage estimator and their knobs (docs/training.md)."""
        if self.objective not in ("auto", *OBJECTIVE_NAMES):
            raise ConfigError(
                f"train.objective = {self.objective!r}: unknown objective; known: auto, "
                f"{', '.join(OBJECTIVE_NAMES)}"
            )
        if self.advantage not in ("auto", *ADVANTAGE_ESTIMATORS):
            raise ConfigError(
                f"train.advantage = {self.advantage!r}: unknown advantage estimator; known: auto, "
                f"{', '.join(ADVANTAGE_ESTIMATORS)}"
            )
        if self.advantage not in ("auto", "dr_grpo") and not self.scale_advantages:
            raise ConfigError(
                f"train.scale_advantages = false with train.advantage = {self.advantage!r}: "
                "scale_advantages only picks between grpo and dr_grpo under advantage: auto; "
                "set advantage: dr_grpo or drop scale_advantages"
            )
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ConfigError(
                f"train.kl_estimator = {self.kl_estimator!r}: use one of {', '.join(KL_ESTIMATORS)}"
            )
        for name in ("reward_kl_coef", "overlong_penalty"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ConfigError(f"train.{name} = {v!r}: must be a number >= 0")
        if self.reward_kl_coef > 0 and self.advantage_estimator != "reinforce_pp":
            raise ConfigError(
                f"train.reward_kl_coef = {self.reward_kl_coef}: only advantage: reinforce_pp puts a KL in "
                f"the reward (advantage is {self.advantage_estimator!r}); use kl_coef for a KL loss term"
            )
        if (
            isinstance(self.overlong_buffer, bool)
            or not isinstance(self.overlong_buffer, int)
            or self.overlong_buffer < 0
        ):
            raise ConfigError(
                f"train.overlong_buffer = {self.overlong_buffer!r}: must be an integer >= 0 "
                "(tokens; 0 disables)"
            )

    @property
    def advantage_estimator(self) -> str:
        """``advantage`` with ``auto`` resolved (grpo, or dr_grpo without scale_advantages)."""
        if self.advantage != "auto":
            return self.advantage
        return "grpo" if self.scale_advantages else "dr_grpo"


@dataclass(frozen=True)
class TaskShapeConfig:
    """How long the synthetic math prompts' solutions are (``synthetic_math``, and the math and
    judge prompts of ``mixed``): steps log-normal (``median_steps``, ``sigma``), a
    ``hard_fraction`` log-uniform in ``[hard_min_steps, max_steps]``; ~10 tokens per step. The
    defaults are short; the embedded default sets a long tail (docs/tasks.md)."""

    median_steps: float = 4.0
    sigma: float = 1.0
    max_steps: int = 90
    hard_fraction: float = 0.0
    hard_min_steps: int = 1
    verbose: bool = False  # each step written out in full, "k/n: x+a=s, mod 10=y" (~23 tokens a line)

    def __post_init__(self) -> None:
        _positive_int("task.shape.max_steps", self.max_steps)
        _positive_int("task.shape.hard_min_steps", self.hard_min_steps)
        if not 1 <= self.median_steps <= self.max_steps:
            raise ConfigError(
                f"task.shape.median_steps = {self.median_steps}: must be in [1, max_steps = {self.max_steps}]"
            )
        if not self.sigma >= 0:
            raise ConfigError(f"task.shape.sigma = {self.sigma}: must be >= 0")
        if not 0.0 <= self.hard_fraction <= 1.0:
            raise ConfigError(f"task.shape.hard_fraction = {self.hard_fraction}: must be in [0, 1]")
        if self.hard_min_steps > self.max_steps:
            raise ConfigError(
                f"task.shape.hard_min_steps = {self.hard_min_steps}: must be <= max_steps = {self.max_steps}"
            )

    def items(self) -> tuple[tuple[str, float | bool], ...]:
        """As hashable (name, value) pairs, for the task loaders."""
        return tuple((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))


@dataclass(frozen=True)
class TaskConfig:
    # synthetic_math | humaneval | path/to/file.jsonl[.gz] (on the controller's pod) |
    # s3://<store.bucket>/<key>.jsonl[.gz]; a file reaches the services through the store
    name: str = "synthetic_math"
    num_examples: int = 4000  # synthetic tasks only
    val_size: int = 400  # held-out examples (seeded split)
    seed: int = 0
    shape: TaskShapeConfig = dataclasses.field(default_factory=TaskShapeConfig)

    def __post_init__(self) -> None:
        _positive_int("task.num_examples", self.num_examples)
        _positive_int("task.val_size", self.val_size)
        scheme_ok = self.name.startswith(("s3://", FILE_SCHEME))
        if "://" in self.name and (not scheme_ok or not self.name.endswith((".jsonl", ".jsonl.gz"))):
            raise ConfigError(
                f"task.name = {self.name!r}: a dataset URI is s3://<store.bucket>/<key>.jsonl (or .jsonl.gz) "
                "in the experiment's store"
            )
        if (
            "://" not in self.name
            and self.name not in BUILTIN_TASKS
            and not self.name.endswith(FILE_SUFFIXES)
        ):
            close = difflib.get_close_matches(self.name, BUILTIN_TASKS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"task.name = {self.name!r}: not a task{hint}; choose one of {', '.join(BUILTIN_TASKS)}, or "
                f"give a dataset file ending in {' or '.join(FILE_SUFFIXES)} (format: docs/tasks.md)"
            )


@dataclass(frozen=True)
class ModelConfig:
    preset: str = "tiny"  # tiny-model preset to build and warm up (ignored when model_dir is set)
    warmup_steps: int = 200  # supervised warm-up steps on the synthetic task (0: none)
    # synthetic math: the share of warm-up solutions with one wrong step (a sloppy teacher), which
    # leaves the model an error rate the verifier's reward can train away (configs/learning.yaml)
    warmup_slip_rate: float = 0.0
    model_dir: str = ""  # start from this Hugging Face directory instead

    def __post_init__(self) -> None:
        if (
            isinstance(self.warmup_steps, bool)
            or not isinstance(self.warmup_steps, int)
            or self.warmup_steps < 0
        ):
            raise ConfigError(f"model.warmup_steps = {self.warmup_steps!r}: must be an integer >= 0")
        if isinstance(self.warmup_slip_rate, bool) or not (
            isinstance(self.warmup_slip_rate, int | float) and 0.0 <= self.warmup_slip_rate < 1.0
        ):
            raise ConfigError(
                f"model.warmup_slip_rate = {self.warmup_slip_rate!r}: must be a number in [0, 1) "
                "(the share of warm-up solutions with one wrong step)"
            )


@dataclass(frozen=True)
class SandboxConfig:
    """Code rewards: the sandbox's limits and the adaptive timeout (RollPacker section 4.3)."""

    workers: int = 2  # sandbox runs at a time
    adaptive: bool = True  # false: every test case gets t_max_s (the fixed-timeout baseline)
    lam: float = 1.5  # timeout = min(max(t_min_s, lam * T_anchor), t_max_s)
    t_min_s: float = 2.0
    t_max_s: float = 30.0
    memory_mb: int = 512  # address-space limit of the jailed program
    max_procs: int = 32  # processes the program may start
    # time each example's reference solution (where the task has one) once, as its cases' first
    # anchors: doomed responses are cut before any correct sibling exists (docs/sandbox.md)
    reference_anchors: bool = True

    def __post_init__(self) -> None:
        _positive_int("reward.sandbox.workers", self.workers)
        _positive_int("reward.sandbox.memory_mb", self.memory_mb)
        _positive_int("reward.sandbox.max_procs", self.max_procs)
        self.timeouts()  # validates lam / t_min_s / t_max_s

    def timeouts(self) -> TimeoutConfig:
        return TimeoutConfig(adaptive=self.adaptive, lam=self.lam, t_min_s=self.t_min_s, t_max_s=self.t_max_s)


# a judge model in the store: s3://<bucket>/<key prefix> or file://<path>, never just the bucket
_STORE_URI = re.compile(r"s3://[^/\s]+/(?=\S*[^/\s])\S*|file://(?=\S*[^/\s])\S*")


@dataclass(frozen=True)
class JudgeRewardConfig:
    """Judge rewards: the colocated LLM judge and its layer-wise offload (docs/judge.md)."""

    # the judge model: a Hugging Face directory on the judge's pod, or a URI in the experiment's
    # store (s3://<store.bucket>/<prefix>/, file://... for a file store) that the judge downloads;
    # "" = the toy judge: the tiny `preset` warmed up on the pod (refused on a GPU config)
    model: str = ""
    device: str = "auto"  # auto (cuda when a GPU is visible) | cpu | cuda | cuda:N
    dtype: str = "float32"  # the judge's weights on its device: float32 | bfloat16 | float16
    preset: str = "micro"  # tiny-model preset the toy judge is warmed up from
    warmup_steps: int = 150  # supervised judge warm-up steps (cached)
    max_batch: int = 16  # requests scored together at most
    resident_layers: int = -1  # -1: every layer resident; k >= 0: stream all but the first k
    memory_budget_mb: float = 0.0  # > 0: choose k per batch from this budget instead

    def __post_init__(self) -> None:
        check_device_setting("reward.judge.device", self.device)
        if self.dtype not in JUDGE_DTYPES:
            raise ConfigError(f"reward.judge.dtype = {self.dtype!r}: use one of {', '.join(JUDGE_DTYPES)}")
        m = self.model
        if not isinstance(m, str) or m != m.strip() or ("://" in m and not _STORE_URI.fullmatch(m)):
            raise ConfigError(
                f"reward.judge.model = {m!r}: give a Hugging Face directory on the judge's pod, or a URI in "
                "the experiment's store with a prefix (s3://<bucket>/<prefix>/, file://<root>/<prefix>)"
            )
        _positive_int("reward.judge.warmup_steps", self.warmup_steps)
        _positive_int("reward.judge.max_batch", self.max_batch)
        if isinstance(self.resident_layers, bool) or self.resident_layers < -1:
            raise ConfigError(
                f"reward.judge.resident_layers = {self.resident_layers!r}: -1 (all resident) or k >= 0"
            )
        if not (math.isfinite(self.memory_budget_mb) and self.memory_budget_mb >= 0):
            raise ConfigError(f"reward.judge.memory_budget_mb = {self.memory_budget_mb!r}: must be >= 0")
        if self.memory_budget_mb > 0 and self.resident_layers >= 0:
            raise ConfigError(
                "reward.judge: set resident_layers (a fixed k) or memory_budget_mb (k per batch), not both"
            )


@dataclass(frozen=True)
class RewardConfig:
    timeout_s: float = 5.0  # per-sample limit for the math checker
    workers: int = 1  # math reward worker processes
    sandbox: SandboxConfig = dataclasses.field(default_factory=SandboxConfig)
    judge: JudgeRewardConfig = dataclasses.field(default_factory=JudgeRewardConfig)
    # After each step, score the step's responses again, all after rollout, and log that
    # synchronous reward stage's seconds (reward/sync_stage_s) beside the async tail (reward/tail_s).
    measure_sync_stage: bool = False
    # Score each response when it finishes (true) or each group when it is final (false); per
    # response leaves only the last response's scoring after rollout ends, at the cost of scoring
    # responses of prompts a short round then defers (reward/wasted).
    per_response: bool = True

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ConfigError(f"reward.timeout_s = {self.timeout_s!r}: must be > 0")
        _positive_int("reward.workers", self.workers)


@dataclass(frozen=True)
class ValidationConfig:
    every: int = 20  # validate every N steps (and before the first and after the last)
    temperature: float = 1.0  # 0: greedy
    max_tokens: int = 1024
    split: str = "held_out"  # held_out: the task's validation split; train: the prompts RL trains on
    samples: int = 1  # responses per prompt (the accuracy is their mean)

    def __post_init__(self) -> None:
        _positive_int("validation.every", self.every)
        _positive_int("validation.max_tokens", self.max_tokens)
        _positive_int("validation.samples", self.samples)
        if self.split not in ("held_out", "train"):
            raise ConfigError(f"validation.split = {self.split!r}: use 'held_out' or 'train'")
        if self.temperature < 0:
            raise ConfigError(f"validation.temperature = {self.temperature!r}: must be >= 0")


@dataclass(frozen=True)
class CheckpointConfig:
    """How often the trainer's state goes to the object store (docs/training.md, "Checkpoint
    cadence"). A step between checkpoints commits its state document with its weights only in the
    trainer's and the engine's memory; a failure that loses them rolls the arm back to the last
    checkpointed step's state, and the steps after it (their prompts included) run again."""

    every: int = 1  # a checkpoint after every N-th step (and after the last step)
    export_every: int = 0  # Hugging Face weights under <experiment>/<arm>/export/ every N steps (0: never)
    # committed step checkpoints the store keeps per arm after each commit (the newest stored ones;
    # the one the committed state points at, or rolls back to, is always among them); the start
    # model is kept besides. The store holds keep + 1 while a step writes its own (core/sizing.py,
    # docs/operations.md "Volumes and sizes per model").
    keep: int = 2

    def __post_init__(self) -> None:
        _positive_int("checkpoint.every", self.every)
        _positive_int("checkpoint.keep", self.keep)
        if (
            isinstance(self.export_every, bool)
            or not isinstance(self.export_every, int)
            or self.export_every < 0
        ):
            raise ConfigError(
                f"checkpoint.export_every = {self.export_every!r}: a whole number of steps, 0 for no export"
            )

    def due(self, step: int, steps: int) -> bool:
        """Whether step ``step`` (0-based) of a run of ``steps`` writes a checkpoint: every
        ``every``-th step and the last one."""
        return (step + 1) % self.every == 0 or step == steps - 1

    def export_due(self, step: int) -> bool:
        return self.export_every > 0 and (step + 1) % self.export_every == 0


@dataclass(frozen=True)
class StoreConfig:
    """The object store the controller keeps state, checkpoints and profiles in.

    ``endpoint`` is either ``host:port`` of an S3 server (MinIO in a cluster, SeaweedFS locally;
    the default) or ``file://<path>`` for a directory on this machine (``file:///abs/path``;
    ``file://rel/path`` resolves against the current directory: the part after ``file://`` is a
    path, never a host). ``bucket``, ``secure``, ``region`` and the credential variables apply to
    S3 only. Credentials never live in the config: they come from the environment variables named
    here."""

    endpoint: str = "127.0.0.1:8333"  # host:port, no scheme; or file://<path>
    bucket: str = "rollpacker"
    secure: bool = False  # https
    region: str = ""
    access_key_env: str = "ROLLPACKER_S3_ACCESS_KEY"
    secret_key_env: str = "ROLLPACKER_S3_SECRET_KEY"
    # how long a stage rides out an S3 server that does not answer (retrying with backoff) before
    # it fails; 0 = fail at the first refusal (store/patient.py). The startup check never waits.
    outage_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 <= self.outage_s <= 3600:
            raise ConfigError(
                f"store.outage_s = {self.outage_s!r}: seconds in [0, 3600] (0: no retries while it is down)"
            )
        if self.endpoint.startswith(FILE_SCHEME):
            path = self.file_root
            if not path or not path.strip() or "\0" in path:
                raise ConfigError(
                    f"store.endpoint = {self.endpoint!r}: give the store's directory after file:// "
                    "(e.g. file:///data/rollpacker-store, or file://build/store relative to the current "
                    "directory)"
                )
        elif not self.endpoint or "://" in self.endpoint or "/" in self.endpoint:
            raise ConfigError(
                f"store.endpoint = {self.endpoint!r}: use host:port without a scheme or path "
                "(e.g. 127.0.0.1:8333; set store.secure: true for https)"
            )
        if not _BUCKET.fullmatch(self.bucket):
            raise ConfigError(
                f"store.bucket = {self.bucket!r}: an S3 bucket name is 3-63 lowercase letters, digits, "
                "dots or hyphens"
            )

    @property
    def file_root(self) -> str | None:
        """The directory of a ``file://`` endpoint as written (relative or absolute), or None for
        an S3 endpoint."""
        if not self.endpoint.startswith(FILE_SCHEME):
            return None
        return self.endpoint[len(FILE_SCHEME) :]


# store.endpoint of a filesystem store: file://<path> (the path after it, absolute or relative)
FILE_SCHEME = "file://"


class ArmSchedule(enum.Enum):
    """How an experiment's arms share the cluster (``services.arms``; docs/operations.md, "Placement")."""

    SEQUENTIAL = "sequential"  # one arm after another, each with every GPU of the cluster
    DISJOINT = "disjoint"  # all arms at once, each on its own GPUs (the cluster must hold them all)


@dataclass(frozen=True)
class ClusterGpus:
    """The GPUs of each RayCluster worker group that holds them (``services.gpus``): replicas x
    ``nvidia.com/gpu`` of the group's pods (the judge group: its MPS shares, one Ray GPU each). All 0
    (the default): a machine without GPUs, where no service asks Ray for a GPU. With any set, the
    rollout service, a CUDA judge and a CUDA torch trainer ask for the GPUs they use, and ``rollpacker
    submit`` refuses arms the groups cannot hold before any run starts (core/placement.py)."""

    rollout: int = 0
    training: int = 0
    judge: int = 0

    def __post_init__(self) -> None:
        for name in ("rollout", "training", "judge"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(
                    f"services.gpus.{name} = {v!r}: the {name} worker group's GPU count, an integer >= 0"
                )

    @property
    def declared(self) -> bool:
        return bool(self.rollout or self.training or self.judge)


@dataclass(frozen=True)
class ServicesConfig:
    """Where the long-lived services (Ray actors: engine, rewards, judge, trainer) run."""

    ray_address: str = ""  # "" = $RAY_ADDRESS, else the local head `rollpacker up` started
    namespace: str = "rollpacker"  # Ray namespace of the named, detached actors
    call_timeout_s: float = 1800.0  # longest a stage waits for one service call
    # on a cluster: each actor asks for one unit of its worker group's custom resource
    # (rollpacker_rollout / _training / _judge / _sandbox, manifests/base/ray/raycluster.yaml), so
    # Ray places it on its role's pods; off on one machine, whose Ray head has no such resources
    role_resources: bool = False
    # sequential: the arms run one after another (`rollpacker submit` starts the next arm's run when
    # the last one ended); disjoint: at once, each arm on its own GPUs (docs/operations.md, "Placement")
    arms: ArmSchedule = ArmSchedule.SEQUENTIAL
    gpus: ClusterGpus = dataclasses.field(default_factory=ClusterGpus)
    # the rollout pods' /dev/shm in GiB (the memory-backed emptyDir of the manifests' rollout group;
    # a test keeps the gpu overlay's equal): the collective push's kept copy must fit it
    # (core/sizing.py, ``shm_refusal``); 0 = not declared (one machine), nothing checked
    rollout_shm_gib: int = 0

    def __post_init__(self) -> None:
        if not self.namespace:
            raise ConfigError("services.namespace: must be a non-empty Ray namespace")
        v = self.rollout_shm_gib
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(
                f"services.rollout_shm_gib = {v!r}: the rollout pods' /dev/shm in GiB, an integer >= 0 "
                "(0: not declared)"
            )
        if not self.call_timeout_s > 0:
            raise ConfigError(f"services.call_timeout_s = {self.call_timeout_s!r}: must be > 0")


_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


_ARM_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,39}")


@dataclass(frozen=True)
class ArmConfig:
    """One arm of an experiment: a rollout policy, its variant, and the name its MLflow run, state
    prefix and services go by. In YAML an arm is a policy name (``tail_batching``) or a mapping
    (``{name: sorted_partial, policy: sorted, mode: partial}``, ``{name: tb_one_off, policy:
    tail_batching, one_off: true}``)."""

    name: str
    policy: PolicyName
    mode: SortedMode | None = None  # sorted only: overrides rollout.sorted.mode
    one_off: bool | None = None  # overrides rollout.one_off

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _ARM_NAME.fullmatch(self.name):
            raise ConfigError(
                f"arms: name {self.name!r}: 1-40 lowercase letters, digits, '_' or '-', starting with "
                "a letter or digit (it names the MLflow run, the state prefix and the Ray actors)"
            )
        if self.mode is not None and self.policy is not PolicyName.SORTED:
            raise ConfigError(
                f"arms: {self.name!r} sets mode {self.mode.value!r}, but only the sorted policy has modes"
            )

    @classmethod
    def from_name(cls, value: str, where: str = "arms") -> ArmConfig:
        try:
            return cls(name=value, policy=PolicyName(value))
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in PolicyName)
            raise ConfigError(
                f"{where} = {value!r}: an arm is a policy name ({allowed}) or a mapping "
                "{name, policy, mode, one_off}"
            ) from None

    def apply(self, rollout: RolloutConfig) -> RolloutConfig:
        """``rollout`` with this arm's policy and variant."""
        changes: dict[str, Any] = {"policy": self.policy}
        if self.mode is not None:
            changes["sorted"] = dataclasses.replace(rollout.sorted, mode=self.mode)
        if self.one_off is not None:
            changes["one_off"] = self.one_off
        return dataclasses.replace(rollout, **changes)


def _arms(*names: str) -> tuple[ArmConfig, ...]:
    return tuple(ArmConfig.from_name(n) for n in names)


DEFAULT_ARM_NAMES = ("sync", "tail_batching")  # the arms of a config that names none
DEFAULT_ARMS = _arms(*DEFAULT_ARM_NAMES)


@dataclass(frozen=True)
class ExperimentConfig:
    """``rollpacker train --config FILE``: one YAML document with these sections."""

    experiment: str = "rollpacker-local"
    run_name: str = ""
    seed: int = 0
    steps: int = 60
    out_dir: str = "build/runs"
    tracking_uri: str = "sqlite:///build/mlflow.db"
    task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    train: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    validation: ValidationConfig = dataclasses.field(default_factory=ValidationConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    # The pipeline (``rollpacker run``): the arms compared in one MLflow experiment, one run each,
    # the state store and the services.
    arms: tuple[ArmConfig, ...] = DEFAULT_ARMS
    store: StoreConfig = dataclasses.field(default_factory=StoreConfig)
    services: ServicesConfig = dataclasses.field(default_factory=ServicesConfig)
    planner: PlannerConfig = dataclasses.field(default_factory=PlannerConfig)

    def arm(self, name: str) -> ArmConfig:
        for a in self.arms:
            if a.name == name:
                return a
        raise ConfigError(f"arm {name!r} is not in this config's arms {self.arm_names}")

    @property
    def arm_names(self) -> list[str]:
        return [a.name for a in self.arms]

    def for_arm(self, name: str) -> ExperimentConfig:
        """This config as arm ``name`` runs it: its policy and variant applied to ``rollout``, and
        ``train.objective: auto`` and ``train.loss_budget_tokens: 0`` resolved."""
        arm = self.arm(name)
        rollout = arm.apply(self.rollout)
        train = self.train
        if train.loss_budget_tokens == 0:  # the constant normaliser's budget: the generation budget
            train = dataclasses.replace(train, loss_budget_tokens=rollout.max_tokens)
        if train.objective == "auto":  # stale tokens get decoupled PPO's behaviour weight
            decoupled = (
                rollout.policy is PolicyName.PARTIAL
                or rollout.one_off
                or (rollout.policy is PolicyName.SORTED and rollout.sorted.mode is SortedMode.PARTIAL)
            )
            train = dataclasses.replace(train, objective="decoupled_ppo" if decoupled else "ppo")
        return dataclasses.replace(self, rollout=rollout, train=train)

    def _check_arms_rollout(self) -> None:
        """Each arm's rollout (its policy and variant applied) is valid; an error names the arm, and
        the default arm list when the config names no arms (the user set no policy then)."""
        for a in self.arms:
            try:
                a.apply(self.rollout)
            except ConfigError as e:
                default = self.arms == DEFAULT_ARMS
                names = ", ".join(DEFAULT_ARM_NAMES)
                where = (
                    f"arms: the config names no arms, so the default arm list ({names}) runs, and its "
                    f"arm {a.name!r} sets rollout.policy = {a.policy.value!r}"
                    if default
                    else f"arms: arm {a.name!r} sets rollout.policy = {a.policy.value!r}"
                )
                fix = (
                    "name the arms to run (e.g. `arms: [tail_batching]`), each able to run this rollout "
                    "section"
                    if default
                    else f"drop arm {a.name!r} or change the rollout section"
                )
                raise ConfigError(f"{where}; {e}. So {fix}") from None

    def shaping(self) -> RewardShaping:
        """How rewards become advantages in this config (the estimator, DAPO's overlong shaping)."""
        t = self.train
        return RewardShaping(
            estimator=t.advantage_estimator,
            max_tokens=self.rollout.max_tokens,
            overlong_buffer=t.overlong_buffer,
            overlong_penalty=t.overlong_penalty,
            overlong_filter=t.overlong_filter,
        )

    def __post_init__(self) -> None:
        _positive_int("steps", self.steps)
        names = [a.name for a in self.arms]
        if not names or len(set(names)) != len(names):
            raise ConfigError(f"arms = {names}: give each arm a distinct name, at least one arm")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", self.experiment or ""):
            raise ConfigError(
                f"experiment = {self.experiment!r}: letters, digits, '.', '_' and '-' only "
                "(it names the MLflow experiment and the object-store prefix)"
            )
        if not self.experiment:
            raise ConfigError("experiment: must be a non-empty name (the MLflow experiment)")
        if self.rollout.temperature <= 0:
            raise ConfigError(
                f"rollout.temperature = {self.rollout.temperature!r}: RL needs sampled responses (> 0)"
            )
        if self.train.overlong_buffer >= self.rollout.max_tokens:
            raise ConfigError(
                f"train.overlong_buffer = {self.train.overlong_buffer}: must be smaller than "
                f"rollout.max_tokens = {self.rollout.max_tokens} (the penalty ramps over the last "
                "overlong_buffer tokens before the max length; DAPO: max 20480, buffer 4096)"
            )
        if 0 < self.train.loss_budget_tokens < self.rollout.max_tokens:
            raise ConfigError(
                f"train.loss_budget_tokens = {self.train.loss_budget_tokens}: must be 0 (rollout.max_tokens) "
                f"or at least rollout.max_tokens = {self.rollout.max_tokens}, the longest response the "
                "constant normaliser divides"
            )
        self._check_arms_rollout()
        self._check_trainer_dtype()
        if self.rollout.scale_down.enabled and (self.planner.devices < 2 or not self.train.stream):
            raise ConfigError(
                "rollout.scale_down.enabled needs engine replicas to free and a stream trainer to give "
                f"their devices to: set planner.devices >= 2 (it is {self.planner.devices}) and "
                f"train.stream: true (it is {str(self.train.stream).lower()})"
            )
        self._check_simulated_engine()
        j = self.reward.judge
        check_judge(  # the toy judge on a config that declares GPUs; a judge model outside the store
            model=j.model,
            preset=j.preset,
            task=self.task.name,
            declared=self.gpu_declarations,
            bucket=self.store.bucket,
            file_store=self.store.file_root,
        )

    @property
    def gpu_declarations(self) -> tuple[str, ...]:
        """The settings that put work on a GPU, as ``key: value`` (empty: a CPU config; core/devices.py)."""
        t = self.train
        return gpu_declarations(
            backend=t.backend,
            megatron_gpus_per_rank=t.megatron.gpus_per_rank,
            train_device=t.device,
            judge_device=self.reward.judge.device,
        )

    def _check_simulated_engine(self) -> None:
        """``engine.kind: simulated`` runs the pipeline for real around a stand-in engine on this
        machine: refused where it would pass for a real run (a config that declares GPUs, a cuda
        engine) or where a check compares its samples with the model (the weight-sync probe), and
        where the stand-in does not reach (layouts, the collective push)."""
        if self.engine.kind != "simulated":
            return
        why = []
        if self.gpu_declarations or self.engine.device == "cuda":
            on = ", ".join(
                (*self.gpu_declarations, *(("engine.device: cuda",) * (self.engine.device == "cuda")))
            )
            why.append(f"the config runs on GPUs ({on}): a cluster run needs the real engine")
        if self.planner.devices:
            why.append(f"planner.devices = {self.planner.devices}: it has no engine layouts (set 0)")
        if self.train.weight_sync == "collective":
            why.append("train.weight_sync: collective needs a vLLM engine (use object_store)")
        if self.engine.speculation.enabled:
            why.append(
                "engine.speculation.enabled: it drafts nothing (set engine.speculation.enabled: false)"
            )
        if self.train.sync_probe.enabled:
            why.append(
                "train.sync_probe.enabled: the probe compares the engine's logprobs with the model's, "
                "which a simulated engine does not sample from (set train.sync_probe.enabled: false)"
            )
        if why:
            raise ConfigError(
                "engine.kind: simulated (a stand-in engine for dry runs): "
                + "; ".join(why)
                + "; or use engine.kind: vllm"
            )

    def _check_trainer_dtype(self) -> None:
        """On GPUs the trainer must train in the engine's dtype (the megatron gang on GPU ranks, the
        torch backend on a ``cuda`` device). A float32 trainer against a bf16 engine (or the
        reverse) disagrees with the engine's logprobs by rounding before any update: the PPO ratio
        is not 1 at step 0 and clipping acts on that noise in every step. Refused rather than
        warned about: a warning in a pod's log is read after the GPU hours are spent, and the fix
        is one line."""
        t, e = self.train, self.engine
        if t.backend == "megatron" and t.megatron.gpus_per_rank > 0:
            key, dtype, where = "train.megatron.dtype", t.megatron.dtype, "train.megatron.gpus_per_rank: 1"
        elif t.backend == "torch" and is_cuda(t.device):
            key, dtype, where = "train.dtype", t.dtype, f"train.device: {t.device}"
        else:
            return
        if dtype == e.dtype:
            return
        fix = "bfloat16" if e.dtype != "float32" else "float32"
        raise ConfigError(
            f"{key} = {dtype!r} with engine.dtype = {e.dtype!r} on GPUs ({where}): the trainer's "
            "logprobs differ from the engine's before any update, so the PPO ratio is not 1 from "
            f"step 0; train in the engine's dtype ({key}: {fix}, and engine.dtype: {fix})"
        )


SHIPPED_CONFIGS = Path(__file__).resolve().parents[1] / "configs"
"""The example configs installed with the package (the repository's ``configs/`` links here)."""


def shipped_configs() -> dict[str, Path]:
    """The shipped configs by name (``default``, ``experiment``, ...), each an absolute path."""
    return {p.stem: p for p in sorted(SHIPPED_CONFIGS.glob("*.yaml"))}


def resolve_config(value: str | os.PathLike[str]) -> Path:
    """The absolute path of a ``--config`` value: an existing YAML file, or a shipped config by
    name (``default``, ``default.yaml`` or ``configs/default.yaml``, which work from any directory).
    Anything else raises ``ConfigError`` naming the absolute path and the shipped names."""
    p = Path(value).expanduser()
    if p.is_file():
        return p.resolve()
    shipped = shipped_configs()
    name = p.name.removesuffix(".yaml").removesuffix(".yml")
    if p.parent in (Path("."), Path("configs")) and name in shipped:
        return shipped[name]
    what = "is a directory, not a YAML file" if p.is_dir() else "does not exist"
    raise ConfigError(
        f"config file {p.absolute()} {what}; give a YAML file or a shipped config by name "
        f"({', '.join(shipped)}); `rollpacker config show default > my.yaml` writes one to start from"
    )


def load_config(path: str | Path, overrides: Mapping[str, Any] | None = None) -> ExperimentConfig:
    """Read a YAML experiment config (a path or a shipped name: ``resolve_config``); unknown keys
    are rejected by name."""
    p = resolve_config(path)
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {p}: cannot be read ({e}); check its permissions and encoding") from e
    return config_from_text(text, where=str(p), overrides=overrides)


def config_from_text(
    text: str, where: str = "config", overrides: Mapping[str, Any] | None = None
) -> ExperimentConfig:
    """The experiment config from YAML text (what the pipeline stages receive); ``overrides`` maps
    dotted keys (``rollout.policy``) to values."""
    import yaml

    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: the top level must be a mapping of sections, got {type(data).__name__}")
    apply_overrides(data, overrides or {}, where)
    try:
        return from_mapping(ExperimentConfig, data)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from e


def apply_overrides(data: dict[str, Any], overrides: Mapping[str, Any], where: str = "config") -> None:
    """Set each dotted key (``rollout.policy``) of ``overrides`` in the YAML mapping ``data``."""
    for dotted, value in overrides.items():
        node = data
        *parents, leaf = dotted.split(".")
        for k in parents:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{where}: --set {dotted}: {k!r} is not a section")
        node[leaf] = value


def arm_config(config_text: str, arm: str) -> ExperimentConfig:
    """The experiment config from YAML text, as arm ``arm`` runs it (its policy and variant)."""
    return config_from_text(config_text).for_arm(arm)
