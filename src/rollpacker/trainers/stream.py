"""The stream trainer: gradients on completed groups while rollout runs, one deferred update.

Rollout hands each completed, rewarded group to ``submit``; a worker thread computes and
accumulates its gradient (``Trainer.accumulate``) without touching weights or optimizer state.
When rollout ends, ``finish`` waits for the queue to drain and takes the single optimizer step,
scaled by the whole batch's denominator, so the update equals the monolithic-batch update
(``rollpacker.core.stream_math``). With ``stream=False`` the same object buffers the samples and
trains them after rollout (the synchronous baseline's training stage).

Invariants:
- every submitted sample is accumulated exactly once before ``finish`` steps;
- no optimizer step happens before ``finish``;
- an error in the worker surfaces at the next ``submit`` or at ``finish`` (never silently lost).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from rollpacker.core.advantages import TrainSample
from rollpacker.core.errors import TrainerError
from rollpacker.trainers.base import TrainStats
from rollpacker.trainers.torch_trainer import TorchTrainer

_STOP = object()


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
        self._q: queue.Queue[object] = queue.Queue()
        self._buffer: list[TrainSample] = []
        self._error: BaseException | None = None
        self._streamed = 0
        self._overlap_s = 0.0
        self._finishing = False
        self._thread: threading.Thread | None = None
        if stream:
            self._thread = threading.Thread(target=self._run, name="stream-trainer", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        import torch

        # One intra-op thread for the gradient worker: the engine's decode loop keeps the other
        # cores. Two OpenMP teams spinning on the same cores slow both down many times over.
        torch.set_num_threads(max(1, self.threads))
        while True:
            item = self._q.get()
            try:
                if item is _STOP:
                    return
                if self._error is None:
                    samples = item  # type: ignore[assignment]
                    st = self.trainer.accumulate(samples)  # type: ignore[arg-type]
                    if not self._finishing:
                        self._streamed += st.samples
                        self._overlap_s += st.seconds
            except BaseException as e:  # surfaced to the caller
                self._error = e
            finally:
                self._q.task_done()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise TrainerError(f"the stream trainer failed: {self._error}") from self._error

    def submit(self, samples: Sequence[TrainSample]) -> None:
        self._raise_if_failed()
        if not samples:
            return
        if self.stream:
            self._q.put(list(samples))
        else:
            self._buffer.extend(samples)

    def finish(self) -> StreamReport:
        t0 = time.perf_counter()
        if self.stream:
            self._finishing = True
            self._q.join()
            self._raise_if_failed()
            stats = self.trainer.finish_step()
        else:
            stats = self.trainer.train_batch(self._buffer)
            self._buffer = []
        report = StreamReport(
            stats=stats,
            streamed_samples=self._streamed,
            overlap_s=self._overlap_s,
            finish_s=time.perf_counter() - t0,
        )
        self._streamed, self._overlap_s, self._finishing = 0, 0.0, False
        return report

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._q.put(_STOP)
            self._thread.join(timeout=30)
