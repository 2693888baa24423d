"""The LLM judge reward: a causal LM, colocated with the actor, answers "is this response correct?".

``JudgeReward`` scores ``judge`` examples: it builds the judge prompt from (the example's prompt,
the response, the example's ``reference`` response) in the format the judge was warmed up with
(``rollpacker.tasks.judge_task.JudgePromptFormat``, read from the judge's ``judge.json``), or,
for a judge without one (a configured instruction-tuned LM), ``InstructPromptFormat`` in the
tokenizer's chat template; runs the judge model and reads the probability of ``yes`` at the
answer position: ``reward = P(yes)`` in [0, 1], ``correct = P(yes) > 0.5``, status ``OK``. The
toy judge is a tiny Qwen2 warmed up locally by ``judge_task.warm_up_judge``; any HF causal LM
directory works.

Scoring is asynchronous: ``submit`` queues the request and returns a ``Future`` at once; one
background thread takes every queued request (up to ``max_batch``), scores them as one
right-padded batch and resolves their futures, so requests that arrive while the judge is busy are
batched together. The model is either resident, or offloaded layer-wise
(``rollpacker.rewards.offload``): a fixed number of resident layers, or, with
``memory_budget_bytes``, the number chosen per batch by ``core.judge_plan.choose_resident_layers``
from the budget and the batch's shape (longer batches stream more layers). A batch whose shape
does not fit even fully offloaded is split in halves; a single sample that does not fit is
``ERROR``.

Invariants (those of ``rewards.base``, plus):
- every accepted request's future resolves to a ``RewardResult`` with its ``sample_id``; a
  failure while scoring a batch resolves that batch's samples as ``ERROR`` with the reason;
- ``reward`` is ``P(yes)`` (finite, in [0, 1]) and ``correct == (reward > 0.5)`` for ``OK``;
- a sample's score does not depend on the batch it was scored in (right padding; equal within
  float rounding), nor on whether the judge is offloaded (equal to the resident judge);
- ``close()`` is idempotent: queued requests resolve as ``ERROR`` ("closed"), the batch being
  scored finishes, the worker thread is joined and the offload's copy thread stopped.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollpacker.core.errors import ConfigError
from rollpacker.core.tasks import RewardKind
from rollpacker.rewards.base import ClosesOnExit, RewardFunction, RewardRequest, RewardResult, RewardStatus
from rollpacker.rewards.offload import OffloadedCausalLM, OffloadMode, load_resident
from rollpacker.tasks.judge_task import (
    InstructPromptFormat,
    instruct_verdict_ids,
    p_yes,
    prompt_format,
    verdict_logits,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JudgeConfig:
    device: str = "cpu"  # a torch device: cpu, cuda, cuda:N (rewards.factory resolves "auto")
    dtype: str = "float32"  # the weights on the device: float32 | bfloat16 | float16
    max_batch: int = 16  # requests scored together at most
    resident_layers: int | None = None  # offload all but the first k layers (None: see below)
    memory_budget_bytes: int | None = None  # choose k per batch from this budget (None: fixed k)
    kv_bytes_per_token: int | None = None  # activation bytes per token for the plan (None: estimate)
    n_buffers: int = 2  # streaming buffers (2: double buffering)
    offload_mode: OffloadMode = OffloadMode.PIPELINED

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ConfigError(f"judge max_batch = {self.max_batch}: must be >= 1")
        if self.n_buffers < 1:
            raise ConfigError(f"judge n_buffers = {self.n_buffers}: must be >= 1")
        if self.resident_layers is not None and self.resident_layers < 0:
            raise ConfigError(f"judge resident_layers = {self.resident_layers}: must be >= 0 (or None)")
        if self.memory_budget_bytes is not None and self.memory_budget_bytes <= 0:
            raise ConfigError(
                f"judge memory_budget_bytes = {self.memory_budget_bytes}: must be > 0 (or None)"
            )
        if self.memory_budget_bytes is not None and self.resident_layers is not None:
            raise ConfigError(
                "judge: set resident_layers (a fixed k) or memory_budget_bytes (k chosen per batch), not both"
            )

    @property
    def offloaded(self) -> bool:
        """Whether the judge streams layers (else every layer is resident, no offload machinery)."""
        return self.resident_layers is not None or self.memory_budget_bytes is not None


@dataclass(eq=False)
class _Job:
    req: RewardRequest
    future: Future[RewardResult]


class JudgeReward(RewardFunction, ClosesOnExit):
    """Judge reward: ``P(yes)`` from a (possibly layer-wise offloaded) judge LM, batched in a thread."""

    def __init__(self, model_dir: Path | str, config: JudgeConfig | None = None) -> None:
        from transformers import AutoConfig, AutoTokenizer

        self.kind = RewardKind.JUDGE
        self.config = config or JudgeConfig()
        self.model_dir = Path(model_dir)
        if not (self.model_dir / "config.json").is_file():
            raise ConfigError(
                f"judge model {self.model_dir}: no config.json; build one with "
                "rollpacker.tasks.judge_task.warm_up_judge() (or pass a HF model directory)"
            )
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        self.prompt_format = prompt_format(self.model_dir)  # the toy judge's, or InstructPromptFormat
        instruct = isinstance(self.prompt_format, InstructPromptFormat)
        self._verdicts = instruct_verdict_ids(self.tokenizer) if instruct else None
        self._chat = instruct and bool(getattr(self.tokenizer, "chat_template", None))
        self.offload: OffloadedCausalLM | None = None
        cfg = self.config
        if cfg.offloaded:
            num_layers = int(AutoConfig.from_pretrained(str(self.model_dir)).num_hidden_layers)
            if cfg.resident_layers is not None and cfg.resident_layers > num_layers:
                raise ConfigError(
                    f"judge resident_layers = {cfg.resident_layers}: the judge has {num_layers} layers; "
                    f"use at most {num_layers} (all resident)"
                )
            self.offload = OffloadedCausalLM(
                self.model_dir,
                cfg.resident_layers or 0,  # with a budget: 0 until the first batch's plan
                n_buffers=cfg.n_buffers,
                mode=cfg.offload_mode,
                device=cfg.device,
                dtype=cfg.dtype,
            )
            self.model: Any = self.offload.model
        else:
            self.model = load_resident(self.model_dir, cfg.device, cfg.dtype)
        self.batches = 0  # batches scored (a counter for metrics and tests)
        self.resident_layers_used: list[int] = []  # k of each batch scored offloaded
        self._cv = threading.Condition()
        self._queue: collections.deque[_Job] = collections.deque()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="judge-reward", daemon=True)
        self._thread.start()

    # -- synchronous scoring -----------------------------------------------------------------------

    def score_prompts(self, prompts: Sequence[str]) -> list[float]:
        """``P(yes)`` of each judge prompt, scored as one batch (for the worker and for tests)."""
        import torch

        if self.offload is not None and self.config.memory_budget_bytes is not None:
            seq_len = max(len(self.tokenizer.encode(p, add_special_tokens=False)) for p in prompts)
            k = self.offload.plan(
                self.config.memory_budget_bytes, seq_len, len(prompts), self.config.kv_bytes_per_token
            )
            self.offload.set_resident_layers(k)
        if self.offload is not None:
            self.resident_layers_used.append(self.offload.resident_layers)
        with torch.no_grad():
            probs = p_yes(verdict_logits(self.model, self.tokenizer, prompts, self._verdicts))
        return [float(p) for p in probs]

    def score(self, problem: str, response: str, reference: str) -> float:
        """``P(yes)`` for one (problem, response, reference), synchronously."""
        return self.score_prompts([self.render(problem, response, reference)])[0]

    def render(self, problem: str, response: str, reference: str) -> str:
        """The judge's input text: its prompt format's, in the tokenizer's chat template (with the
        assistant's turn opened) for an instruction-tuned judge whose tokenizer has one."""
        text = self.prompt_format.render(problem, response, reference)
        if not self._chat:
            return text
        msgs = [{"role": "user", "content": text}]
        return str(self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))

    # -- RewardFunction --------------------------------------------------------------------------

    def submit(self, req: RewardRequest) -> Future[RewardResult]:
        if req.example.reward_kind is not RewardKind.JUDGE:
            raise ConfigError(
                f"sample {req.sample_id!r}: example {req.example.example_id!r} has reward kind "
                f"{req.example.reward_kind.value!r}, not 'judge'; route it with RewardRouter"
            )
        fut: Future[RewardResult] = Future()
        fut.set_running_or_notify_cancel()  # not cancellable: it always resolves to a RewardResult
        with self._cv:
            if self._closed:
                raise RuntimeError("JudgeReward is closed; create a new one to score more samples")
            self._queue.append(_Job(req, fut))
            self._cv.notify()
        return fut

    def close(self) -> None:
        """Resolve queued requests as ``ERROR``, finish the batch in flight, join the worker."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            pending = list(self._queue)
            self._queue.clear()
            self._cv.notify_all()
        for job in pending:
            job.future.set_result(_error(job, "JudgeReward was closed before this sample was scored", 0.0))
        self._thread.join()
        if self.offload is not None:
            self.offload.close()

    # -- the worker --------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:  # closed, and close() resolved whatever was queued
                    return
                batch = [self._queue.popleft() for _ in range(min(self.config.max_batch, len(self._queue)))]
            for job, result in zip(batch, self._score_jobs(batch), strict=True):
                job.future.set_result(result)

    def _score_jobs(self, batch: list[_Job]) -> list[RewardResult]:
        t0 = time.perf_counter()
        try:
            prompts = [
                self.render(j.req.example.prompt, j.req.response, j.req.example.reference) for j in batch
            ]
            probs = self.score_prompts(prompts)
        except ConfigError as e:  # the batch does not fit the memory budget even fully offloaded
            if len(batch) > 1:
                half = len(batch) // 2
                return self._score_jobs(batch[:half]) + self._score_jobs(batch[half:])
            return [_error(batch[0], f"the judge cannot score this sample: {e}", time.perf_counter() - t0)]
        except Exception as e:
            log.exception("judge batch of %d failed", len(batch))
            elapsed = time.perf_counter() - t0
            return [_error(j, f"judge scoring raised {type(e).__name__}: {e}", elapsed) for j in batch]
        self.batches += 1
        elapsed = time.perf_counter() - t0
        return [
            RewardResult(
                sample_id=j.req.sample_id,
                reward=p,
                correct=p > 0.5,
                status=RewardStatus.OK,
                elapsed_s=elapsed,
                detail=f"P(yes) = {p:.4f}",
            )
            for j, p in zip(batch, probs, strict=True)
        ]


def _error(job: _Job, detail: str, elapsed_s: float) -> RewardResult:
    return RewardResult(job.req.sample_id, 0.0, False, RewardStatus.ERROR, elapsed_s, detail)
