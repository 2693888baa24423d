"""The stream trainer: gradients on completed groups while rollout runs, one deferred update.

Rollout hands each completed, rewarded group to ``submit``; a worker thread computes and
accumulates its gradient (``Trainer.accumulate``) without touching weights or optimizer state.
When rollout ends, ``finish`` waits for the queue to drain and takes the single optimizer step,
scaled by the whole batch's denominator, so the update equals the monolithic-batch update
(``rollpacker.core.stream_math``). With ``stream=False`` the same object buffers the samples and
trains them after rollout (the synchronous baseline's training stage).

Batch-scope advantages (``train.advantage: reinforce_pp``; ``rollpacker.core.advantages``): the
advantage of a token depends on the mean and std of every token return in the batch, which only
the last group fixes, and PPO's clipped loss is not linear in the advantage (which side of the
``min`` a token takes depends on the advantage's sign). So the worker computes what each group
needs alone while rollout runs (its reference-model forward, its KL-in-reward token returns) and
merges their sufficient statistics (``ReturnStats``: count, sum, sum of squares); ``finish``
normalizes every token's return with the batch's statistics and then accumulates the gradient and
steps once. The update is the monolithic one exactly (tests/trainers/test_algorithms.py); the
part that overlaps rollout is the reference forward, not the policy gradient.

Every data-parallel replica busy: a trainer with ``replicas > 1`` (the megatron gang at DP > 1)
gets one dispatch lane per replica, a queue and a thread calling ``accumulate_on(replica, chunk)``,
so all replicas compute at once (a single worker would wait on one replica at a time and leave the
others idle). ``submit`` cuts what it gets into groups (the samples of one prompt) and hands each,
largest first, to the lane with the fewest tokens (prompt + response) queued or computing: balanced
by tokens, and a replica that falls behind gets less. The update is unchanged: each replica only
adds to its own gradient buffers, and ``finish`` waits for every lane before the one reduction
(``trainers/megatron/gang.py``).

Repurposed devices (RollPacker 4.4, ``rollout.scale_down``): ``place(cores)`` moves the gradient
worker onto CPU cores that rollout freed: from its next chunk on it runs ``len(cores)`` intra-op
threads pinned to exactly those cores (``torch.set_num_threads`` and ``sched_setaffinity`` of the
worker thread; OpenMP threads it starts inherit the mask), and ``place(None)`` puts it back on its
``threads`` base threads and the process's cores. The placement never changes what is computed,
only where.

Invariants:
- every submitted sample is accumulated exactly once before ``finish`` steps (batch scope: after
  the last group is in, with the whole batch's statistics), on exactly one replica;
- with ``replicas > 1`` a group waits only while every replica is computing (no idle replica while
  groups are queued);
- no optimizer step happens before ``finish``;
- a batch with no sample (overlong filtering removed all) is an exact zero update: no optimizer
  step, weights and optimizer state unchanged, the policy version advanced (``trainers.base``);
- an error in a worker surfaces at the next ``submit`` or at ``finish`` (never silently lost);
- each chunk runs under the placement last requested before it started.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from rollpacker.core.advantages import ReturnStats, Scope, TrainSample
from rollpacker.core.errors import TrainerError
from rollpacker.trainers.base import TrainStats
from rollpacker.trainers.torch_trainer import TorchTrainer

_STOP = object()
_PLACE = object()  # wakes the worker to apply a new placement now


@dataclass(frozen=True)
class StreamReport:
    stats: TrainStats
    streamed_samples: int  # accumulated while rollout was running
    overlap_s: float  # gradient seconds spent before finish() was called
    finish_s: float  # wall seconds finish() took (the part rollout did not hide)


class StreamTrainer:
    def __init__(self, trainer: TorchTrainer, stream: bool = True, threads: int = 1) -> None:
        self.trainer = trainer
        self.threads = threads
        self.stream = stream
        self._buffer: list[TrainSample] = []
        self._error: BaseException | None = None
        self._streamed = 0
        self._overlap_s = 0.0
        self._batch_scope = trainer.estimator.scope is Scope.BATCH
        self._held: list[tuple[list[TrainSample], list[tuple[float, ...]]]] = []  # batch scope
        self._stats = ReturnStats()
        self._finishing = False
        self._placement: frozenset[int] | None = None  # cores to run on; None = the base placement
        # one dispatch lane (queue + thread) per replica; batch scope holds its chunks in order: one
        n = 1 if self._batch_scope else max(1, trainer.replicas)
        self._lock = threading.Lock()  # the lanes' loads and the counters
        self._queues: list[queue.Queue[object]] = [queue.Queue() for _ in range(n)]
        self._load = [0] * n  # tokens submitted to each lane and not yet accumulated
        self._threads: list[threading.Thread] = []
        if stream:
            for r in range(n):
                t = threading.Thread(target=self._run, args=(r,), name=f"stream-trainer-{r}", daemon=True)
                t.start()
                self._threads.append(t)

    def _run(self, lane: int) -> None:
        import torch

        # One intra-op thread for the gradient worker: the engine's decode loop keeps the other
        # cores. Two OpenMP teams spinning on the same cores slow both down many times over.
        # torch._C's builtin: an in-process vLLM CPU engine replaces torch.set_num_threads with a
        # no-op, which would leave this worker on every core.
        torch._C.set_num_threads(max(1, self.threads))
        base_cores = _affinity()
        applied: frozenset[int] | None = None
        q = self._queues[lane]
        while True:
            item = q.get()
            try:
                if item is _STOP:
                    return
                want = self._placement
                if want != applied:
                    _apply(torch, want, max(1, self.threads), base_cores)
                    applied = want
                if item is _PLACE:
                    continue
                samples = cast(list[TrainSample], item)
                try:
                    if self._error is None:
                        self._work(lane, samples)
                finally:
                    with self._lock:
                        self._load[lane] -= _tokens(samples)
            except BaseException as e:  # surfaced to the caller
                self._error = e
            finally:
                q.task_done()

    def _work(self, lane: int, samples: list[TrainSample]) -> None:
        """One chunk on ``lane``'s replica: its gradient, or (batch scope) its returns and their
        statistics."""
        t0 = time.perf_counter()
        if self._batch_scope:
            returns = self.trainer.returns(samples)
            self._held.append((samples, returns))
            self._stats = self._stats.merge(ReturnStats.of(returns))
            n = len(samples)
        elif len(self._queues) == 1:
            n = self.trainer.accumulate(samples).samples
        else:
            n = self.trainer.accumulate_on(lane, samples).samples
        if not self._finishing:
            with self._lock:
                self._streamed += n
                self._overlap_s += time.perf_counter() - t0

    def _finish_batch_scope(self) -> None:
        """Normalize every held chunk with the batch's statistics, then accumulate its gradient."""
        held, stats = self._held, self._stats
        self._held, self._stats = [], ReturnStats()
        for samples, returns in held:
            self.trainer.accumulate(self.trainer.batch_advantages(samples, returns, stats))

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise TrainerError(f"the stream trainer failed: {self._error}") from self._error

    def place(self, cores: frozenset[int] | None) -> int:
        """Run the gradient worker on ``cores`` from its next chunk on (``None``: back to its base
        threads on the process's cores); returns the threads it will use."""
        if cores is not None and not cores:
            raise TrainerError("place: give at least one core (or None for the base placement)")
        self._placement = frozenset(cores) if cores is not None else None
        if self._threads:
            for q in self._queues:
                q.put(_PLACE)  # applied now, not only when the next chunk arrives
        return len(cores) if cores is not None else max(1, self.threads)

    @property
    def placement(self) -> frozenset[int] | None:
        return self._placement

    @property
    def lanes(self) -> int:
        """Replicas the groups are dispatched to at once (one thread each)."""
        return len(self._queues)

    def submit(self, samples: Sequence[TrainSample]) -> None:
        """Queue the samples' gradients: each group (the samples of one prompt), largest first, on
        the lane whose replica has the fewest tokens still to compute."""
        self._raise_if_failed()
        if not samples:
            return
        if not self.stream:
            self._buffer.extend(samples)
            return
        if len(self._queues) == 1:
            self._put(0, list(samples))
            return
        groups: dict[str, list[TrainSample]] = {}
        for s in samples:
            groups.setdefault(s.prompt_id, []).append(s)
        for g in sorted(groups.values(), key=_tokens, reverse=True):
            with self._lock:
                lane = min(range(len(self._load)), key=lambda r: (self._load[r], r))
            self._put(lane, g)

    def _put(self, lane: int, samples: list[TrainSample]) -> None:
        with self._lock:
            self._load[lane] += _tokens(samples)
        self._queues[lane].put(samples)

    def finish(self) -> StreamReport:
        t0 = time.perf_counter()
        if self.stream:
            self._finishing = True
            for q in self._queues:
                q.join()
            self._raise_if_failed()
            if self._batch_scope:
                self._finish_batch_scope()
            stats = self.trainer.finish_step()
        elif self._buffer:
            stats = self.trainer.train_batch(self._buffer)
            self._buffer = []
        else:  # every sample filtered out (DAPO's overlong filtering): an exact zero update
            stats = self.trainer.finish_step()
        report = StreamReport(
            stats=stats,
            streamed_samples=self._streamed,
            overlap_s=self._overlap_s,
            finish_s=time.perf_counter() - t0,
        )
        self._streamed, self._overlap_s, self._finishing = 0, 0.0, False
        return report

    def close(self) -> None:
        for q, t in zip(self._queues, self._threads, strict=False):
            if t.is_alive():
                q.put(_STOP)
        for t in self._threads:
            t.join(timeout=30)


def _tokens(samples: Sequence[TrainSample]) -> int:
    """What a chunk costs to accumulate: its prompt and response tokens."""
    return sum(len(s.prompt_ids) + s.num_tokens for s in samples)


def _affinity() -> frozenset[int] | None:
    """The calling thread's cores (None where the OS has no affinity call)."""
    get = getattr(os, "sched_getaffinity", None)
    return frozenset(get(0)) if get is not None else None


def _apply(
    torch: Any, cores: frozenset[int] | None, base_threads: int, base_cores: frozenset[int] | None
) -> None:
    """Pin the calling (worker) thread to ``cores`` with one intra-op thread per core, or restore
    its base placement. ``sched_setaffinity(0, ...)`` acts on the calling thread only on Linux."""
    target = cores if cores is not None else base_cores
    setter = getattr(os, "sched_setaffinity", None)
    if setter is not None and target:
        setter(0, target)
    torch._C.set_num_threads(len(cores) if cores is not None else base_threads)  # see _run
