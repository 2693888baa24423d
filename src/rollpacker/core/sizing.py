"""Checkpoints and copies that fit: the bytes one step checkpoint takes, against the volumes that
hold them, and the collective push's kept copy against the rollout pod's ``/dev/shm``.

Bytes per parameter of one step checkpoint of the megatron backend (docs/operations.md, "Volumes
and sizes per model"):

- megatron's distributed checkpoint with the distributed optimizer: bf16 weights (2) + fp32 main
  weights (4) + Adam's two moments in fp32 (4 + 4) = ``DIST_BYTES_PER_PARAM`` = 14;
- the Hugging Face copy the engines load, bf16 safetensors: ``HF_BYTES_PER_PARAM`` = 2.

Where they go (services/trainer.py, services/rollout.py, stages/commit.py):

- the store (the MinIO volume), per arm, and every arm of an experiment runs at once: the start
  model (HF copy) + ``checkpoint.keep`` committed checkpoints + the one a step writes before its
  commit + one failed attempt's, which stays until the next commit;
- the training pod's local scratch (its ``/tmp``): every rank writes its shard there before it
  uploads and deletes it, the ranks of a pod at once, so the peak is about one whole checkpoint
  (``staged``), and its download cache holds the start model and the checkpoint it restores;
- the rollout pod's ``/tmp``: its download cache holds the start model and one step checkpoint.

Every volume must hold its bytes plus ``HEADROOM`` (file-system overhead, logs, the datasets).

And in memory: the rollout pod's ``/dev/shm`` (the memory-backed emptyDir ``dshm``, declared to the
config as ``services.rollout_shm_gib``) holds the copy the collective push keeps of every pushed
bucket for the layouts that start later (engines/layout_push.py): the model in the push dtype
(``engine.dtype``), once, where engines run in layouts (``planner.devices``) on GPUs and not every
candidate layout stays started (``resident_layouts``: floor(1 / ``engine.gpu_memory_utilization``)).

Invariants:
- ``required`` grows with parameters, ``keep`` and arms, and never asks less than one checkpoint
  of a volume that holds one;
- ``check`` returns one message per volume that is too small, naming the volume, what it holds,
  the bytes needed and the bytes it has; an empty list means every volume fits;
- ``shm_refusal`` refuses exactly the configs that keep a copy the declared ``/dev/shm`` cannot hold
  (plus ``HEADROOM``), naming the model, the ``/dev/shm`` size and what to change; "" otherwise;
- ``parse_quantity`` reads Kubernetes quantities (``20Gi``, ``1.5Ti``, ``500G``, ``1e9``) exactly,
  and refuses anything else with a ``ConfigError``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction

from rollpacker.core.config import ExperimentConfig, _positive_int
from rollpacker.core.errors import ConfigError
from rollpacker.core.latency import layouts_for, resident_layouts

DIST_BYTES_PER_PARAM = 14
HF_BYTES_PER_PARAM = 2
HEADROOM = Fraction(11, 10)  # 10 % on top of the bytes counted
# bytes per element of the weights a push moves: the engine's dtype (engine.dtype)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

_SUFFIX = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
}
_QUANTITY = re.compile(r"([0-9]+(?:\.[0-9]+)?(?:[eE][0-9]+)?)(|k|M|G|T|P|Ki|Mi|Gi|Ti|Pi)")


@dataclass(frozen=True)
class ModelSize:
    """A shipped model size: its name and parameter count (Qwen2.5 family, the paper's)."""

    name: str
    params: int

    def __post_init__(self) -> None:
        _positive_int(f"model spec {self.name!r}: params", self.params)


SHIPPED = (
    ModelSize("Qwen2.5-7B", 7_615_616_512),
    ModelSize("Qwen2.5-14B", 14_770_033_664),
    ModelSize("Qwen2.5-32B", 32_763_876_352),
)


def shipped(name: str) -> ModelSize | None:
    """The shipped size named ``name`` (a model directory's name, e.g. ``Qwen2.5-7B``), or None."""
    return next((s for s in SHIPPED if s.name == name), None)


@dataclass(frozen=True)
class CheckpointPlan:
    """What the bytes depend on besides the model: arms at once, checkpoints kept, staging."""

    arms: int
    keep: int
    staged: bool = True  # a pod's ranks hold their shards locally at once (about one checkpoint)

    def __post_init__(self) -> None:
        _positive_int("sizing: arms", self.arms)
        _positive_int("sizing: keep", self.keep)


@dataclass(frozen=True)
class Need:
    """Bytes (headroom included) each volume must hold."""

    store: int
    training_scratch: int
    rollout_scratch: int


def checkpoint_bytes(spec: ModelSize) -> int:
    """One step checkpoint: the distributed checkpoint and the HF copy."""
    return spec.params * (DIST_BYTES_PER_PARAM + HF_BYTES_PER_PARAM)


def required(spec: ModelSize, layout: CheckpointPlan) -> Need:
    ck, base = checkpoint_bytes(spec), spec.params * HF_BYTES_PER_PARAM
    per_arm = base + (layout.keep + 2) * ck  # kept + the step's own + a failed attempt's
    training = (ck if layout.staged else 0) + base + ck  # staging + the restore cache
    return Need(
        store=_with_headroom(layout.arms * per_arm),
        training_scratch=_with_headroom(training),
        rollout_scratch=_with_headroom(base + ck),
    )


def _with_headroom(n: int) -> int:
    return math.ceil(n * HEADROOM)


@dataclass(frozen=True)
class Volumes:
    """The volumes a deployment gives (bytes), with where each is set, for the messages."""

    store: tuple[int, str]
    training_scratch: tuple[int, str]
    rollout_scratch: tuple[int, str]


def check(spec: ModelSize, layout: CheckpointPlan, volumes: Volumes) -> list[str]:
    """One message per volume too small for ``spec`` under ``layout``."""
    need = required(spec, layout)
    ck = checkpoint_bytes(spec)
    holds = {
        "store": f"{layout.arms} arm(s) x (start model + {layout.keep + 2} checkpoints of {gib(ck)})",
        "training_scratch": f"a staged checkpoint and the restore cache, {gib(ck)} each"
        if layout.staged
        else f"the restore cache (start model + {gib(ck)})",
        "rollout_scratch": f"the download cache (start model + {gib(ck)})",
    }
    out = []
    for name, what in holds.items():
        have, where = getattr(volumes, name)
        want = getattr(need, name)
        if have < want:
            out.append(
                f"{spec.name}: {where} is {gib(have)}, needs {gib(want)} for {what} (+10 %): set it to at "
                f"least {math.ceil(want / 2**30)}Gi"
            )
    return out


def layouts_at_once(cfg: ExperimentConfig) -> tuple[int, int]:
    """The rollout engines' candidate layouts and how many of them stay started at once (0, 0
    without layouts). GPUs: ``engine.device: cuda``, or ``auto`` with rollout GPUs declared
    (``services.gpus.rollout``); on CPU every layout stays started."""
    p = cfg.planner
    if not p.devices:
        return 0, 0
    n = sum(1 for lay in layouts_for(p.devices, p.max_tp) if lay.tp >= p.min_tp)
    e = cfg.engine
    gpus = e.device == "cuda" or (e.device == "auto" and cfg.services.gpus.rollout > 0)
    return n, resident_layouts("cuda" if gpus else "cpu", e.gpu_memory_utilization, n)


def kept_copy_bytes(params: int, dtype: str) -> int:
    """The collective push's kept copy: every parameter in the push dtype."""
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"engine.dtype = {dtype!r}: use one of {', '.join(DTYPE_BYTES)}")
    return params * DTYPE_BYTES[dtype]


def shm_refusal(cfg: ExperimentConfig, params: int, model: str) -> str:
    """Why the rollout pods' ``/dev/shm`` cannot hold the collective push's kept copy of a model of
    ``params`` parameters (``model``: its name in the message); "" when it can, when no copy is kept
    or when ``services.rollout_shm_gib`` is not declared."""
    shm = cfg.services.rollout_shm_gib
    candidates, resident = layouts_at_once(cfg)
    if not shm or cfg.train.weight_sync != "collective" or resident >= candidates:
        return ""
    need, have = _with_headroom(kept_copy_bytes(params, cfg.engine.dtype)), shm * 2**30
    if have >= need:
        return ""
    return (
        f"{model}: the rollout pods' /dev/shm (services.rollout_shm_gib = {shm}) is {gib(have)}, needs "
        f"{gib(need)} for the copy the collective push keeps for layouts started later ({params:,} "
        f"parameters in {cfg.engine.dtype}, +10 %; {resident} of {candidates} layouts stay started at "
        f"engine.gpu_memory_utilization = {cfg.engine.gpu_memory_utilization}): give the rollout group a "
        f"larger dshm volume (sizeLimit and services.rollout_shm_gib >= {math.ceil(need / 2**30)}), use "
        "fewer layouts (planner.min_tp..max_tp) or set planner.devices so that every layout stays "
        "started (or 0: one engine), or train.weight_sync: object_store"
    )


def gib(n: int) -> str:
    """``n`` bytes in GiB, rounded up (a size to provision)."""
    return f"{math.ceil(n / 2**30)} GiB"


def parse_quantity(text: str | int) -> int:
    """Bytes of a Kubernetes quantity (``20Gi``, ``500G``, ``1.5Ti``), rounded up."""
    m = _QUANTITY.fullmatch(str(text).strip())
    if m is None:
        raise ConfigError(f"{text!r} is not a Kubernetes storage quantity; write e.g. 20Gi or 500G")
    return math.ceil(Fraction(m.group(1)) * _SUFFIX[m.group(2)])
