"""The trainer port: what the RL loop needs from a training backend.

Implemented by ``TorchTrainer`` (plain torch, this CPU or one GPU); a megatron-core backend
implements the same port on a cluster (its ``accumulate`` runs without gradient synchronization and
``finish_step`` all-reduces the unnormalized sums before scaling by the global denominator).

Contract:
- ``accumulate(samples)`` adds the gradient of the chunk's *unnormalized* loss sum and never
  changes weights or optimizer state; it may be called any number of times, in any order of
  chunks, while rollout runs;
- ``replicas`` is the number of data-parallel replicas that accumulate at the same time (the torch
  backend: 1; the megatron gang: its DP size), and ``accumulate_on(r, samples)`` accumulates the
  chunk on replica ``r`` alone; it may be called from one thread per replica at once (the stream
  trainer keeps every replica busy that way), and ``accumulate`` is the same as spreading the chunk
  over the replicas: which replica gets which group never changes the update;
- ``finish_step()`` scales the accumulated gradient by ``1 / D(batch)`` (see
  ``rollpacker.core.stream_math``), clips, takes one optimizer step and bumps ``policy_version``;
  with nothing accumulated (DAPO's overlong filtering removed every sample of the batch) it is an
  exact zero update (``zero_update``): no optimizer step, weights and optimizer state unchanged,
  ``policy_version`` still bumped (one version per RL step), ``samples == optimizer_steps == 0``;
- ``train_batch(samples)`` is the monolithic path: ``mini_batches`` optimizer steps over the batch;
- ``weights()`` yields (Hugging Face name, tensor) pairs for the rollout engine's ``load_weights``;
- ``save_checkpoint(dir)`` / ``load_checkpoint(dir)`` round-trip weights, optimizer state, RNG
  state and ``policy_version`` exactly.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rollpacker.core.advantages import TrainSample


@dataclass(frozen=True)
class AccumStats:
    samples: int
    tokens: int
    loss_sum: float  # unnormalized
    seconds: float


@dataclass(frozen=True)
class TrainStats:
    """One optimizer step (or, from ``train_batch``, the mean over its mini-batches)."""

    samples: int
    tokens: int
    loss: float  # normalized, as the monolithic loss
    grad_norm: float  # before clipping
    clip_frac: float  # fraction of tokens whose ratio was clipped
    ratio_mean: float
    kl: float  # mean per-token k3 KL to the reference (0 when kl_coef is 0)
    policy_version: int  # after the step
    seconds: float
    optimizer_steps: int = 1
    # mean importance weight over tokens (decoupled PPO's pi_old / pi_behav, or the rollout
    # correction's; 1 with neither)
    behav_weight: float = 1.0
    # the engine/trainer mismatch sums of the trained tokens (core.fidelity.sum_keys; metrics:
    # core.fidelity.fidelity_metrics); empty when nothing was trained
    fidelity: dict[str, float] = field(default_factory=dict)


def zero_update(policy_version: int, seconds: float) -> TrainStats:
    """The stats of a step with no sample to train: no optimizer step was taken."""
    return TrainStats(
        samples=0,
        tokens=0,
        loss=0.0,
        grad_norm=0.0,
        clip_frac=0.0,
        ratio_mean=1.0,
        kl=0.0,
        policy_version=policy_version,
        seconds=seconds,
        optimizer_steps=0,
    )


class Trainer(Protocol):
    policy_version: int

    @property
    def replicas(self) -> int: ...

    def accumulate(self, samples: Sequence[TrainSample]) -> AccumStats: ...

    def accumulate_on(self, replica: int, samples: Sequence[TrainSample]) -> AccumStats: ...

    def finish_step(self) -> TrainStats: ...

    def train_batch(self, samples: Sequence[TrainSample]) -> TrainStats: ...

    def logprobs(self, samples: Sequence[TrainSample]) -> list[list[float]]: ...

    def weights(self, tied_head: bool = True) -> Iterator[tuple[str, Any]]:
        """(HF name, tensor) pairs of the policy; ``tied_head=False`` leaves out a tied LM head
        (another name of the embedding, which no engine loads: the collective push)."""
        ...

    def save_checkpoint(self, path: Path) -> Path: ...

    def load_checkpoint(self, path: Path) -> None: ...
