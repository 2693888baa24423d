"""Tail batching (RollPacker, section 3): speculative short rounds, a long-prompt queue, long rounds.

A short round launches ``ceil(eta_p * P0)`` new prompts with ``ceil(eta_r * R0)`` responses each.
A prompt is complete when its first ``R0`` responses finish (its others are aborted at once); the
round ends when ``P0`` prompts are complete, and every prompt still running is aborted and appended
to the long-prompt queue. When the queue holds ``>= P0`` prompts the step is a long round: the
first ``P0`` queued prompts, ``R0`` responses each, no speculation.

Invariants (each has a named test in tests/core/test_tail_batching.py):
- exactly ``P0`` groups of exactly ``R0`` responses per step;
- no prompt is lost or trained twice over a run: drawn prompts == trained + queued, disjointly;
- the long-prompt queue is FIFO;
- a long round never aborts;
- a short round never launches a prompt that waits in the long-prompt queue: on a small dataset a
  prompt's wait can span an epoch boundary, and the cursor then hands it out again; that draw is
  skipped (consumed), so the prompt is trained once, from the queue, and never queued twice.

With DAPO's dynamic sampling (``rollout.dynamic_sampling.enabled``) every round, short or long, is
a ``DynamicSamplingRound``: a group without reward variance is dropped (its prompt consumed, never
queued) and a replacement is drawn from the cursor, past the prompts drawn so far and skipping the
queued ones, so a queued prompt is never drawn twice; replacements still running when the update
is full are deferred to the queue like any aborted prompt (a long round may then defer too).
tests/core/test_dynamic_sampling.py checks drawn == trained + queued + dropped, disjointly.
"""

from __future__ import annotations

from collections.abc import Callable

from rollpacker.core.config import RolloutConfig
from rollpacker.core.errors import PolicyError
from rollpacker.core.policies.base import (
    GroupedRound,
    RolloutPolicy,
    Round,
    SamplingFactory,
    check_result,
)
from rollpacker.core.policies.dynamic import DynamicSamplingRound
from rollpacker.core.prompts import LongPromptQueue, PromptCursor
from rollpacker.core.types import Prompt, RoundKind, RoundResult, StepPlan


class TailBatchingPolicy(RolloutPolicy):
    name = "tail_batching"

    def __init__(
        self,
        cfg: RolloutConfig,
        cursor: PromptCursor,
        sampling: SamplingFactory,
        queue: LongPromptQueue | None = None,
        namespace: str = "",
    ) -> None:
        self.cfg = cfg
        self.cursor = cursor
        self.queue = queue if queue is not None else LongPromptQueue()
        self._sampling = sampling
        self.namespace = namespace
        self._consumed: dict[int, int] = {}  # step -> cursor positions its short round draws

    def _draw(self, n: int) -> tuple[tuple[Prompt, ...], int]:
        """The next ``n`` distinct prompts that are not waiting in the long-prompt queue, and how
        many cursor positions they take (skipped draws included)."""
        skip = {p.prompt_id for p in self.queue.snapshot()}
        picked, ends = self.cursor.draw_excluding(n, skip, "the long-prompt queue")
        return picked, ends[-1]

    def long_queue(self) -> tuple[Prompt, ...]:
        return self.queue.snapshot()

    def plan_step(self, step: int) -> StepPlan:
        p0, r0 = self.cfg.prompts_per_step, self.cfg.responses_per_prompt
        if len(self.queue) >= p0:
            prompts = self.queue.peek(p0)
            return StepPlan(
                step=step,
                round_kind=RoundKind.LONG,
                prompts=prompts,
                responses_per_prompt=r0,
                target_prompts=p0,
                target_responses=r0,
                from_queue=tuple(p.prompt_id for p in prompts),
            )
        prompts, consumed = self._draw(self.cfg.launched_prompts)
        self._consumed[step] = consumed
        return StepPlan(
            step=step,
            round_kind=RoundKind.SHORT,
            prompts=prompts,
            responses_per_prompt=self.cfg.launched_responses,
            target_prompts=p0,
            target_responses=r0,
        )

    def open_round(self, plan: StepPlan) -> Round:
        ds = self.cfg.dynamic_sampling
        if not ds.enabled:
            return GroupedRound(plan, self._sampling, self.namespace)
        return DynamicSamplingRound(
            plan, self._sampling, self._refill(plan), ds.max_extra_prompts, self.namespace
        )

    def _refill(self, plan: StepPlan) -> Callable[[int], tuple[Prompt, ...]]:
        """Replacement prompts for ``plan``'s round: the cursor's next ones after those the step
        drew already, skipping the queued prompts; records the cursor positions consumed."""
        skip = {p.prompt_id for p in self.queue.snapshot()}
        drawn = [0 if plan.round_kind is RoundKind.LONG else len(plan.prompts)]

        def refill(n: int) -> tuple[Prompt, ...]:
            try:
                picked, ends = self.cursor.draw_excluding(drawn[0] + n, skip, "the long-prompt queue")
            except PolicyError as e:
                raise PolicyError(
                    f"step {plan.step}: dynamic sampling needs replacement prompt {drawn[0] + n} in one "
                    f"round and the prompt set cannot give it ({e}); use a larger prompt set or lower "
                    "rollout.dynamic_sampling.max_extra_prompts"
                ) from e
            new = picked[drawn[0] :]
            drawn[0] += n
            self._consumed[plan.step] = ends[-1]
            return new

        return refill

    def commit(self, result: RoundResult) -> None:
        check_result(result)
        plan = result.plan
        if plan.round_kind is RoundKind.LONG:
            if not self.cfg.dynamic_sampling.enabled and (result.deferred or result.discarded):
                raise PolicyError(f"step {plan.step}: a long round must not abort or defer")
            popped = self.queue.pop(len(plan.from_queue))
            if tuple(p.prompt_id for p in popped) != plan.from_queue:
                raise PolicyError(
                    f"step {plan.step}: the long-prompt queue changed since the step was planned"
                )
            self.cursor.advance(self._consumed.pop(plan.step, 0))  # replacements drawn
            self.queue.push(result.deferred)
        else:
            self.cursor.advance(self._consumed.pop(plan.step, len(plan.prompts)))
            self.queue.push(result.deferred)
