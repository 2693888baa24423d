"""The messages of the collective weight push (``engines/weight_transfer.py``): how the trainer's
sending ranks and the rollout engine's workers meet, and what precedes each bucket on the wire.

A push is a stream of buckets from each sender (NCCL on GPUs, gloo on CPU): for each bucket the
sender broadcasts its ``BucketHeader`` (names, dtypes, shapes, and the digest of its bytes), then
each tensor; a header with ``end`` set closes that sender's stream. The receiver allocates each
bucket from its header, receives it, recomputes the digest and loads the bucket only when both agree.

There is one sender per pipeline stage of the trainer (its own stage's tensors) and one rank per
engine worker, of every engine that serves (every replica of every started layout). Each sender
broadcasts over a group of its own with every engine worker (``sender_group``), so the stages send
side by side and no sender receives another stage's tensors; a worker receives the senders'
streams in stage order.

Invariants (tests/core/test_weight_sync.py):
- a header round-trips through JSON exactly, and a malformed one is refused by field name;
- ``bucket_bytes`` is the sum of its tensors' sizes; the closing header holds no tensor;
- a ``TransferGroup`` has one sending rank per pipeline stage (ranks ``0 .. senders - 1``) and one
  rank per engine worker after them; an engine's workers start at its ``rank_offset``;
- ``sender_group`` gives every rank of the group exactly one rank in each sender's group (the
  sender 0, the workers ``1 ..``), and refuses a sender for another sender's group.
"""

from __future__ import annotations

import dataclasses
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
    """Where the trainer's senders and the engines' workers meet: rank 0 (the first stage's
    sender) hosts the rendezvous store at ``address:port``; ranks ``0 .. senders - 1`` send (one per
    pipeline stage), the engines' workers come after them. The copy an engine gets names its own
    first worker's rank (``rank_offset``; ``with_offset``)."""

    address: str
    port: int
    world_size: int  # senders + every engine's workers
    rank_offset: int  # the first rank of the engine this copy is for (the first worker: senders)
    backend: str  # gloo (CPU tensors) | nccl (CUDA tensors)
    timeout_s: float = 600.0
    senders: int = 1  # one per pipeline stage of the trainer

    @property
    def workers(self) -> int:
        """Every engine worker of the group."""
        return self.world_size - self.senders

    def with_offset(self, rank_offset: int) -> TransferGroup:
        """The copy for an engine whose first worker is rank ``rank_offset``."""
        return dataclasses.replace(self, rank_offset=rank_offset)

    def sender_group(self, sender: int, rank: int) -> tuple[str, int, int]:
        """``rank``'s place in sender ``sender``'s group: (store prefix, rank in it, its size). The
        sender is rank 0 there, every engine worker follows (worker ``w`` of the group: ``1 + w``)."""
        if not 0 <= sender < self.senders or not 0 <= rank < self.world_size:
            raise ConfigError(
                f"weight transfer group: sender {sender} / rank {rank} outside {self.senders} senders "
                f"and a world of {self.world_size}"
            )
        if rank < self.senders and rank != sender:
            raise ConfigError(f"weight transfer group: sender {rank} is no member of sender {sender}'s group")
        local = 0 if rank == sender else 1 + rank - self.senders
        return f"rollpacker-weights/{sender}", local, 1 + self.workers

    def __post_init__(self) -> None:
        if self.backend not in TRANSFER_BACKENDS:
            raise ConfigError(f"weight transfer backend {self.backend!r}: use one of {TRANSFER_BACKENDS}")
        if not 0 < self.senders <= self.rank_offset < self.world_size:
            raise ConfigError(
                f"weight transfer group: rank_offset {self.rank_offset} must leave at least one sender "
                f"(senders: {self.senders}) and one engine worker in a world of {self.world_size}"
            )
        if not (0 < self.port < 65536) or self.timeout_s <= 0:
            raise ConfigError(f"weight transfer group: port {self.port} / timeout_s {self.timeout_s} invalid")
