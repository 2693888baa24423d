"""The synchronous baseline (veRL-style): ``P0`` new prompts x ``R0`` responses, wait for all.

Invariants:
- every step trains the next ``P0`` prompts of the cursor, in cursor order;
- nothing is ever aborted or deferred.
"""

from __future__ import annotations

from rollpacker.core.config import RolloutConfig
from rollpacker.core.errors import PolicyError
from rollpacker.core.policies.base import (
    GroupedRound,
    RolloutPolicy,
    Round,
    SamplingFactory,
    check_result,
)
from rollpacker.core.prompts import PromptCursor
from rollpacker.core.types import RoundKind, RoundResult, StepPlan


class SyncPolicy(RolloutPolicy):
    name = "sync"

    def __init__(
        self, cfg: RolloutConfig, cursor: PromptCursor, sampling: SamplingFactory, namespace: str = ""
    ) -> None:
        self.cfg = cfg
        self.cursor = cursor
        self._sampling = sampling
        self.namespace = namespace

    def plan_step(self, step: int) -> StepPlan:
        p0, r0 = self.cfg.prompts_per_step, self.cfg.responses_per_prompt
        return StepPlan(
            step=step,
            round_kind=RoundKind.STANDARD,
            prompts=self.cursor.peek(p0),
            responses_per_prompt=r0,
            target_prompts=p0,
            target_responses=r0,
        )

    def open_round(self, plan: StepPlan) -> Round:
        return GroupedRound(plan, self._sampling, self.namespace)

    def commit(self, result: RoundResult) -> None:
        check_result(result)
        if result.deferred:
            raise PolicyError(f"step {result.plan.step}: the sync policy never defers a prompt")
        self.cursor.advance(len(result.plan.prompts))
