"""The exactly-once accounting of an arm (experiment.exactly_once) on a real filesystem store, and
the learning benchmark's arm names."""

from __future__ import annotations

import pytest

from rollpacker.core.errors import ConfigError
from rollpacker.core.policies.entries import BufferEntry
from rollpacker.core.state import ControllerState
from rollpacker.experiment import exactly_once
from rollpacker.stages.messages import GroupsLog
from rollpacker.store.local import FileStore
from rollpacker.store.state_store import StateStore


def _arm(
    tmp_path, steps: list[tuple[tuple[str, ...], tuple[str, ...]]], queue=(), buffer=(), epoch=0, dropped=None
) -> StateStore:
    tmp_path.mkdir(parents=True, exist_ok=True)
    states = StateStore(FileStore(tmp_path), "exp", "arm")
    state = ControllerState("exp", "arm", -1, 0, 0, 0)
    states.init(state)
    for s, (trained, deferred) in enumerate(steps):
        log = GroupsLog(s, f"a{s}", "short", trained, deferred, (), (dropped or {}).get(s, ()))
        states.put_blob(s, "groups.json", log.to_json().encode())
        last = s == len(steps) - 1
        state = state.successor(
            cursor_epoch=epoch if last else 0,
            long_queue=tuple(queue) if last else (),
            partial_cache=tuple(BufferEntry(p, s) for p in buffer) if last else (),
        )
        states.commit(state)
    return states


def test_every_prompt_once_with_the_deferred_ones_trained_or_waiting(tmp_path) -> None:
    states = _arm(tmp_path, [(("a", "b"), ("c", "d")), (("c", "e"), ("f",))], queue=("d",), buffer=("f",))
    once = exactly_once(states)
    assert once.ok and once.prompts_trained == 4 and once.deferred_total == 3 and once.waiting == 2


def test_a_prompt_trained_twice_or_lost_is_reported(tmp_path) -> None:
    twice = exactly_once(_arm(tmp_path / "t", [(("a", "b"), ()), (("b", "c"), ())]))
    assert not twice.ok and twice.trained_twice == ("b",)
    lost = exactly_once(_arm(tmp_path / "l", [(("a",), ("x", "y")), (("x",), ())], queue=()))
    assert not lost.ok and lost.deferred_lost == ("y",)


def test_a_deferred_prompt_that_dynamic_sampling_dropped_later_is_not_lost(tmp_path) -> None:
    """Under DAPO a queued prompt whose group, in the long round, has no reward variance is dropped:
    consumed, neither trained nor queued again. Only a prompt in none of the three is lost."""
    steps = [(("a", "b"), ("x", "y")), (("c",), ())]
    ok = exactly_once(_arm(tmp_path / "d", steps, dropped={1: ("x", "y")}))
    assert ok.ok and ok.dropped == 2 and ok.deferred_lost == ()
    lost = exactly_once(_arm(tmp_path / "l", steps, dropped={1: ("x",)}))
    assert not lost.ok and lost.deferred_lost == ("y",)


def test_a_prompt_is_trained_once_per_epoch_the_cursor_began(tmp_path) -> None:
    steps = [(("a", "b"), ()), (("a", "c"), ()), (("a", "b"), ())]
    assert exactly_once(_arm(tmp_path / "one", steps, epoch=1)).trained_twice == ("a",)  # 3 times in 2
    second = exactly_once(_arm(tmp_path / "two", steps, epoch=2))
    assert second.ok and second.epochs == 3


def test_learning_arms_are_checked_by_name() -> None:
    from rollpacker.lab.bench.learning import ARMS, learning_arms

    assert learning_arms("sync, one_off") == ["sync", "one_off"]
    assert set(ARMS) == {
        *("sync", "tail_batching", "sorted", "sorted_partial", "partial", "one_off"),
        *("control", "dapo", "reinforce_pp", "gspo", "tis", "mis"),
    }
    with pytest.raises(ConfigError, match=r"unknown arm\(s\) \['fast'\]; known: sync, tail_batching"):
        learning_arms("sync,fast")
