"""StateStore over every object store adapter (S3 on a real SeaweedFS server, and the file store):
the chain of step documents and the pointer to the newest."""

from __future__ import annotations

import builtins
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from rollpacker.core.state import StateError
from rollpacker.store.base import ObjectStore, StoreError
from rollpacker.store.state_store import StateStore
from tests.store.chain import advance, chain, initial


class CrashingStore:
    """Any real store, recording every write; ``crash_on`` makes a write to that key die first."""

    def __init__(self, real: ObjectStore) -> None:
        self.real = real
        self.writes: list[str] = []
        self.crash_on: str | None = None

    def _write(self, key: str) -> None:
        if key == self.crash_on:
            raise StoreError(f"simulated crash before writing {key}")
        self.writes.append(key)

    def put_bytes(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> str:
        self._write(key)
        return self.real.put_bytes(key, data, content_type)

    def put_json(self, key: str, obj: Any) -> str:
        self._write(key)
        return self.real.put_json(key, obj)

    def check(self) -> None:
        self.real.check()

    def uri(self, key: str) -> str:
        return self.real.uri(key)

    def key_of(self, uri: str) -> str:
        return self.real.key_of(uri)

    def get_bytes(self, key: str) -> bytes:
        return self.real.get_bytes(key)

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        return self.real.get_range(key, offset, length)

    def exists(self, key: str) -> bool:
        return self.real.exists(key)

    def get_json(self, key: str) -> Any:
        return self.real.get_json(key)

    def list(self, prefix: str = "") -> builtins.list[str]:
        return self.real.list(prefix)

    def delete(self, key: str) -> bool:
        self._write(key)
        return self.real.delete(key)

    def delete_prefix(self, prefix: str) -> int:
        return self.real.delete_prefix(prefix)

    def upload_dir(self, local_dir: Path | str, prefix: str) -> str:
        return self.real.upload_dir(local_dir, prefix)

    def download_dir(self, uri: str, local_dir: Path | str) -> Path:
        return self.real.download_dir(uri, local_dir)


@pytest.fixture
def spy(store: ObjectStore) -> CrashingStore:
    return CrashingStore(store)


@pytest.fixture
def states(spy: CrashingStore, prefix: str) -> StateStore:
    return StateStore(spy, prefix, "tail_batching")


def test_the_spy_is_an_object_store(spy: CrashingStore) -> None:
    assert isinstance(spy, ObjectStore)


def test_empty_arm_has_no_state(states: StateStore) -> None:
    assert states.latest() is None
    assert states.latest_step() is None
    assert states.history() == []


def test_init_and_commit_chain(states: StateStore, spy: CrashingStore) -> None:
    s = chain(states, 3)
    assert states.latest() == s[-1]
    assert states.history() == [-1, 0, 1, 2]
    for st in s:
        assert states.load(st.step) == st
    assert states.state_key(2) == f"{states.experiment}/tail_batching/state/step-000002.json"
    assert spy.get_json(states.pointer_key) == {"step": 2, "key": states.state_key(2)}


def test_commit_returns_the_document_uri(states: StateStore, spy: CrashingStore) -> None:
    s0 = initial(states)
    assert states.init(s0) == spy.uri(states.state_key(-1))
    assert states.commit(advance(s0)) == spy.uri(states.state_key(0))


def test_commit_before_init_is_refused(states: StateStore) -> None:
    with pytest.raises(StateError, match=r"no state yet: init\(\)"):
        states.commit(advance(initial(states)))
    assert states.history() == []


def test_init_needs_the_initial_step(states: StateStore) -> None:
    with pytest.raises(StateError, match="initial state has step -1"):
        states.init(advance(initial(states)))


def test_init_is_idempotent_but_refused_once_steps_exist(states: StateStore) -> None:
    s0 = initial(states)
    states.init(s0)
    states.init(s0)
    assert states.history() == [-1]
    with pytest.raises(StateError, match="already committed"):
        states.init(dataclasses.replace(s0, seed=99))
    states.commit(advance(s0))
    with pytest.raises(StateError, match="already holds step 0"):
        states.init(s0)


def test_pointer_moves_only_after_the_document(states: StateStore, spy: CrashingStore) -> None:
    chain(states, 2)
    docs_and_pointer = [k for k in spy.writes if "/state/" in k]
    assert docs_and_pointer == [
        states.state_key(-1),
        states.pointer_key,
        states.state_key(0),
        states.pointer_key,
        states.state_key(1),
        states.pointer_key,
    ]


def test_crash_before_the_document_leaves_the_previous_step(states: StateStore, spy: CrashingStore) -> None:
    s = chain(states, 1)
    nxt = advance(s[-1])
    spy.crash_on = states.state_key(nxt.step)
    with pytest.raises(StoreError, match="simulated crash"):
        states.commit(nxt)
    assert states.latest() == s[-1]
    spy.crash_on = None
    other = dataclasses.replace(nxt, cursor_position=999)  # a re-run may differ: nothing was written
    states.commit(other)
    assert states.latest() == other


def test_crash_between_document_and_pointer_then_same_commit_completes(
    states: StateStore, spy: CrashingStore
) -> None:
    s = chain(states, 1)
    nxt = advance(s[-1])
    spy.crash_on = states.pointer_key
    with pytest.raises(StoreError, match="simulated crash"):
        states.commit(nxt)
    assert states.latest() == s[-1]  # readers still see the previous step
    assert states.history() == [-1, 0, 1]  # but the document is written
    spy.crash_on = None
    spy.writes.clear()
    assert states.commit(nxt) == spy.uri(states.state_key(1))
    assert spy.writes == [states.pointer_key]  # the document is not rewritten: only the pointer moves
    assert states.latest() == nxt


def test_crash_between_document_and_pointer_then_different_state_is_refused(
    states: StateStore, spy: CrashingStore
) -> None:
    s = chain(states, 1)
    nxt = advance(s[-1])
    spy.crash_on = states.pointer_key
    with pytest.raises(StoreError):
        states.commit(nxt)
    spy.crash_on = None
    with pytest.raises(StateError, match=r"step 1 already committed .*recover\(\)"):
        states.commit(dataclasses.replace(nxt, cursor_position=999))
    assert states.recover() == nxt  # the controller rolls forward onto the written document
    assert states.latest() == nxt
    assert states.recover() == nxt  # and nothing more to recover


def test_recover_without_a_pending_document_changes_nothing(states: StateStore) -> None:
    assert states.recover() is None
    s = chain(states, 2)
    assert states.recover() == s[-1]


def test_recommit_of_an_identical_committed_step_is_a_noop(states: StateStore, spy: CrashingStore) -> None:
    s = chain(states, 3)
    spy.writes.clear()
    states.commit(s[2])  # step 1 again, after step 2 was committed
    assert spy.writes == []
    assert states.latest() == s[-1]


def test_different_state_for_a_committed_step_is_refused(states: StateStore) -> None:
    s = chain(states, 2)
    with pytest.raises(StateError, match=r"step 1 already committed .* different content"):
        states.commit(dataclasses.replace(s[-1], long_queue=("changed",)))
    with pytest.raises(StateError, match="step 0 already committed"):
        states.commit(dataclasses.replace(s[1], cursor_position=123))
    assert states.latest() == s[-1]
    assert states.load(1) == s[-1]


def test_a_gap_is_refused(states: StateStore) -> None:
    s = chain(states, 1)
    skip = advance(advance(s[-1]))
    with pytest.raises(StateError, match="latest committed step is 0, so the next commit must be step 1"):
        states.commit(skip)
    assert states.history() == [-1, 0]


def test_state_of_another_arm_is_refused(states: StateStore) -> None:
    s0 = initial(states)
    with pytest.raises(StateError, match="given to the state store of"):
        states.init(dataclasses.replace(s0, arm="sync"))


def test_corrupt_document_raises_state_error(states: StateStore, spy: CrashingStore) -> None:
    chain(states, 1)
    spy.put_bytes(states.state_key(0), b'{"step": 0, "truncat')
    with pytest.raises(StateError, match=r"step-000000\.json: not JSON"):
        states.latest()
    spy.put_bytes(states.state_key(0), b'{"schema_version": 1, "step": 0}')
    with pytest.raises(StateError, match="missing field"):
        states.latest()
    with pytest.raises(StateError):  # and nothing can be committed on top of it
        states.commit(advance(initial(states)).successor())


def test_document_in_the_wrong_place_raises_state_error(states: StateStore, spy: CrashingStore) -> None:
    s = chain(states, 1)
    spy.put_bytes(states.state_key(1), s[0].to_json().encode())
    spy.put_json(states.pointer_key, {"step": 1, "key": states.state_key(1)})
    with pytest.raises(StateError, match=r"holds step -1 .* not step 1"):
        states.latest()


def test_pointer_to_a_missing_document_raises_state_error(states: StateStore, spy: CrashingStore) -> None:
    chain(states, 1)
    spy.put_json(states.pointer_key, {"step": 5, "key": states.state_key(5)})
    with pytest.raises(
        StateError, match=r"names step 5, but .*step-000005\.json is missing.*committed: \[-1, 0\]"
    ):
        states.latest()


@pytest.mark.parametrize(
    "pointer",
    [
        b"not json",
        b"[1, 2]",
        b'{"step": "3"}',
        b'{"step": -2, "key": "x"}',
        b'{"step": 0, "key": "elsewhere"}',
    ],
)
def test_corrupt_pointer_raises_state_error(states: StateStore, spy: CrashingStore, pointer: bytes) -> None:
    chain(states, 1)
    spy.put_bytes(states.pointer_key, pointer)
    with pytest.raises(StateError, match=r"LATEST\.json is corrupt"):
        states.latest()


def test_load_of_a_step_never_committed(states: StateStore) -> None:
    chain(states, 0)
    with pytest.raises(StateError, match=r"step 4 of .* was never committed"):
        states.load(4)


def test_blobs_and_checkpoint_prefix(states: StateStore, spy: CrashingStore) -> None:
    uri = states.put_blob(3, "attempt-1/rollout.jsonl", b'{"a": 1}\n')
    assert uri == spy.uri(f"{states.experiment}/tail_batching/steps/step-000003/attempt-1/rollout.jsonl")
    assert states.get_blob(3, "attempt-1/rollout.jsonl") == b'{"a": 1}\n'
    assert states.checkpoint_prefix(3) == f"{states.experiment}/tail_batching/ckpt/step-000003/"
    assert states.checkpoint_uri(3) == spy.uri(states.checkpoint_prefix(3))
    with pytest.raises(StoreError, match="no such object"):
        states.get_blob(4, "attempt-1/rollout.jsonl")


@pytest.mark.parametrize("name", ["", "/abs", "../escape", "a/../../b", "."])
def test_bad_blob_names_are_refused(states: StateStore, name: str) -> None:
    with pytest.raises(StateError, match="blob name"):
        states.blob_key(0, name)


@pytest.mark.parametrize("experiment", ["", "a/b", "../x", " x"])
def test_bad_experiment_names_are_refused(store: ObjectStore, experiment: str) -> None:
    with pytest.raises(StateError, match="experiment ="):
        StateStore(store, experiment, "arm")


def test_reset_deletes_only_this_arm(store: ObjectStore, prefix: str) -> None:
    mine, other = StateStore(store, prefix, "sync"), StateStore(store, prefix, "sync2")
    chain(mine, 2)
    chain(other, 1)
    mine.put_blob(0, "x", b"1")
    assert mine.reset() == 1 + 3 + 1  # pointer, documents of steps -1, 0, 1, one blob
    assert mine.latest() is None and mine.history() == []
    assert other.history() == [-1, 0]
    chain(mine, 0)  # an arm starts over after a reset
    assert mine.history() == [-1]


def test_rewind_drops_the_steps_after_the_target_newest_first(states: StateStore, spy: CrashingStore) -> None:
    s = chain(states, 3)
    spy.writes.clear()
    assert states.rewind(0) == s[1]
    assert states.latest() == s[1] and states.history() == [-1, 0]
    assert spy.writes == [  # the pointer leaves each document before it goes
        states.pointer_key,
        states.state_key(2),
        states.pointer_key,
        states.state_key(1),
    ]
    other = dataclasses.replace(advance(s[1]), cursor_position=999)  # the re-run step may differ
    states.commit(other)
    assert states.latest() == other


@pytest.mark.parametrize("crash", ["pointer", "document"])
def test_a_rewind_that_dies_midway_leaves_a_chain_and_completes_when_repeated(
    states: StateStore, spy: CrashingStore, crash: str
) -> None:
    s = chain(states, 3)
    # dies at the second move: step 2 is gone, step 1's document is still there
    spy.crash_on = states.state_key(1) if crash == "document" else None
    if crash == "pointer":
        moves = iter([False, True])  # the second pointer write dies
        real = spy._write

        def write(key: str) -> None:
            if key == states.pointer_key and next(moves):
                raise StoreError("simulated crash before moving the pointer")
            real(key)

        spy._write = write  # type: ignore[method-assign]
    with pytest.raises(StoreError, match="simulated crash"):
        states.rewind(0)
    assert states.recover() == s[2]  # a chain that reads: step 1, rolled forward onto or still named
    assert states.history() == [-1, 0, 1]
    spy.crash_on = None
    spy._write = CrashingStore._write.__get__(spy)  # type: ignore[method-assign]
    assert states.rewind(0) == s[1] and states.history() == [-1, 0]


def test_rewind_outside_the_chain_is_refused(states: StateStore) -> None:
    chain(states, 1)
    with pytest.raises(StateError, match=r"rewind .* to step 3 refused: the chain holds steps -1\.\.0"):
        states.rewind(3)
