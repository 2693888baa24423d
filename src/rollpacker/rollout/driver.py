"""The runtime side of a round: submit, step the engine, feed completions back, apply aborts.

The driver knows nothing about any policy's rules; it only does what ``Round`` asks and records
what the engine did (per-step stats for the bubble ratio, token counts, preemptions).

Invariants:
- every request the round submits is reported back to it exactly once, finished or aborted
  (aborted ones carry the tokens and logprobs generated before the abort);
- when ``run_round`` returns, no request of the round is left on the engine;
- the engine's token count equals useful + wasted tokens of the round's result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rollpacker.core.errors import EngineError
from rollpacker.core.metrics import RolloutMetrics, rollout_metrics
from rollpacker.core.policies.base import Round
from rollpacker.core.types import (
    Actions,
    Completion,
    EngineStepStats,
    FinishReason,
    GenerationRequest,
    Group,
    Prompt,
    RoundResult,
    SamplingSpec,
)
from rollpacker.engines.base import RolloutEngine


@dataclass
class _Live:
    req: GenerationRequest
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class RoundRun:
    result: RoundResult
    metrics: RolloutMetrics
    steps: tuple[EngineStepStats, ...]
    engine_tokens: int  # tokens the engine reported, counted independently of the result


def run_round(
    engine: RolloutEngine,
    rnd: Round,
    policy_version: int = 0,
    on_step: Callable[[EngineStepStats, int], None] | None = None,
    max_engine_steps: int = 10_000_000,
    on_group: Callable[[Group], None] | None = None,
    on_response: Callable[[Completion], None] | None = None,
) -> RoundRun:
    """Drive ``rnd`` on ``engine`` to completion and return its result and metrics.

    ``on_step(stats, completed_so_far)`` is called after each engine step (progress bars);
    ``on_response(completion)`` as soon as a response finishes (not aborted), before its group is
    final (rewards start on it at once); ``on_group(group)`` as soon as a group is final (the
    stream trainer starts on it while the rest of the round runs).
    """
    live: dict[str, _Live] = {}
    steps: list[EngineStepStats] = []
    engine_tokens = 0
    completed = 0
    preempt0 = engine.num_preemptions()
    t0 = engine.now()

    def apply(actions: Actions) -> None:
        pending = [actions]
        while pending:
            act = pending.pop()
            for req in act.submit:
                if req.request_id in live:
                    raise EngineError(f"request {req.request_id!r} submitted twice in one round")
                engine.add_request(req)
                live[req.request_id] = _Live(req)
            to_abort = [rid for rid in act.abort if rid in live]
            if to_abort:
                engine.abort(to_abort)
                for rid in to_abort:
                    st = live.pop(rid)
                    pending.append(
                        rnd.observe(_completion(st, FinishReason.ABORT, policy_version, engine.now()))
                    )

    def hand_out() -> None:
        if on_group is not None:
            for g in rnd.take_completed():
                on_group(g)

    apply(rnd.start())
    hand_out()  # groups complete from a policy's cache are final before any engine step
    while not rnd.done:
        if not engine.has_unfinished():
            raise EngineError(
                f"step {rnd.plan.step}: the engine ran dry with the round unfinished "
                f"({len(live)} requests unaccounted for)"
            )
        if len(steps) >= max_engine_steps:
            raise EngineError(f"step {rnd.plan.step}: gave up after {max_engine_steps} engine steps")
        updates, stats = engine.step()
        steps.append(stats)
        for u in updates:
            st = live.get(u.request_id)
            if st is None:
                continue  # aborted earlier in this loop: the engine may still have reported it
            st.tokens.extend(u.new_token_ids)
            st.logprobs.extend(u.new_logprobs)
            engine_tokens += len(u.new_token_ids)
            if u.finished:
                del live[u.request_id]
                completed += 1
                reason = u.finish_reason or FinishReason.STOP
                done = _completion(st, reason, policy_version, engine.now())
                if on_response is not None:
                    on_response(done)
                apply(rnd.observe(done))
                hand_out()
        if on_step is not None:
            on_step(stats, completed)
    if live:
        # A round that is done but left requests running has a policy bug; don't leak them.
        leftover = sorted(live)
        engine.abort(leftover)
        raise EngineError(
            f"step {rnd.plan.step}: round finished with {len(leftover)} requests still running "
            f"(first: {leftover[0]!r}); the policy must abort what it does not wait for"
        )
    elapsed = engine.now() - t0
    result = rnd.result()
    metrics = rollout_metrics(
        result,
        steps,
        time_s=elapsed,
        concurrency=engine.concurrency,
        preemptions=engine.num_preemptions() - preempt0,
        train_version=policy_version,
    )
    return RoundRun(result=result, metrics=metrics, steps=tuple(steps), engine_tokens=engine_tokens)


def sample_requests(
    prompts: Sequence[Prompt], samples: int, sampling: SamplingSpec, id_prefix: str
) -> list[GenerationRequest]:
    """``samples`` requests per prompt (validation, evaluation), ids ``<id_prefix>/<prompt>/k<j>``."""
    return [
        GenerationRequest(
            request_id=f"{id_prefix}/{p.prompt_id}/k{j}", prompt=p, sample_index=j, sampling=sampling
        )
        for p in prompts
        for j in range(samples)
    ]


def generate(
    engine: RolloutEngine,
    requests: Sequence[GenerationRequest],
    on_done: Callable[[Completion], None] | None = None,
) -> list[Completion]:
    """Run ``requests`` to completion (no policy: validation, evaluation); results in input order."""
    live: dict[str, _Live] = {}
    done: dict[str, Completion] = {}
    for req in requests:
        if req.request_id in live:
            raise EngineError(f"request {req.request_id!r} given twice")
        engine.add_request(req)
        live[req.request_id] = _Live(req)
    while live:
        if not engine.has_unfinished():
            raise EngineError(f"the engine ran dry with {len(live)} requests unaccounted for")
        updates, _ = engine.step()
        for u in updates:
            st = live.get(u.request_id)
            if st is None:
                continue
            st.tokens.extend(u.new_token_ids)
            st.logprobs.extend(u.new_logprobs)
            if u.finished:
                del live[u.request_id]
                c = _completion(st, u.finish_reason or FinishReason.STOP, 0, engine.now())
                done[u.request_id] = c
                if on_done is not None:
                    on_done(c)
    return [done[r.request_id] for r in requests]


def _completion(st: _Live, reason: FinishReason, version: int, now: float) -> Completion:
    req = st.req
    return Completion(
        request_id=req.request_id,
        prompt_id=req.prompt.prompt_id,
        sample_index=req.sample_index,
        token_ids=req.prefix_token_ids + tuple(st.tokens),
        logprobs=req.prefix_logprobs + tuple(st.logprobs),
        finish_reason=reason,
        policy_version=version,
        resumed_tokens=len(req.prefix_token_ids),
        finished_at_s=now,
        prefix_versions=req.prefix_token_versions,
    )
