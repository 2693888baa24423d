"""SortedRL ("SortedRL: Accelerating RL Training for LLMs through Online Length-Aware Scheduling",
arXiv:2603.23414): oversubscribed, length-sorted rollout over a cache-aware buffer.

The controller loads ``n * P0`` prompts (``rollout.sorted.group_size`` = n update batches) into the
rollout buffer at once and loads no new prompt until every buffered prompt is trained (the
cache-aware loading rule). Every step launches the whole buffer, ``R0`` responses per prompt
(oversubscription: the engine always has more work than its batch), and terminates the round early
as soon as ``P0`` prompts have all ``R0`` responses finished (the batching threshold). Short
responses finish first, so each update holds the shortest ready trajectories (the micro-curriculum);
the round lists them in ascending length (selective batching). The group's last step holds the last
``P0`` prompts and finishes them all.

Modes (``rollout.sorted.mode``):
- ``on_policy``: unfinished requests are terminated and their prompts scavenged back to the buffer
  with nothing kept; every trained token was sampled by the current policy;
- ``partial``: the generated tokens of terminated requests and their logprobs (and the finished
  responses of prompts not yet complete) stay in the buffer and are resumed next step; every token
  keeps the logprob and policy version it was sampled with.

Invariants (tests/core/test_buffered_policies.py):
- bounded wait: a prompt loaded at step ``s`` is trained by step ``s + n - 1`` (each step trains
  ``P0`` buffered prompts and nothing is loaded before the buffer is empty);
- drawn prompts == trained + buffered, disjointly; no prompt is trained twice per load.
"""

from __future__ import annotations

from rollpacker.core.config import RolloutConfig, SortedMode
from rollpacker.core.errors import PolicyError
from rollpacker.core.policies.base import RolloutPolicy, Round, SamplingFactory, check_result
from rollpacker.core.policies.buffered import BufferedRound
from rollpacker.core.policies.entries import BufferEntry, buffer_after
from rollpacker.core.prompts import PromptCursor
from rollpacker.core.types import Prompt, RoundKind, RoundResult, StepPlan


class SortedPolicy(RolloutPolicy):
    name = "sorted"

    def __init__(
        self,
        cfg: RolloutConfig,
        cursor: PromptCursor,
        sampling: SamplingFactory,
        prompts: dict[str, Prompt],
        buffer: list[BufferEntry] | None = None,
        namespace: str = "",
    ) -> None:
        self.cfg = cfg
        self.cursor = cursor
        self.buffer: list[BufferEntry] = list(buffer or [])
        self.keep_partial = cfg.sorted.mode is SortedMode.PARTIAL
        self._prompts = prompts
        self._sampling = sampling
        self.namespace = namespace
        self._planned: dict[int, tuple[list[BufferEntry], int]] = {}  # step -> (entries, loaded)
        if not self.keep_partial and any(e.samples for e in self.buffer):
            raise PolicyError(
                "the rollout buffer holds cached responses but rollout.sorted.mode is on_policy: "
                "an on-policy arm never trains older tokens; start the arm over (--fresh)"
            )

    @property
    def group_prompts(self) -> int:
        return self.cfg.sorted.group_size * self.cfg.prompts_per_step

    def rollout_buffer(self) -> tuple[BufferEntry, ...]:
        return tuple(self.buffer)

    def plan_step(self, step: int) -> StepPlan:
        p0, r0 = self.cfg.prompts_per_step, self.cfg.responses_per_prompt
        entries, loaded = list(self.buffer), 0
        if not entries:  # cache-aware loading: a new group only once the buffer is empty
            prompts = self.cursor.peek(self.group_prompts)
            entries, loaded = [BufferEntry(p.prompt_id, step) for p in prompts], len(prompts)
        if len(entries) < p0:
            raise PolicyError(
                f"step {step}: the rollout buffer holds {len(entries)} prompts, fewer than P0 = {p0}; "
                "it always holds a multiple of P0 (the state was edited or written by another config)"
            )
        self._planned[step] = (entries, loaded)
        return StepPlan(
            step=step,
            round_kind=RoundKind.SORTED,
            prompts=tuple(self._prompts[e.prompt_id] for e in entries),
            responses_per_prompt=r0,
            target_prompts=p0,
            target_responses=r0,
            from_queue=tuple(e.prompt_id for e in entries) if not loaded else (),
        )

    def _entries(self, plan: StepPlan) -> list[BufferEntry]:
        if plan.step not in self._planned:
            raise PolicyError(f"step {plan.step}: open or commit a round only for a step this policy planned")
        return self._planned[plan.step][0]

    def open_round(self, plan: StepPlan) -> Round:
        entries = self._entries(plan)
        return BufferedRound(
            plan,
            [(self._prompts[e.prompt_id], e) for e in entries],
            self._sampling,
            self.namespace,
            keep_partial=self.keep_partial,
        )

    def commit(self, result: RoundResult) -> None:
        check_result(result)
        plan = result.plan
        entries = self._entries(plan)
        _, loaded = self._planned.pop(plan.step)
        if not loaded and [e.prompt_id for e in entries] != [e.prompt_id for e in self.buffer]:
            raise PolicyError(f"step {plan.step}: the rollout buffer changed since the step was planned")
        if loaded:
            self.cursor.advance(loaded)
        self.buffer = buffer_after(result, entries, plan.step)
