"""DAPO's dynamic sampling as a round: keep drawing until the update holds ``P0`` groups with signal.

A group whose rewards are all equal has all-zero advantages: it adds nothing to the update but
dilutes it (DAPO, section 3.2). This round hands each complete group out for its rewards
(``take_unjudged``), and the runtime answers with ``observe_rewards``: a group with reward variance
is accepted; one without is dropped (neither trained nor deferred: its prompt is consumed), and the
round launches one replacement prompt, drawn through ``refill``, with the plan's responses per
prompt. The round is done when ``P0`` groups are accepted; every request still running is then
aborted and its prompt deferred, as in any tail-batching round (the long-prompt queue takes it).
At most ``max_extra`` prompts are drawn beyond the plan; a round that cannot fill any more raises
``PolicyError`` naming ``rollout.dynamic_sampling.max_extra_prompts``.

Invariants (tests/core/test_dynamic_sampling.py, hypothesis over long randomized runs):
- every accepted group, and so every group in the result, has reward variance; there are exactly
  ``P0`` of them, of exactly ``R0`` responses each;
- every launched prompt (planned or extra) is exactly one of: accepted, dropped, deferred;
- a dropped prompt is never deferred (never queued), and ``extra_prompts`` counts the draws;
- no more than ``max_extra`` prompts are drawn beyond the plan.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rollpacker.core.advantages import has_signal
from rollpacker.core.errors import PolicyError
from rollpacker.core.policies.base import GroupedRound, SamplingFactory
from rollpacker.core.types import Actions, Group, Prompt, RoundResult, StepPlan

Refill = Callable[[int], tuple[Prompt, ...]]
"""Draws the next ``n`` prompts for the round (the policy's cursor, skipping queued prompts)."""


class DynamicSamplingRound(GroupedRound):
    needs_rewards = True

    def __init__(
        self, plan: StepPlan, sampling: SamplingFactory, refill: Refill, max_extra: int, namespace: str = ""
    ) -> None:
        super().__init__(plan, sampling, namespace)
        self._refill = refill
        self._max_extra = max_extra
        self._judged = 0  # prefix of _complete_order handed out for rewards
        self._accepted: list[str] = []
        self._dropped: list[str] = []
        self._extra: list[Prompt] = []
        self._accepted_out = 0

    @property
    def done(self) -> bool:
        return len(self._accepted) >= self.plan.target_prompts

    def take_unjudged(self) -> tuple[Group, ...]:
        """Complete groups whose rewards the round needs (each handed out once)."""
        start, self._judged = self._judged, len(self._complete_order)
        return tuple(self._group(pid) for pid in self._complete_order[start:])

    def take_completed(self) -> tuple[Group, ...]:
        """Accepted groups since the last call: these go to the trainer."""
        start, self._accepted_out = self._accepted_out, len(self._accepted)
        return tuple(self._group(pid) for pid in self._accepted[start:])

    def observe_rewards(self, prompt_id: str, rewards: Sequence[float]) -> Actions:
        prog = self._progress.get(prompt_id)
        if prog is None or not prog.complete or prompt_id in self._accepted or prompt_id in self._dropped:
            raise PolicyError(
                f"step {self.plan.step}: rewards for {prompt_id!r}, which is not a complete, unjudged group"
            )
        if len(rewards) != len(prog.finished):
            raise PolicyError(
                f"step {self.plan.step}: {len(rewards)} rewards for {len(prog.finished)} responses"
            )
        if self.done:
            return Actions()  # late: the update is full; the prompt is deferred (result)
        if has_signal(rewards):
            self._accepted.append(prompt_id)
            return self._abort_all() if self.done else Actions()
        self._dropped.append(prompt_id)
        return self._replace()

    def _replace(self) -> Actions:
        """One replacement prompt for a dropped group, while the budget lasts."""
        if len(self._extra) < self._max_extra:
            (p,) = self._refill(1)
            if p.prompt_id in self._progress:
                raise PolicyError(
                    f"step {self.plan.step}: refill drew {p.prompt_id!r}, already in this round"
                )
            self._extra.append(p)
            return Actions(submit=self._launch(p))
        judged = {*self._dropped, *self._accepted}
        candidates = sum(1 for pid in self._progress if pid not in judged)
        if len(self._accepted) + candidates < self.plan.target_prompts:
            raise PolicyError(
                f"step {self.plan.step}: dynamic sampling drew {len(self._extra)} extra prompts "
                f"(rollout.dynamic_sampling.max_extra_prompts) and {len(self._dropped)} groups had no "
                f"reward variance; {len(self._accepted)} of {self.plan.target_prompts} groups have signal "
                "and no prompt left can fill the rest: raise max_extra_prompts, or use a task the model "
                "neither always solves nor always fails"
            )
        return Actions()

    def result(self) -> RoundResult:
        super().result()  # its checks: the round is done and nothing is left running
        groups = tuple(self._group(pid) for pid in self._accepted)
        used = set(self._accepted) | set(self._dropped)
        launched = (*self.plan.prompts, *self._extra)
        deferred = tuple(p for p in launched if p.prompt_id not in used)
        dropped = tuple(self._progress[pid].prompt for pid in self._dropped)
        # finished responses of dropped and of deferred prompts: generated, not trained
        extra = tuple(c for p in (*dropped, *deferred) for c in self._progress[p.prompt_id].finished)
        return RoundResult(
            plan=self.plan,
            groups=groups,
            deferred=deferred,
            discarded=tuple(self._discarded) + extra,
            filtered=dropped,
            extra_prompts=tuple(self._extra),
        )
