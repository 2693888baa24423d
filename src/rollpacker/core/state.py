"""The controller's state document: everything the next RL step needs, one immutable JSON per step.

``s3://<bucket>/<experiment>/<arm>/state/step-<n>.json`` holds the state after step ``n`` was
committed; ``step = -1`` is the initial state (nothing trained yet). Nothing the next step needs
lives only in a process: the services (engine, trainer, rewards) are rebuilt from this document
when they are missing or out of date.

Invariants (tests/core/test_state.py):
- ``from_json(to_json(s)) == s`` for every valid state;
- a document of another schema version, a missing field or a wrong type is refused with a
  ``StateError`` naming the field (a corrupt state is never half-loaded);
- ``next_step`` is ``step + 1``: the step a re-run after a crash repeats is the first uncommitted one;
- ``rollback_step``, when set, names an earlier step: the one whose stored checkpoint a run that
  lost this step's in-memory weights resumes from (``checkpoint.every``);
- every field is typed (the rollout buffer as ``BufferEntry``s, the sandbox's timeout anchors as
  (test case, seconds) pairs): no JSON inside the JSON; a schema-1 document (anchors as a JSON
  string) is read and upgraded.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from rollpacker.core.errors import PolicyError, RollpackerError
from rollpacker.core.policies.entries import BufferEntry
from rollpacker.core.types import RoundKind

SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: timeout_anchors was AdaptiveTimeout.to_json() text


class StateError(RollpackerError):
    """A state document is missing, corrupt, or does not follow its predecessor."""


@dataclass(frozen=True)
class TPPlan:
    """The tensor-parallel sizes of short and long rounds and the step history they follow from
    (``core.planner.replay`` of ``zip(round_kinds, preemption_history)``)."""

    short_tp: int = 1
    long_tp: int = 1
    preemption_history: tuple[int, ...] = ()  # KV-cache preemptions per committed step
    round_kinds: tuple[RoundKind, ...] = ()  # the round kind of each of those steps
    initial_tp: int = 0  # where the replay starts: the profiled best TP (0 = planner.initial_tp)

    def __post_init__(self) -> None:
        if len(self.round_kinds) != len(self.preemption_history):
            raise StateError(
                f"tp_plan: {len(self.round_kinds)} round kinds for {len(self.preemption_history)} "
                "preemption counts; each committed step adds one of each"
            )

    @property
    def history(self) -> tuple[tuple[RoundKind, int], ...]:
        return tuple(zip(self.round_kinds, self.preemption_history, strict=True))


@dataclass(frozen=True)
class ControllerState:
    experiment: str
    arm: str
    step: int  # the last committed step; -1 before the first
    cursor_seed: int
    cursor_epoch: int
    cursor_position: int
    long_queue: tuple[str, ...] = ()  # prompt ids, FIFO
    # the rollout buffer of SortedRL / partial rollout: waiting prompts and their cached responses
    partial_cache: tuple[BufferEntry, ...] = ()
    tp_plan: TPPlan = field(default_factory=TPPlan)
    # the code sandbox's adaptive-timeout anchors: (test case, seconds), sorted by test case
    timeout_anchors: tuple[tuple[str, float], ...] = ()
    length_history: tuple[tuple[str, int], ...] = ()  # (prompt id, longest response) per trained prompt
    checkpoint_uri: str = ""  # the policy the next step rolls out with
    policy_version: int = 0
    # a step between checkpoints (``checkpoint.every``): its weights (``checkpoint_uri`` names
    # them) live only in the trainer's and the engine's memory, and this is the last committed step
    # whose checkpoint is in the store, the state a run that lost them rolls back to; None: the
    # weights at ``checkpoint_uri`` are in the store
    rollback_step: int | None = None
    profile_uri: str = ""
    profile_drift: float = 0.0  # last step: |predicted - measured| / measured decode time
    # one-off pipeline: the rewarded samples of the last step, trained at the next one
    pending_batch_uri: str = ""
    seed: int = 0
    trained_samples: int = 0
    trained_prompts: int = 0
    mlflow_run_id: str = ""
    schema_version: int = SCHEMA_VERSION

    @property
    def next_step(self) -> int:
        return self.step + 1

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["partial_cache"] = [e.to_dict() for e in self.partial_cache]
        return json.dumps(data, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str = "state") -> ControllerState:
        try:
            data = json.loads(text)
        except ValueError as e:
            raise StateError(f"{where}: not JSON ({e}); restore the document from the previous step") from e
        if not isinstance(data, dict):
            raise StateError(f"{where}: expected a JSON object, got {type(data).__name__}")
        version = data.get("schema_version")
        if version not in READABLE_VERSIONS:
            raise StateError(
                f"{where}: schema_version {version!r}, this rollpacker reads {SCHEMA_VERSION}; "
                "use the rollpacker version that wrote it"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise StateError(f"{where}: unknown field(s) {unknown}; the document is not a rollpacker state")
        required = [
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        for name in required:
            if name not in data:
                raise StateError(f"{where}: missing field {name!r}")
        try:
            tp = data.get("tp_plan", {})
            kw = dict(data)
            kw["tp_plan"] = TPPlan(
                short_tp=_int(tp, "short_tp", where),
                long_tp=_int(tp, "long_tp", where),
                preemption_history=tuple(int(x) for x in tp.get("preemption_history", ())),
                round_kinds=_round_kinds(tp.get("round_kinds", ())),
                initial_tp=int(tp.get("initial_tp", 0)),
            )
            kw["profile_drift"] = float(data.get("profile_drift", 0.0))

            kw["long_queue"] = tuple(str(x) for x in _list(data, "long_queue", where))
            kw["partial_cache"] = tuple(
                BufferEntry.from_dict(x, f"partial_cache[{i}]")
                for i, x in enumerate(_list(data, "partial_cache", where))
            )
            kw["timeout_anchors"] = _anchors(data.get("timeout_anchors", []), version)
            kw["schema_version"] = SCHEMA_VERSION
            kw["length_history"] = tuple((str(p), int(n)) for p, n in _list(data, "length_history", where))
        except (StateError, PolicyError) as e:
            raise StateError(f"{where}: {e}") from e
        except (TypeError, ValueError) as e:
            raise StateError(f"{where}: malformed field ({e})") from e
        for name in ("step", "cursor_seed", "cursor_epoch", "cursor_position", "policy_version", "seed"):
            if name in kw and (not isinstance(kw[name], int) or isinstance(kw[name], bool)):
                raise StateError(f"{where}: field {name!r} = {kw[name]!r} must be an integer")
        if kw.get("step", 0) < -1:
            raise StateError(f"{where}: step {kw['step']} < -1 (-1 is the initial state)")
        back = kw.get("rollback_step")
        if back is not None and (
            not isinstance(back, int) or isinstance(back, bool) or not -1 <= back < kw.get("step", 0)
        ):
            raise StateError(
                f"{where}: field 'rollback_step' = {back!r} must be null or a step before this one"
            )
        for name in ("experiment", "arm", "checkpoint_uri", "profile_uri", "pending_batch_uri"):
            if name in kw and not isinstance(kw[name], str):
                raise StateError(f"{where}: field {name!r} = {kw[name]!r} must be a string")
        return cls(**kw)

    def successor(self, **changes: Any) -> ControllerState:
        """The state after the next step: ``step`` advanced by one and ``changes`` applied."""
        return dataclasses.replace(self, step=self.step + 1, **changes)


def _round_kinds(data: Any) -> tuple[RoundKind, ...]:
    """``tp_plan.round_kinds``: each one a known round kind, or a ``StateError`` naming it."""
    out = []
    for i, x in enumerate(data):
        try:
            out.append(RoundKind(x))
        except ValueError:
            known = ", ".join(repr(k.value) for k in RoundKind)
            raise StateError(f"field 'tp_plan.round_kinds[{i}]' = {x!r}: not one of {known}") from None
    return tuple(out)


def _int(d: Any, key: str, where: str) -> int:
    v = d.get(key, 1) if isinstance(d, dict) else None
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise StateError(f"{where}: tp_plan.{key} = {v!r} must be a positive integer")
    return v


def _list(d: dict[str, Any], key: str, where: str) -> list[Any]:
    v = d.get(key, [])
    if not isinstance(v, list):
        raise StateError(f"{where}: field {key!r} must be a list, got {type(v).__name__}")
    return v


def _anchors(value: Any, version: int) -> tuple[tuple[str, float], ...]:
    """The timeout anchors as sorted (test case, seconds) pairs; schema 1 kept them as the text of
    ``AdaptiveTimeout.to_json()`` ("" = none)."""
    if version == 1:
        if not isinstance(value, str):
            raise StateError("field 'timeout_anchors' of a schema-1 document must be a string")
        if not value:
            return ()
        doc = json.loads(value)
        value = sorted(doc["anchors"].items()) if isinstance(doc, dict) else None
    if not isinstance(value, list):
        raise StateError(f"field 'timeout_anchors' must be a list of [test case, seconds], got {value!r}")
    pairs = []
    for item in value:
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str)):
            raise StateError(f"field 'timeout_anchors': {item!r} is not [test case, seconds]")
        pairs.append((item[0], float(item[1])))
    return tuple(sorted(pairs))
