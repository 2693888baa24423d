"""The rollout engine port: what every policy runtime needs from an inference engine.

Implemented by ``VLLMEngine`` (real vLLM v1) and ``FakeEngine`` (a simulated engine with a
virtual clock, for fast policy tests). Both pass ``tests/engines/test_engine_contract.py``.

Contract:
- ``add_request`` queues a request; a request id may be used once per engine;
- ``step`` runs one engine iteration and returns the per-request deltas it produced (new tokens
  with their logprobs, and whether the request finished) plus the step's stats;
- ``abort`` stops requests at once: no later update mentions them; aborting an unknown or
  finished id is a no-op;
- never more than ``concurrency`` requests run in one step; every added request that is not
  aborted eventually finishes;
- ``num_preemptions`` is a non-decreasing counter since start;
- ``load_weights`` replaces the served weights in place (no restart); later tokens come from them;
- ``now()`` is the clock that step stats are stamped with (wall time for vLLM, virtual for fakes).

Capabilities some engines add, each a small Protocol a caller checks with ``isinstance`` (never by
attribute name): ``DraftMemory`` (drafts from earlier responses), ``PrefixCache`` (a prefix cache
that can be emptied), ``RequestList`` (the ids of the requests still running).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from rollpacker.core.types import EngineStepStats, GenerationRequest, RequestUpdate


@runtime_checkable
class RolloutEngine(Protocol):
    @property
    def concurrency(self) -> int:
        """Max requests decoded in one step (vLLM's ``max_num_seqs``): Q of the bubble ratio."""
        ...

    @property
    def tp_size(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_id(self) -> int: ...

    def now(self) -> float: ...

    def add_request(self, request: GenerationRequest) -> None: ...

    def abort(self, request_ids: Sequence[str]) -> None: ...

    def step(self) -> tuple[list[RequestUpdate], EngineStepStats]: ...

    def has_unfinished(self) -> bool: ...

    def num_preemptions(self) -> int: ...

    def kv_cache_usage(self) -> float: ...

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None: ...

    @property
    def dead(self) -> bool:
        """Whether the engine can no longer serve (its engine core process died): every call but
        ``abort`` and ``close`` raises ``EngineError`` from then on, and its owner closes it and
        starts another."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class DraftMemory(Protocol):
    """An engine that drafts speculative tokens from responses it is given (``engine.speculation``'s
    ``history`` source: ``VLLMEngine``). ``remember_drafts`` takes prompt id -> the token ids of
    earlier responses to it and returns how many prompts it kept (0 when it drafts from none);
    ``forget_drafts`` empties that history and returns how many prompts it dropped."""

    def remember_drafts(self, history: Mapping[str, Sequence[Sequence[int]]]) -> int: ...

    def forget_drafts(self) -> int: ...


@runtime_checkable
class PrefixCache(Protocol):
    """An engine with a prefix cache (vLLM): ``forget_cached`` empties it, so the next requests meet
    the engine as a first attempt's did."""

    def forget_cached(self) -> None: ...


@runtime_checkable
class RequestList(Protocol):
    """An engine that lists the ids of its requests still running (added, neither finished nor aborted)."""

    def live_request_ids(self) -> list[str]: ...


@runtime_checkable
class KVCapacity(Protocol):
    """An engine that states how many tokens its KV cache holds (the simulated engine; vLLM's is
    read from its cache config)."""

    @property
    def kv_capacity_tokens(self) -> int: ...


@runtime_checkable
class WeightReceiver(Protocol):
    """An engine that receives a collective weight push (``train.weight_sync: collective``:
    ``VLLMEngine``); one report per worker."""

    def receive_weights(self, policy_version: int, keep_dir: str = "") -> Sequence[object]: ...
