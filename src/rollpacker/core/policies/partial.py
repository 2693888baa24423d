"""Async partial rollout (verl's recipe "Async Partial Rollout Trainer", Tencent; no arXiv paper):
supplementation, interruption and a prompt manager.

Each step resumes every cached prompt (in the prompt manager's priority order, below) and adds new
prompts while fewer than ``in_flight`` requests run (sample supplementation: the engine stays full
until enough finished samples exist). When ``P0`` prompts have ``R0`` finished samples each, every
other request is interrupted; its tokens, logprobs and per-token policy versions, and the finished
samples of prompts that are not complete, are cached and resumed next step.

Prompt manager priority (the recipe's ``get_scheduling_priority``, sorted ascending):
``(unfinished samples, mean length of the finished samples (1e9 if none), max staleness)``, where a
sample's staleness is the current policy version minus the version of its oldest token.

Staleness bound (``rollout.partial.max_staleness``, B): a cached prompt whose oldest token is B
versions old is *due*: it is not interrupted again, the step waits for it, and the update trains it
first. So no trained token lags the rollout's policy by more than B (one more in the one-off
pipeline), and a prompt, once cached, is trained within B more steps: a long response is never
restarted for being slow. Only if more than P0 prompts fall due at once do the extra ones miss the
update; their samples are then past the bound at the next step and are dropped and regenerated
(the safety net that keeps the bound strict). With B = 0 nothing cached is ever resumed (every
interrupted sample is regenerated). The trainer corrects for the lag with the decoupled PPO
objective (``train.objective: auto`` picks it for this policy).

Invariants (tests/core/test_buffered_policies.py):
- exactly ``P0`` groups of ``R0`` responses; resumed tokens keep their logprobs and versions;
- every trained token's staleness is <= ``max_staleness``;
- a due prompt is trained in the step it falls due (when at most P0 fall due at once);
- drawn prompts == trained + cached, disjointly.
"""

from __future__ import annotations

import dataclasses

from rollpacker.core.config import RolloutConfig
from rollpacker.core.errors import PolicyError
from rollpacker.core.policies.base import RolloutPolicy, Round, SamplingFactory, check_result
from rollpacker.core.policies.buffered import BufferedRound
from rollpacker.core.policies.entries import BufferEntry, buffer_after
from rollpacker.core.prompts import PromptCursor
from rollpacker.core.types import Prompt, RoundKind, RoundResult, StepPlan

NO_FINISHED_LEN = 1e9


def scheduling_priority(entry: BufferEntry, version: int, r0: int) -> tuple[int, float, int]:
    """The recipe's priority key of a cached prompt (smaller runs first)."""
    finished = entry.finished
    unfinished = r0 - len(finished)
    mean_len = sum(len(s.token_ids) for s in finished) / len(finished) if finished else NO_FINISHED_LEN
    staleness = max((s.staleness(version) for s in entry.samples), default=0)
    return unfinished, mean_len, staleness


def drop_stale(entry: BufferEntry, version: int, bound: int) -> BufferEntry:
    """The entry without the samples staler than ``bound`` versions (they are regenerated)."""
    keep = tuple(s for s in entry.samples if s.staleness(version) <= bound)
    return entry if len(keep) == len(entry.samples) else dataclasses.replace(entry, samples=keep)


def due_prompts(entries: list[BufferEntry], version: int, bound: int) -> list[str]:
    """The cached prompts (in ``entries`` order) whose oldest token is ``bound`` versions old: one
    more interruption would put it past the bound, so they finish in this step."""
    return [
        e.prompt_id
        for e in entries
        if bound > 0 and e.samples and max(s.staleness(version) for s in e.samples) >= bound
    ]


class PartialPolicy(RolloutPolicy):
    name = "partial"

    def __init__(
        self,
        cfg: RolloutConfig,
        cursor: PromptCursor,
        sampling: SamplingFactory,
        prompts: dict[str, Prompt],
        in_flight: int,
        buffer: list[BufferEntry] | None = None,
        policy_version: int = 0,
        namespace: str = "",
    ) -> None:
        if in_flight < 1:
            raise PolicyError(f"partial rollout: in_flight = {in_flight}, must keep >= 1 request running")
        self.cfg = cfg
        self.cursor = cursor
        self.buffer: list[BufferEntry] = list(buffer or [])
        self.policy_version = policy_version
        self.in_flight = in_flight
        self._prompts = prompts
        self._sampling = sampling
        self.namespace = namespace
        self._planned: dict[int, tuple[list[BufferEntry], tuple[Prompt, ...], list[int]]] = {}
        self._due: dict[int, list[str]] = {}

    @property
    def pool_size(self) -> int:
        """New prompts a step may supplement at most: enough for P0 groups plus every request in
        flight belonging to a different prompt."""
        return self.cfg.prompts_per_step + self.in_flight

    def rollout_buffer(self) -> tuple[BufferEntry, ...]:
        return tuple(self.buffer)

    def plan_step(self, step: int) -> StepPlan:
        p0, r0 = self.cfg.prompts_per_step, self.cfg.responses_per_prompt
        bound = self.cfg.partial.max_staleness
        cached = [drop_stale(e, self.policy_version, bound) for e in self.buffer]
        cached.sort(key=lambda e: scheduling_priority(e, self.policy_version, r0))
        pool, ends = self.cursor.draw_excluding(self.pool_size, {e.prompt_id for e in cached})
        self._planned[step] = (cached, pool, ends)
        self._due[step] = due_prompts(cached, self.policy_version, bound)
        return StepPlan(
            step=step,
            round_kind=RoundKind.PARTIAL,
            prompts=tuple(self._prompts[e.prompt_id] for e in cached) + pool,
            responses_per_prompt=r0,
            target_prompts=p0,
            target_responses=r0,
            from_queue=tuple(e.prompt_id for e in cached),
        )

    def open_round(self, plan: StepPlan) -> Round:
        if plan.step not in self._planned:
            raise PolicyError(f"step {plan.step}: open a round only for a step this policy planned")
        cached, pool, _ = self._planned[plan.step]
        return BufferedRound(
            plan,
            [(self._prompts[e.prompt_id], e) for e in cached],
            self._sampling,
            self.namespace,
            keep_partial=True,
            supplement=pool,
            in_flight=self.in_flight,
            due=self._due[plan.step],
        )

    def commit(self, result: RoundResult) -> None:
        check_result(result)
        step = result.plan.step
        if step not in self._planned:
            raise PolicyError(f"step {step}: commit a round only for a step this policy planned")
        cached, pool, ends = self._planned.pop(step)
        self._due.pop(step, None)
        launched = {g.prompt.prompt_id for g in result.groups} | {p.prompt_id for p in result.deferred}
        used = [p.prompt_id in launched for p in pool]
        k = sum(used)
        if used[:k] != [True] * k:
            raise PolicyError(f"step {step}: supplemented prompts are not a prefix of the step's pool")
        if k:
            self.cursor.advance(ends[k - 1])
        self.buffer = buffer_after(result, cached, step)
