"""The rollout policy interface: policies decide, the runtime acts.

A policy plans a step as data (``plan_step``), opens a ``Round`` for it, and the runtime drives the
round: it submits what ``start()`` returns, steps the engine, and feeds every finished or aborted
response back through ``observe()``, which answers with more actions (submit / abort). When
``done`` is true the runtime aborts nothing further on its own; it asks ``result()`` for the groups
and the deferred prompts and hands the result back to the policy with ``commit()``, the only call
that changes cross-step state (cursor, queue). A round that dies before commit changes nothing.

Invariants (every round built on ``GroupedRound``):
- the result holds exactly ``target_prompts`` groups of exactly ``target_responses`` responses;
- a group's responses are the first ``target_responses`` to finish naturally for that prompt;
- every launched prompt is either in a group or deferred, never both, never neither;
- a round whose launch counts equal its targets never aborts anything.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rollpacker.core.errors import PolicyError
from rollpacker.core.policies.entries import BufferEntry
from rollpacker.core.prompts import PromptCursor
from rollpacker.core.types import (
    Actions,
    Completion,
    FinishReason,
    GenerationRequest,
    Group,
    Prompt,
    RoundResult,
    SamplingSpec,
    StepPlan,
    request_id,
)

SamplingFactory = Callable[[Prompt, int], SamplingSpec]
"""Maps (prompt, sample index) to sampling parameters: replay traces set per-sample lengths."""


class Round(abc.ABC):
    """The state machine of one step's rollout."""

    plan: StepPlan

    @abc.abstractmethod
    def start(self) -> Actions: ...

    @abc.abstractmethod
    def observe(self, completion: Completion) -> Actions: ...

    @property
    @abc.abstractmethod
    def done(self) -> bool: ...

    @abc.abstractmethod
    def result(self) -> RoundResult: ...

    def take_completed(self) -> tuple[Group, ...]:
        """Groups that became final since the last call (streamed to rewards and the trainer while
        the round runs). A group handed out here is in ``result().groups``, unchanged."""
        return ()

    # Rounds that decide on rewards (DAPO's dynamic sampling, ``policies/dynamic.py``) set
    # ``needs_rewards``: the runtime scores each group ``take_unjudged`` hands out and answers with
    # ``observe_rewards``; only then does the group reach ``take_completed`` (or is dropped).
    needs_rewards: bool = False

    def take_unjudged(self) -> tuple[Group, ...]:
        return ()

    def observe_rewards(self, prompt_id: str, rewards: Sequence[float]) -> Actions:
        raise PolicyError(f"step {self.plan.step}: this round does not take rewards ({prompt_id!r})")


@dataclass
class _PromptProgress:
    prompt: Prompt
    live: set[str]
    finished: list[Completion]
    complete: bool = False


class GroupedRound(Round):
    """Launch ``responses_per_prompt`` responses for each planned prompt; a prompt is complete when
    its first ``target_responses`` finish (the rest are aborted at once); the round is done when
    ``target_prompts`` prompts are complete (every other running request is then aborted and its
    prompt deferred)."""

    def __init__(self, plan: StepPlan, sampling: SamplingFactory, namespace: str = "") -> None:
        if plan.responses_per_prompt < plan.target_responses:
            raise PolicyError(
                f"step {plan.step}: launching {plan.responses_per_prompt} responses per prompt "
                f"cannot fill groups of {plan.target_responses}"
            )
        if len(plan.prompts) < plan.target_prompts:
            raise PolicyError(
                f"step {plan.step}: {len(plan.prompts)} prompts cannot fill {plan.target_prompts} groups"
            )
        self.plan = plan
        self._sampling = sampling
        self._namespace = namespace
        self._progress: dict[str, _PromptProgress] = {}
        self._owner: dict[str, str] = {}  # request id -> prompt id
        self._complete_order: list[str] = []
        self._discarded: list[Completion] = []
        self._handed_out = 0
        self._started = False

    def start(self) -> Actions:
        if self._started:
            raise PolicyError(f"step {self.plan.step}: round started twice")
        self._started = True
        return Actions(submit=tuple(r for p in self.plan.prompts for r in self._launch(p)))

    def _launch(self, p: Prompt) -> tuple[GenerationRequest, ...]:
        """Open ``p``'s progress and its ``responses_per_prompt`` requests."""
        prog = _PromptProgress(prompt=p, live=set(), finished=[])
        self._progress[p.prompt_id] = prog
        reqs: list[GenerationRequest] = []
        for j in range(self.plan.responses_per_prompt):
            rid = request_id(self.plan.step, p.prompt_id, j, namespace=self._namespace)
            reqs.append(
                GenerationRequest(request_id=rid, prompt=p, sample_index=j, sampling=self._sampling(p, j))
            )
            prog.live.add(rid)
            self._owner[rid] = p.prompt_id
        return tuple(reqs)

    def _abort_all(self) -> Actions:
        """Abort everything still running, across all prompts (the round is full)."""
        return Actions(abort=tuple(sorted(r for q in self._progress.values() for r in q.live)))

    def observe(self, completion: Completion) -> Actions:
        pid = self._owner.get(completion.request_id)
        if pid is None:
            raise PolicyError(
                f"step {self.plan.step}: completion for unknown request {completion.request_id!r}"
            )
        prog = self._progress[pid]
        if completion.request_id not in prog.live:
            raise PolicyError(f"step {self.plan.step}: request {completion.request_id!r} reported twice")
        prog.live.discard(completion.request_id)
        natural = completion.finish_reason is not FinishReason.ABORT
        if not natural or prog.complete or self.done:
            self._discarded.append(completion)
            return Actions()
        prog.finished.append(completion)
        if len(prog.finished) < self.plan.target_responses:
            return Actions()
        prog.complete = True
        self._complete_order.append(pid)
        if self.done:
            return self._abort_all()
        return Actions(abort=tuple(sorted(prog.live)))

    @property
    def done(self) -> bool:
        return len(self._complete_order) >= self.plan.target_prompts

    def take_completed(self) -> tuple[Group, ...]:
        new = self._complete_order[self._handed_out :]
        self._handed_out = len(self._complete_order)
        return tuple(self._group(pid) for pid in new)

    def _group(self, pid: str) -> Group:
        return Group(prompt=self._progress[pid].prompt, responses=tuple(self._progress[pid].finished))

    @property
    def live_requests(self) -> int:
        return sum(len(p.live) for p in self._progress.values())

    def result(self) -> RoundResult:
        if not self.done:
            raise PolicyError(
                f"step {self.plan.step}: result asked for before the round is done "
                f"({len(self._complete_order)}/{self.plan.target_prompts} prompts complete)"
            )
        if self.live_requests:
            raise PolicyError(
                f"step {self.plan.step}: {self.live_requests} requests still running; the runtime "
                "must apply every abort before asking for the result"
            )
        groups = tuple(self._group(pid) for pid in self._complete_order)
        complete = set(self._complete_order)
        deferred = tuple(p for p in self.plan.prompts if p.prompt_id not in complete)
        # Finished responses of prompts that did not complete are generated but not trained.
        extra = tuple(c for p in deferred for c in self._progress[p.prompt_id].finished)
        return RoundResult(
            plan=self.plan, groups=groups, deferred=deferred, discarded=tuple(self._discarded) + extra
        )


class RolloutPolicy(abc.ABC):
    """Plans steps, opens rounds, and takes their results back.

    What a policy carries to the next step, read by the runtime after ``commit`` (the controller
    state stores it): every policy's ``cursor``, and the long-prompt queue and the rollout buffer,
    which are empty for a policy that keeps none."""

    name: str
    cursor: PromptCursor  # the seeded dataset order and the position in it

    def long_queue(self) -> tuple[Prompt, ...]:
        """Tail batching's long-prompt queue (FIFO); empty for a policy without one."""
        return ()

    def rollout_buffer(self) -> tuple[BufferEntry, ...]:
        """SortedRL's / partial rollout's buffer (prompts with their cached responses); empty for
        a policy without one."""
        return ()

    @abc.abstractmethod
    def plan_step(self, step: int) -> StepPlan:
        """What step ``step`` will roll out. Pure: calling it twice gives the same plan."""

    @abc.abstractmethod
    def open_round(self, plan: StepPlan) -> Round: ...

    @abc.abstractmethod
    def commit(self, result: RoundResult) -> None:
        """Take a finished round's result: move the cursor, update queues."""


def check_result(result: RoundResult) -> None:
    """Raise ``PolicyError`` if a round result breaks the group invariants."""
    plan = result.plan
    if len(result.groups) != plan.target_prompts:
        raise PolicyError(f"step {plan.step}: {len(result.groups)} groups, expected {plan.target_prompts}")
    for g in result.groups:
        if len(g.responses) != plan.target_responses:
            raise PolicyError(
                f"step {plan.step}: prompt {g.prompt.prompt_id!r} has {len(g.responses)} "
                f"responses, expected {plan.target_responses}"
            )
