"""Where every prompt an arm launched ended up: the exactly-once account of a committed chain.

A step launches prompts (the cursor's next ones in a short round, the long-prompt queue's head in
a long round, plus dynamic sampling's replacements) and each ends the step in exactly one of:

- **trained**: its group is in the step's update;
- **deferred**: tail batching aborted it and parked it in the long-prompt queue (or a buffered
  policy keeps its responses in the rollout buffer); it comes back in a later step;
- **dropped**: DAPO's dynamic sampling found no reward variance in its complete group and drew a
  replacement. A drop is final: the prompt is consumed, neither trained nor queued again. This
  holds for a queued prompt too: a deferred prompt whose group has no variance when the long round
  runs it is dropped there, exactly as it would have been had it finished in the short round.

RollPacker's "no prompt is dropped" is about speculation (an aborted prompt is queued, never thrown
away); dynamic sampling's drop is a decision about the group's rewards, made on the complete group.

Invariants, over the chain's groups logs and its last state (tests/core/test_accounting.py):
- every deferred prompt ends trained, dropped or still waiting (queue or buffer): none lost;
- within one epoch of the dataset cursor a prompt is consumed (trained or dropped) at most once:
  no prompt is trained more often, nor trained and dropped, than the epochs the cursor began;
- a prompt still in the long-prompt queue was deferred, and is not also consumed in every epoch
  the cursor began (a trained or dropped prompt is never queued again).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class StepPrompts:
    """What one committed step did with the prompts it launched (its groups log)."""

    trained: tuple[str, ...]
    deferred: tuple[str, ...]
    dropped: tuple[str, ...] = ()


@dataclass(frozen=True)
class PromptAccount:
    """The account of an arm: counts and, by name, every prompt that breaks an invariant."""

    prompts_trained: int  # distinct prompts
    trained_twice: tuple[str, ...]  # trained more times than the epochs the cursor began
    deferred_total: int
    deferred_lost: tuple[str, ...]  # deferred, never trained nor dropped, and not waiting
    waiting: int  # deferred prompts still in the long-prompt queue or the rollout buffer
    epochs: int = 1  # epochs of the dataset the cursor began
    dropped: int = 0  # distinct prompts dynamic sampling dropped (no reward variance): final
    consumed_twice: tuple[str, ...] = ()  # trained and dropped (or dropped twice) within an epoch
    queued_and_consumed: tuple[str, ...] = ()  # still queued, though trained or dropped in every epoch
    queued_never_deferred: tuple[str, ...] = ()  # in the queue, yet no step deferred it

    @property
    def ok(self) -> bool:
        return not self.problems()

    def problems(self) -> list[str]:
        """Each broken invariant in a line naming (up to five of) its prompts; empty: it holds."""
        found = (
            ("trained more often than the epochs the cursor began", self.trained_twice),
            ("deferred, then neither trained, dropped nor waiting (lost)", self.deferred_lost),
            ("trained and dropped (or dropped twice) within one epoch", self.consumed_twice),
            ("still queued although trained or dropped", self.queued_and_consumed),
            ("queued although no step deferred it", self.queued_never_deferred),
        )
        return [f"{what}: {list(ids[:5])}" + (" ..." if len(ids) > 5 else "") for what, ids in found if ids]


def account_prompts(
    steps: Iterable[StepPrompts], queued: Iterable[str], buffered: Iterable[str] = (), epochs: int = 1
) -> PromptAccount:
    """The account of the chain whose steps' groups logs are ``steps`` and whose last state holds
    ``queued`` (long-prompt queue) and ``buffered`` (rollout buffer) prompts, after the cursor began
    ``epochs`` epochs of the dataset."""
    trained: Counter[str] = Counter()
    dropped: Counter[str] = Counter()
    deferred: set[str] = set()
    for step in steps:
        trained.update(step.trained)
        dropped.update(step.dropped)
        deferred.update(step.deferred)
    queue, buffer = set(queued), set(buffered)
    waiting = queue | buffer
    consumed = trained + dropped

    def names(ids: Iterable[str]) -> tuple[str, ...]:
        return tuple(sorted(ids))

    return PromptAccount(
        prompts_trained=len(trained),
        trained_twice=names(p for p, n in trained.items() if n > epochs),
        deferred_total=len(deferred),
        deferred_lost=names(deferred - set(consumed) - waiting),
        waiting=len(deferred & waiting),
        epochs=epochs,
        dropped=len(dropped),
        consumed_twice=names(p for p, n in consumed.items() if n > epochs and trained[p] <= epochs),
        queued_and_consumed=names(p for p in queue if consumed[p] >= epochs),
        queued_never_deferred=names(queue - deferred),
    )
