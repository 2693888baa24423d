"""The messages of the collective weight push (``engines/weight_transfer.py``): how the trainer's
sending ranks and the rollout engine's workers meet, and what precedes each bucket on the wire.

A push is a stream of buckets over one process group (NCCL on GPUs, gloo on CPU): for each bucket
the sender broadcasts its ``BucketHeader`` (names, dtypes, shapes, and the digest of its bytes),
then each tensor; a header with ``end`` set closes the push. The receiver allocates each bucket from
its header, receives it, recomputes the digest and loads the bucket only when both agree.

Invariants (tests/core/test_weight_sync.py):
- a header round-trips through JSON exactly, and a malformed one is refused by field name;
- ``bucket_bytes`` is the sum of its tensors' sizes; the closing header holds no tensor;
- a ``TransferGroup`` has one sending rank per trainer source and one rank per engine worker.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rollpacker.core.errors import ConfigError
from rollpacker.core.serde import Message

# bytes of one element of each dtype the push carries (the names torch prints, without "torch.")
DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
TRANSFER_BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class TensorSpec(Message):
    name: str  # the Hugging Face name the engine's load_weights takes
    dtype: str  # a key of DTYPE_BYTES
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(
                f"tensor {self.name}: dtype {self.dtype!r} cannot be pushed ({sorted(DTYPE_BYTES)})"
            )

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class BucketHeader(Message):
    """What precedes a bucket on the wire; ``end`` (no tensors) closes the push."""

    index: int
    tensors: tuple[TensorSpec, ...]
    digest: tuple[int, int]  # ``engines.weight_transfer.digest`` of the tensors, in order
    end: bool = False

    def __post_init__(self) -> None:
        if self.end and self.tensors:
            raise ConfigError(f"bucket {self.index}: the closing header carries no tensor")

    @property
    def bucket_bytes(self) -> int:
        return sum(t.num_bytes for t in self.tensors)


@dataclass(frozen=True)
class TransferGroup(Message):
    """Where the trainer's senders and the engine's workers meet: rank 0 (the sender) hosts the
    rendezvous store at ``address:port``; the engine's workers take ranks ``rank_offset`` on."""

    address: str
    port: int
    world_size: int  # senders + engine workers
    rank_offset: int  # the first engine worker's rank (= the number of senders)
    backend: str  # gloo (CPU tensors) | nccl (CUDA tensors)
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.backend not in TRANSFER_BACKENDS:
            raise ConfigError(f"weight transfer backend {self.backend!r}: use one of {TRANSFER_BACKENDS}")
        if not 0 < self.rank_offset < self.world_size:
            raise ConfigError(
                f"weight transfer group: rank_offset {self.rank_offset} must leave at least one sender "
                f"and one engine worker in a world of {self.world_size}"
            )
        if not (0 < self.port < 65536) or self.timeout_s <= 0:
            raise ConfigError(f"weight transfer group: port {self.port} / timeout_s {self.timeout_s} invalid")
