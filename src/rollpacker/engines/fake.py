"""A simulated rollout engine with a virtual clock, for fast, deterministic policy tests.

It follows the engine contract of ``rollpacker.engines.base`` and passes the same contract tests
as the vLLM adapter. Its timing model is ``step_s = base_s + per_seq_s * running`` (the shape of a
real engine's step time, measured on vLLM and printed by the replay benchmark); its KV cache holds
``kv_capacity_tokens`` tokens, and when running requests outgrow it the most recently scheduled
one is preempted (back to the head of the waiting queue, its tokens kept, recomputed on resume),
as vLLM v1 does.

Tokens are a deterministic function of (weights version, context), so greedy output is
reproducible, depends on the loaded weights, and a resumed request continues exactly as the
uninterrupted one would.
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollpacker.core.errors import EngineError
from rollpacker.core.types import (
    EngineStepStats,
    FinishReason,
    GenerationRequest,
    RequestUpdate,
)


@dataclass
class _Req:
    req: GenerationRequest
    context: list[int]
    generated: int = 0
    new_tokens: list[int] = field(default_factory=list)
    new_logprobs: list[float] = field(default_factory=list)


class FakeEngine:
    """Deterministic engine simulator. ``stop_prob`` is the per-token chance of EOS (ignored when
    a request sets ``ignore_eos``)."""

    def __init__(
        self,
        concurrency: int = 64,
        base_s: float = 0.005,
        per_seq_s: float = 0.0001,
        kv_capacity_tokens: int = 1 << 30,
        vocab_size: int = 320,
        eos_token_id: int = 0,
        stop_prob: float = 1 / 64,
        tp_size: int = 1,
        step_time: Callable[[int, int, Sequence[int]], float] | None = None,
    ) -> None:
        if concurrency < 1:
            raise EngineError(f"FakeEngine concurrency must be >= 1, got {concurrency}")
        self._q = concurrency
        self._base_s = base_s
        self._per_seq_s = per_seq_s
        self._kv_cap = kv_capacity_tokens
        self._vocab = vocab_size
        self._eos = eos_token_id
        self._stop_prob = stop_prob
        self._tp = tp_size
        # (running batch, its context tokens, contexts (re)computed this step) -> step seconds;
        # None = the linear model base_s + per_seq_s * batch (no prefill cost)
        self._step_time = step_time
        self._clock = 0.0
        self._waiting: deque[_Req] = deque()
        self._running: list[_Req] = []
        self._all_ids: set[str] = set()
        self._preemptions = 0
        self._weights_version = "init"
        self._killed = ""

    # -- port ---------------------------------------------------------------------------------
    @property
    def concurrency(self) -> int:
        return self._q

    @property
    def tp_size(self) -> int:
        return self._tp

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def eos_token_id(self) -> int:
        return self._eos

    @property
    def timing_model(self) -> str:
        """Where this simulator's seconds come from, in words (not part of the port)."""
        if self._step_time is not None:
            return "virtual clock, step seconds from a given step-time model"
        base_ms, per_seq_ms = 1e3 * self._base_s, 1e3 * self._per_seq_s
        return f"virtual clock, step = {base_ms:.4g} ms + {per_seq_ms:.4g} ms x running requests"

    def now(self) -> float:
        return self._clock

    @property
    def dead(self) -> bool:
        return bool(self._killed)

    def kill(self, why: str = "killed") -> None:
        """Simulate the death of the engine core (as a SIGKILL of vLLM's core process): every
        later call but ``abort`` and ``close`` raises ``EngineError``."""
        self._killed = why
        self._running.clear()
        self._waiting.clear()

    def _alive(self) -> None:
        if self._killed:
            raise EngineError(f"fake engine core died ({self._killed}); close it and start a new one")

    def add_request(self, request: GenerationRequest) -> None:
        self._alive()
        if request.request_id in self._all_ids:
            raise EngineError(f"request id {request.request_id!r} was already used on this engine")
        self._all_ids.add(request.request_id)
        self._waiting.append(_Req(req=request, context=list(request.engine_input_ids)))

    def abort(self, request_ids: Sequence[str]) -> None:
        ids = set(request_ids)
        self._running = [r for r in self._running if r.req.request_id not in ids]
        self._waiting = deque(r for r in self._waiting if r.req.request_id not in ids)

    def has_unfinished(self) -> bool:
        return bool(self._running or self._waiting)

    def num_preemptions(self) -> int:
        return self._preemptions

    def kv_cache_usage(self) -> float:
        used = sum(len(r.context) for r in self._running)
        return min(1.0, used / self._kv_cap)

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        self._alive()
        h = hashlib.sha256()
        n = 0
        for name, tensor in named_tensors:
            h.update(name.encode())
            h.update(repr(_fingerprint(tensor)).encode())
            n += 1
        if n == 0:
            raise EngineError("load_weights got no tensors")
        self._weights_version = h.hexdigest()[:16]

    def close(self) -> None:
        self._running.clear()
        self._waiting.clear()

    def step(self) -> tuple[list[RequestUpdate], EngineStepStats]:
        self._alive()
        start = self._clock
        # Admit waiting requests up to the concurrency limit, then preempt while KV overflows.
        admitted: list[_Req] = []
        while self._waiting and len(self._running) < self._q:
            admitted.append(self._waiting.popleft())
            self._running.append(admitted[-1])
        while len(self._running) > 1 and sum(len(r.context) + 1 for r in self._running) > self._kv_cap:
            victim = self._running.pop()
            if victim in admitted:
                admitted.remove(victim)
            self._waiting.appendleft(victim)
            self._preemptions += 1
        batch = list(self._running)
        prefill = [len(r.context) for r in admitted]
        tokens = sum(len(r.context) for r in batch)
        updates: list[RequestUpdate] = []
        for r in batch:
            tok, lp = self._sample(r)
            r.context.append(tok)
            r.generated += 1
            reason: FinishReason | None = None
            if r.generated >= r.req.sampling.max_tokens:
                reason = FinishReason.LENGTH
            elif tok == self._eos and not r.req.sampling.ignore_eos:
                reason = FinishReason.STOP
            updates.append(
                RequestUpdate(
                    request_id=r.req.request_id,
                    new_token_ids=(tok,),
                    new_logprobs=(lp,),
                    finished=reason is not None,
                    finish_reason=reason,
                )
            )
            if reason is not None:
                self._running.remove(r)
        if self._step_time is not None:
            duration = self._step_time(len(batch), tokens, prefill)
        else:
            duration = self._base_s + self._per_seq_s * len(batch) if batch else self._base_s
        self._clock += duration
        stats = EngineStepStats(
            start_s=start,
            duration_s=duration,
            num_running=len(batch),
            num_waiting=len(self._waiting),
            num_preemptions_total=self._preemptions,
            kv_cache_usage=self.kv_cache_usage(),
            new_tokens=sum(len(u.new_token_ids) for u in updates),
        )
        return updates, stats

    # -- internals ------------------------------------------------------------------------------
    def _sample(self, r: _Req) -> tuple[int, float]:
        sp = r.req.sampling
        # Greedy depends on the context only; sampled tokens also on the request's seed/id, so
        # different samples of one prompt differ while a resumed request continues identically.
        salt = "greedy" if sp.temperature == 0 else f"{sp.seed}:{r.req.prompt.prompt_id}:{r.req.sample_index}"
        d = hashlib.blake2b(
            f"{self._weights_version}|{salt}|{len(r.context)}|{r.context[-8:]}".encode(), digest_size=8
        ).digest()
        u = int.from_bytes(d, "little") / 2**64
        if not sp.ignore_eos and u < self._stop_prob:
            tok = self._eos
        else:
            tok = 1 + int(u * 1e6) % (self._vocab - 1)
            if tok == self._eos:
                tok = (tok + 1) % self._vocab
        logprob = math.log(max(1e-6, 0.05 + 0.9 * ((u * 7919) % 1.0)))
        return tok, logprob


def _fingerprint(tensor: Any) -> Any:
    """A cheap content fingerprint of a tensor-like value (torch tensor, list, number)."""
    if hasattr(tensor, "sum") and hasattr(tensor, "shape"):
        return (
            tuple(tensor.shape),
            float(tensor.double().sum()) if hasattr(tensor, "double") else float(tensor.sum()),
        )
    return tensor
