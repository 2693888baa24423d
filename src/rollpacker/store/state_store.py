"""The controller's state between steps: one immutable document per step and a pointer to the newest.

Layout of one arm (the store's URI prefix, ``s3://<bucket>/`` or ``file://<root>/``, omitted)::

    <experiment>/<arm>/state/step-<n:06d>.json     ControllerState after step n (step -1: "step--00001")
    <experiment>/<arm>/state/LATEST.json           {"step": n, "key": "<the doc's key>"}
    <experiment>/<arm>/steps/step-<n:06d>/<name>   large per-step data (attempt outputs, reward shards)
    <experiment>/<arm>/ckpt/step-<n:06d>/          the checkpoint step n trained

The chain starts with :meth:`StateStore.init` of the initial state (``step = -1``, nothing trained)
and grows by :meth:`StateStore.commit`, one step at a time.

A commit writes the step document first and moves the pointer second; the step counts as committed
once its document is written (documents are immutable), and the pointer is how readers find it.

- A step that dies before its commit leaves document and pointer on the previous step: re-running
  it is safe.
- A commit that dies between the two writes leaves a document one past the pointer. Re-running
  the commit with the same state completes it (only the pointer moves). :meth:`StateStore.recover`
  rolls the pointer forward onto such a document, so a re-run of the *step* resumes after it instead
  of redoing it; the controller calls it before planning.

Invariants (tests/store/test_state_store.py):
- the pointer only ever names a document that exists, and moves only after it is written;
- ``commit(s)`` is accepted only for ``s.step == latest.step + 1``: no gaps, no rewrites;
- a step document, once written, never changes: a different state for a written step is refused,
  the same state again is an idempotent no-op;
- a missing or corrupt document or pointer raises ``StateError`` saying what to do, never ``None``.
- ``rewind(k)`` removes the documents after ``k`` newest first, the pointer moved off each
  before it goes: a crash during it leaves a chain ``recover`` reads.
"""

from __future__ import annotations

import json
import re
from pathlib import PurePosixPath

from rollpacker.core.state import ControllerState, StateError
from rollpacker.store.base import ObjectStore, StoreError

INITIAL_STEP = -1
_DOC = re.compile(r"step-(-?\d+)\.json")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class StateStore:
    """The state documents of one arm of one experiment, in any :class:`ObjectStore` (S3 or file).
    The pointer move is atomic because the port's ``put_bytes`` is (see its Contract)."""

    def __init__(self, store: ObjectStore, experiment: str, arm: str) -> None:
        for what, value in (("experiment", experiment), ("arm", arm)):
            if not isinstance(value, str) or not _NAME.fullmatch(value):
                raise StateError(
                    f"{what} = {value!r}: use letters, digits, '.', '_' or '-' (it becomes a key prefix)"
                )
        self.store = store
        self.experiment = experiment
        self.arm = arm
        self.prefix = f"{experiment}/{arm}/"

    # -- keys ------------------------------------------------------------------------------------

    def state_key(self, step: int) -> str:
        return f"{self.prefix}state/step-{step:06d}.json"

    @property
    def pointer_key(self) -> str:
        return f"{self.prefix}state/LATEST.json"

    def blob_key(self, step: int, name: str) -> str:
        """Key of a large per-step object (``name`` may hold ``/``: ``attempt-1/rollout.jsonl``)."""
        parts = PurePosixPath(name).parts if isinstance(name, str) else ()
        if not parts or name.startswith("/") or any(p in ("..", ".") for p in parts):
            raise StateError(f"blob name {name!r}: use a relative name like 'rollout.jsonl'")
        return f"{self.prefix}steps/step-{step:06d}/{name}"

    def checkpoint_prefix(self, step: int) -> str:
        """Key prefix (ending in ``/``) of the checkpoint step ``step`` trained."""
        return f"{self.prefix}ckpt/step-{step:06d}/"

    def export_prefix(self, step: int, attempt: str) -> str:
        """Key prefix of step ``step``'s Hugging Face export (``checkpoint.export_every``): outside
        ``ckpt/``, so the commit's collection never deletes it."""
        return f"{self.prefix}export/step-{step:06d}-{attempt}/"

    def checkpoint_uri(self, step: int) -> str:
        return self.store.uri(self.checkpoint_prefix(step))

    # -- reading ---------------------------------------------------------------------------------

    def latest_step(self) -> int | None:
        """The step the pointer names, or None before ``init``."""
        if not self.store.exists(self.pointer_key):
            return None
        try:
            ptr = json.loads(self.store.get_bytes(self.pointer_key))
        except ValueError as e:
            raise self._bad_pointer(f"not JSON ({e})") from e
        if not isinstance(ptr, dict):
            raise self._bad_pointer(f"expected a JSON object, got {type(ptr).__name__}")
        step, key = ptr.get("step"), ptr.get("key")
        if not isinstance(step, int) or isinstance(step, bool) or step < INITIAL_STEP:
            raise self._bad_pointer(f"'step' = {step!r} is not a step number")
        if key != self.state_key(step):
            raise self._bad_pointer(f"'key' = {key!r} is not the key of step {step} ({self.state_key(step)})")
        return step

    def latest(self) -> ControllerState | None:
        """The newest committed state (the pointer's), or None before ``init``."""
        step = self.latest_step()
        if step is None:
            return None
        if not self.store.exists(self.state_key(step)):
            raise StateError(
                f"{self.store.uri(self.pointer_key)} names step {step}, but "
                f"{self.store.uri(self.state_key(step))} is missing; restore that document, or point "
                f"LATEST.json at an earlier step (committed: {self.history()}), or start the arm over "
                "with `rollpacker run --fresh`"
            )
        return self.load(step)

    def load(self, step: int) -> ControllerState:
        """The state committed for ``step``."""
        key = self.state_key(step)
        uri = self.store.uri(key)
        try:
            text = self.store.get_bytes(key).decode("utf-8")
        except StoreError as e:
            if not self.store.exists(key):
                raise StateError(
                    f"step {step} of {self.experiment}/{self.arm} was never committed (no {uri})"
                ) from e
            raise
        except UnicodeDecodeError as e:
            raise StateError(f"{uri}: not UTF-8 text ({e}); restore the document from a backup") from e
        state = ControllerState.from_json(text, where=uri)
        if (state.step, state.experiment, state.arm) != (step, self.experiment, self.arm):
            raise StateError(
                f"{uri}: holds step {state.step} of {state.experiment}/{state.arm}, not step {step} of "
                f"{self.experiment}/{self.arm}; the document was copied to the wrong place"
            )
        return state

    def history(self) -> list[int]:
        """The steps that have a document, ascending (including one past the pointer, if any)."""
        steps = []
        for key in self.store.list(f"{self.prefix}state/"):
            m = _DOC.fullmatch(key.rsplit("/", 1)[-1])
            if m:
                steps.append(int(m.group(1)))
        return sorted(steps)

    # -- writing ---------------------------------------------------------------------------------

    def init(self, state: ControllerState) -> str:
        """Store the initial state (``step = -1``) of a new arm. Idempotent for the same state;
        refused when the arm already holds a different or a later state."""
        if state.step != INITIAL_STEP:
            raise StateError(f"init: the initial state has step {INITIAL_STEP}, got step {state.step}")
        latest = self.latest_step()
        if latest is not None and latest > INITIAL_STEP:
            raise StateError(
                f"init of {self.experiment}/{self.arm} refused: it already holds step {latest}; resume "
                "from latest(), or start the arm over with `rollpacker run --fresh`"
            )
        return self.commit(state)

    def commit(self, state: ControllerState) -> str:
        """Append ``state`` to the chain: write its document, then move the pointer. Returns the
        document's URI.

        Accepted when ``state.step`` is the pointer's step + 1 (or -1 on an empty arm). The same
        state again (a re-run commit) is a no-op that completes a half-done commit; anything else
        (a gap, a different state for a written step, another experiment's state) is refused."""
        self._check_owner(state)
        key = self.state_key(state.step)
        uri = self.store.uri(key)
        text = state.to_json()
        current = self.latest()  # also checks that the pointer's document is there and sound
        latest = None if current is None else current.step
        if latest is not None and state.step <= latest:
            if self._same_doc(key, text):
                return uri  # this commit already happened
            raise StateError(
                f"step {state.step} already committed at {uri} with different content (the latest "
                f"committed step is {latest}); plan the next step from `latest()` instead of rewriting one"
            )
        expected = INITIAL_STEP if latest is None else latest + 1
        if state.step != expected:
            what = (
                "no state yet: init() the initial state (step -1) first"
                if latest is None
                else (f"the latest committed step is {latest}, so the next commit must be step {expected}")
            )
            raise StateError(f"commit of step {state.step} refused: {what}")
        if self.store.exists(key):
            if not self._same_doc(key, text):
                raise StateError(
                    f"step {state.step} already committed at {uri} with different content (an earlier "
                    "commit wrote it and died before moving LATEST.json); call recover() to continue "
                    "from it, or delete it to redo the step"
                )
        else:
            self.store.put_bytes(key, text.encode(), "application/json")
        self.store.put_json(self.pointer_key, {"step": state.step, "key": key})
        return uri

    def recover(self) -> ControllerState | None:
        """Finish a commit that died between writing its document and moving the pointer: when the
        document of the pointer's step + 1 exists and is valid, move the pointer onto it. Returns
        the (possibly advanced) latest state."""
        latest = self.latest()
        nxt = INITIAL_STEP if latest is None else latest.step + 1
        if not self.store.exists(self.state_key(nxt)):
            return latest
        state = self.load(nxt)
        self.store.put_json(self.pointer_key, {"step": state.step, "key": self.state_key(nxt)})
        return state

    def rewind(self, step: int) -> ControllerState:
        """Roll the chain back to committed step ``step``: the documents after it are deleted, the
        newest first, each after the pointer has moved off it (``checkpoint.every``: the steps
        after the last stored checkpoint, whose weights were lost, run again). Crash-safe: the
        pointer always names a document, and at most the document one past it is left, which
        ``recover`` rolls forward onto; the caller then rewinds again. Returns ``step``'s state."""
        latest = self.latest()
        if latest is None or not INITIAL_STEP <= step <= latest.step:
            raise StateError(
                f"rewind of {self.experiment}/{self.arm} to step {step} refused: the chain holds steps "
                f"{INITIAL_STEP}..{None if latest is None else latest.step}"
            )
        self.load(step)  # the target is there and sound before anything is deleted
        for s in range(latest.step, step, -1):
            self.store.put_json(self.pointer_key, {"step": s - 1, "key": self.state_key(s - 1)})
            self.store.delete(self.state_key(s))
        return self.load(step)

    def reset(self) -> int:
        """Delete everything of this arm (states, blobs, checkpoints); returns the object count.
        ``rollpacker run --fresh`` starts over with this."""
        return self.store.delete_prefix(self.prefix)

    # -- blobs -----------------------------------------------------------------------------------

    def put_blob(self, step: int, name: str, data: bytes) -> str:
        return self.store.put_bytes(self.blob_key(step, name), data)

    def get_blob(self, step: int, name: str) -> bytes:
        return self.store.get_bytes(self.blob_key(step, name))

    # -- helpers ---------------------------------------------------------------------------------

    def _check_owner(self, state: ControllerState) -> None:
        if (state.experiment, state.arm) != (self.experiment, self.arm):
            raise StateError(
                f"state of {state.experiment}/{state.arm} given to the state store of "
                f"{self.experiment}/{self.arm}"
            )
        if state.step < INITIAL_STEP:
            raise StateError(f"step {state.step}: steps start at {INITIAL_STEP} (the initial state)")

    def _same_doc(self, key: str, text: str) -> bool:
        if not self.store.exists(key):
            return False
        return self.store.get_bytes(key).decode("utf-8", errors="replace") == text

    def _bad_pointer(self, detail: str) -> StateError:
        return StateError(
            f"{self.store.uri(self.pointer_key)} is corrupt: {detail}; rewrite it as "
            '{"step": N, "key": "<the key of step N>"} for the newest good step document '
            "(history() lists them), or start the arm over with `rollpacker run --fresh`"
        )
