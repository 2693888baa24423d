"""The exactly-once account (core/accounting.py): each invariant by name, on a chain that keeps it
and on one planted to break it, which the account must name."""

from __future__ import annotations

from rollpacker.core.accounting import StepPrompts, account_prompts

CHAIN = [
    StepPrompts(trained=("a", "b"), deferred=("x", "y")),  # short round: x, y queued
    StepPrompts(trained=("c", "d"), deferred=("z",)),  # short round: z queued
    StepPrompts(trained=("x", "e"), deferred=(), dropped=("y",)),  # long round: y dropped, e drawn
]


def test_invariant_each_prompt_is_trained_dropped_or_waiting() -> None:
    account = account_prompts(CHAIN, queued=("z",))
    assert account.ok and account.problems() == []
    assert (account.prompts_trained, account.dropped, account.waiting, account.deferred_total) == (6, 1, 1, 3)


def test_invariant_no_deferred_prompt_is_lost() -> None:
    lost = account_prompts(CHAIN, queued=())
    assert lost.deferred_lost == ("z",) and not lost.ok
    assert "lost" in lost.problems()[0] and "'z'" in lost.problems()[0]
    # a prompt in the rollout buffer (SortedRL, partial rollout) is waiting too
    assert account_prompts(CHAIN, queued=(), buffered=("z",)).ok


def test_invariant_consumed_at_most_once_per_epoch() -> None:
    twice = [*CHAIN, StepPrompts(trained=("a", "z"), deferred=())]
    account = account_prompts(twice, queued=())
    assert account.trained_twice == ("a",) and not account.ok
    # within two epochs the cursor hands out every prompt again: a second training is fine
    assert account_prompts(twice, queued=(), epochs=2).ok
    both = [*CHAIN, StepPrompts(trained=("z", "f"), deferred=(), dropped=("b",))]
    assert account_prompts(both, queued=()).consumed_twice == ("b",)
    dropped_twice = [*CHAIN, StepPrompts(trained=("z", "f"), deferred=(), dropped=("y",))]
    assert account_prompts(dropped_twice, queued=()).consumed_twice == ("y",)


def test_invariant_the_queue_holds_only_deferred_unconsumed_prompts() -> None:
    assert account_prompts(CHAIN, queued=("z", "q")).queued_never_deferred == ("q",)
    stale = account_prompts(CHAIN, queued=("z", "x"))  # x was trained in the long round
    assert stale.queued_and_consumed == ("x",) and not stale.ok
    dropped = account_prompts(CHAIN, queued=("z", "y"))  # y was dropped there
    assert dropped.queued_and_consumed == ("y",)


def test_problems_name_at_most_five_prompts_each() -> None:
    many = [StepPrompts(trained=(), deferred=tuple(f"p{i}" for i in range(8)))]
    (line,) = account_prompts(many, queued=()).problems()
    assert line.endswith("['p0', 'p1', 'p2', 'p3', 'p4'] ...")
