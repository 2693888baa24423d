"""The what-if simulator's engine: the rollout engine port on a virtual clock priced by a cost model.

``SimEngine`` follows the contract of ``rollpacker.engines.base`` (it passes the same contract tests,
tests/lab/bench/whatif/test_sim_engine.py) so the real policies and the real round driver run on it unchanged,
as they do on ``FakeEngine``. Two differences make it fit for paper-sized traces (1,000+ requests a
round, 16k-token responses) where ``FakeEngine``'s one-token-per-step hashing would take minutes:

- **skip ahead**: one ``step()`` decodes every running request up to the next event (the first
  request to finish, or the KV cache filling up), returning each request's tokens in one update
  (a finishing request's last token in a second update, after every running request's: what a
  token-by-token engine reports in the step of the completion).
  Policies act only on completions (finished responses are what ``observe`` reacts to; aborts are
  applied after a step), so the schedule is the one a token-by-token engine gives. The step's
  seconds are the cost model's decode time of that many iterations at the batch it ran
  (``core.costmodel.decode_run_s``), plus the prefill of the requests admitted at its start.
- **balanced data parallelism**: ``dp`` replicas of the cost model's engine are one engine of
  ``dp x concurrency`` slots and ``dp x`` the KV; a step costs what its busiest replica costs when
  the running requests are spread evenly (``ceil(batch / dp)`` each). This is the best a load
  balancer does; a round-robin one can be slower in the tail. Stated in docs/whatif.md.

Tokens are a deterministic function of (weights version, prompt, sample), constant within a
request, so greedy output is reproducible and a resumed request continues exactly. With
``max_skip=1`` a step is one decode iteration: the port's contract tests run in that mode (they
abort mid-request after a number of steps); the skip-ahead mode is tested against ``FakeEngine``
on the whole replay benchmark (the same seconds, steps and bubble ratio for every policy). Stats count one
step per event: ``engine_steps`` of a simulated round are events, not decode iterations
(``new_tokens`` holds the iterations' tokens). When the KV cache cannot hold one more token per
running request the most recently scheduled request is preempted (recomputed on resume), as vLLM v1
and ``FakeEngine`` do.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

from rollpacker.core.costmodel import StepCost, decode_run_s
from rollpacker.core.errors import EngineError
from rollpacker.core.types import EngineStepStats, FinishReason, GenerationRequest, RequestUpdate
from rollpacker.engines.fake import FakeEngine


@dataclass(eq=False)  # identity: a request is itself, whatever its counters
class _Req:
    req: GenerationRequest
    context: int  # resident tokens: prompt + prefix + generated here
    limit: int  # tokens this request generates before it finishes
    reason: FinishReason
    token: int
    logprob: float
    generated: int = 0


def _digest(*parts: object) -> int:
    d = hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(d, "little")


class SimEngine(FakeEngine):
    """``dp`` balanced replicas of the engine ``cost`` prices, each running up to ``concurrency``
    requests; a virtual clock that skips ahead to the next completion. ``stop_prob`` is the
    per-token chance of EOS for requests that do not set ``ignore_eos``.

    ``FakeEngine``'s port (queues, ids, aborts, counters, weights version) with its own step:
    the clock comes from ``cost`` and a step runs to the next event."""

    def __init__(
        self,
        cost: StepCost,
        dp: int = 1,
        concurrency: int = 256,
        vocab_size: int = 320,
        eos_token_id: int = 0,
        stop_prob: float = 1 / 64,
        max_skip: int | None = None,
    ) -> None:
        if dp < 1 or concurrency < 1 or (max_skip is not None and max_skip < 1):
            raise EngineError(
                f"SimEngine: dp = {dp}, concurrency = {concurrency}, max_skip = {max_skip}: each must be >= 1"
            )
        super().__init__(
            concurrency=concurrency * dp,
            kv_capacity_tokens=cost.kv_capacity_tokens * dp,
            vocab_size=vocab_size,
            eos_token_id=eos_token_id,
            stop_prob=stop_prob,
            tp_size=cost.tp,
        )
        self._max_skip = max_skip
        self.cost = cost
        self.dp = dp

    @property
    def timing_model(self) -> str:
        """Where the seconds come from, in words (``FakeEngine``'s attribute of the same name)."""
        return f"virtual clock, skip-ahead; {self.cost.label}, {self.dp} balanced replica(s)"

    def add_request(self, request: GenerationRequest) -> None:
        super().add_request(request)  # the single-use id check and the queue
        self._waiting[-1] = self._new(request)  # type: ignore[assignment]

    def kv_cache_usage(self) -> float:
        # the queues hold this module's _Req (context is a count), not FakeEngine's
        return min(1.0, sum(r.context for r in self._running) / max(1, self._kv_cap))  # type: ignore[misc]

    def step(self) -> tuple[list[RequestUpdate], EngineStepStats]:
        start = self._clock
        admitted = self._admit()
        batch = len(self._running)
        tokens = sum(r.context for r in self._running)
        k = self._skip(batch, tokens)
        duration = self._prefill_s(admitted) + self._decode_s(batch, tokens, k)
        updates: list[RequestUpdate] = []
        finished: list[RequestUpdate] = []
        for r in list(self._running):
            self._advance(r, k, updates, finished)
        updates += finished  # see _advance
        self._clock += duration
        stats = EngineStepStats(
            start_s=start,
            duration_s=duration,
            num_running=batch,
            num_waiting=len(self._waiting),
            num_preemptions_total=self._preemptions,
            kv_cache_usage=self.kv_cache_usage(),
            new_tokens=batch * k,
        )
        return updates, stats

    # -- internals ------------------------------------------------------------------------------
    def _new(self, request: GenerationRequest) -> _Req:
        sp = request.sampling
        salt = (
            "greedy"
            if sp.temperature == 0
            else f"{sp.seed}:{request.prompt.prompt_id}:{request.sample_index}"
        )
        h = _digest(self._weights_version, salt, request.prompt.token_ids)
        token = 1 + h % (self._vocab - 1)
        if token == self._eos:
            token = 1 + token % (self._vocab - 1)
        limit, reason = sp.max_tokens, FinishReason.LENGTH
        if not sp.ignore_eos and self._stop_prob > 0:
            u = (_digest(h, "eos") + 1) / 2.0**64  # in (0, 1]: a geometric draw of the EOS position
            eos_at = 1 + int(math.log(u) / math.log1p(-self._stop_prob)) - len(request.prefix_token_ids)
            if 1 <= eos_at < limit:
                limit, reason = eos_at, FinishReason.STOP
        logprob = math.log(0.05 + 0.9 * ((h >> 17) % 1000) / 1000)
        return _Req(request, len(request.engine_input_ids), max(1, limit), reason, token, logprob)

    def _admit(self) -> list[_Req]:
        """Fill the free slots from the waiting queue, then preempt (latest first) while the KV cache
        cannot hold one more token per running request."""
        admitted: list[_Req] = []
        while self._waiting and len(self._running) < self._q:
            admitted.append(self._waiting.popleft())
            self._running.append(admitted[-1])
        while len(self._running) > 1 and sum(r.context + 1 for r in self._running) > self._kv_cap:
            victim = self._running.pop()
            if victim in admitted:
                admitted.remove(victim)
            victim.context = len(victim.req.engine_input_ids) + victim.generated  # recomputed on resume
            self._waiting.appendleft(victim)
            self._preemptions += 1
        return admitted

    def _skip(self, batch: int, tokens: int) -> int:
        """Decode iterations until the next event: the first finish, or the KV cache filling."""
        if batch == 0:
            return 0
        k = min(r.limit - r.generated for r in self._running)
        room = (self._kv_cap - tokens) // batch
        return max(1, min(k, room, self._max_skip or k))

    def _decode_s(self, batch: int, tokens: int, k: int) -> float:
        if batch == 0:
            return 0.0
        per = math.ceil(batch / self.dp)  # the busiest replica's share of a balanced spread
        return decode_run_s(self.cost, per, tokens * per / batch, k)

    def _prefill_s(self, admitted: Sequence[_Req]) -> float:
        """The busiest replica's share of the admitted contexts (longest first, dealt round-robin)."""
        contexts = sorted((r.context for r in admitted), reverse=True)
        return self.cost.prefill_s(contexts[:: self.dp]) if contexts else 0.0

    def _advance(self, r: _Req, k: int, running: list[RequestUpdate], finished: list[RequestUpdate]) -> None:
        """``k`` tokens of ``r``. A request that finishes reports its first ``k - 1`` tokens with the
        running ones and its last token in ``finished``, reported after them: exactly what a
        one-iteration step reports, so a request the policy aborts on another's completion loses
        (to the driver) the one token it would lose there, never ``k``."""
        r.generated += k
        r.context += k
        if r.generated < r.limit:
            running.append(self._update(r, k, None))
            return
        self._running.remove(r)
        if k > 1:
            running.append(self._update(r, k - 1, None))
        finished.append(self._update(r, 1, r.reason))

    @staticmethod
    def _update(r: _Req, n: int, reason: FinishReason | None) -> RequestUpdate:
        return RequestUpdate(
            request_id=r.req.request_id,
            new_token_ids=(r.token,) * n,
            new_logprobs=(r.logprob,) * n,
            finished=reason is not None,
            finish_reason=reason,
        )
