"""The controller state document (rollpacker.core.state): round trip and refusal of bad documents."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollpacker.core.policies.entries import BufferEntry, CachedSample
from rollpacker.core.state import SCHEMA_VERSION, ControllerState, StateError, TPPlan

names = st.text(min_size=1, max_size=12)
ints = st.integers(min_value=0, max_value=2**40)
json_scalars = st.none() | st.booleans() | st.integers(-(2**31), 2**31) | st.text(max_size=8)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)

states = st.builds(
    ControllerState,
    experiment=names,
    arm=names,
    step=st.integers(min_value=-1, max_value=10**6),
    cursor_seed=ints,
    cursor_epoch=ints,
    cursor_position=ints,
    long_queue=st.lists(names, max_size=6).map(tuple),
    partial_cache=st.lists(
        st.builds(
            lambda pid, step, n: BufferEntry(
                pid, step, tuple(CachedSample(i, (1,) * i, (-0.5,) * i, (step,) * i) for i in range(n))
            ),
            names,
            st.integers(0, 50),
            st.integers(0, 3),
        ),
        max_size=3,
    ).map(tuple),
    tp_plan=st.builds(
        lambda short, long, hist, init: TPPlan(
            short, long, tuple(p for _, p in hist), tuple(k for k, _ in hist), init
        ),
        st.integers(1, 8),
        st.integers(1, 8),
        st.lists(
            st.tuples(st.sampled_from(["short", "long", "standard"]), st.integers(0, 10**6)), max_size=5
        ),
        st.sampled_from([0, 1, 2, 4]),
    ),
    timeout_anchors=st.dictionaries(names, st.floats(0, 100, allow_nan=False), max_size=4).map(
        lambda d: tuple(sorted(d.items()))
    ),
    length_history=st.lists(st.tuples(names, st.integers(0, 10**5)), max_size=5).map(tuple),
    checkpoint_uri=st.text(max_size=30),
    policy_version=ints,
    profile_uri=st.text(max_size=30),
    profile_drift=st.floats(0, 10, allow_nan=False),
    seed=ints,
    trained_samples=ints,
    trained_prompts=ints,
    mlflow_run_id=st.text(max_size=12),
)


@settings(max_examples=150, deadline=None)
@given(states)
def test_round_trip(s: ControllerState) -> None:
    text = s.to_json()
    assert ControllerState.from_json(text) == s
    assert ControllerState.from_json(text).to_json() == text  # byte-stable: re-commits compare equal


def base() -> ControllerState:
    return ControllerState(experiment="e", arm="a", step=-1, cursor_seed=1, cursor_epoch=0, cursor_position=0)


def doc(**changes: Any) -> str:
    data = json.loads(base().to_json())
    for k, v in changes.items():
        if v is _DELETE:
            del data[k]
        else:
            data[k] = v
    return json.dumps(data)


_DELETE = object()


def test_next_step_and_successor() -> None:
    s = base()
    assert s.next_step == 0
    t = s.successor(cursor_position=8, long_queue=("p1",))
    assert (t.step, t.next_step, t.cursor_position, t.long_queue) == (0, 1, 8, ("p1",))
    assert t.experiment == s.experiment and t.seed == s.seed


def test_minimal_document_takes_the_defaults() -> None:
    minimal = json.dumps(
        {
            "experiment": "e",
            "arm": "a",
            "step": 3,
            "cursor_seed": 1,
            "cursor_epoch": 0,
            "cursor_position": 5,
            "schema_version": SCHEMA_VERSION,
        }
    )
    s = ControllerState.from_json(minimal)
    assert s.step == 3 and s.tp_plan == TPPlan() and s.long_queue == () and s.checkpoint_uri == ""


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        (doc(schema_version=3), "schema_version 3"),
        (doc(schema_version=_DELETE), "schema_version None"),
        (doc(surprise=1), r"unknown field\(s\) \['surprise'\]"),
        (doc(step=_DELETE), "missing field 'step'"),
        (doc(experiment=_DELETE), "missing field 'experiment'"),
        (doc(step="3"), "field 'step' = '3' must be an integer"),
        (doc(step=True), "field 'step' = True must be an integer"),
        (doc(cursor_position=1.5), "field 'cursor_position' = 1.5 must be an integer"),
        (doc(arm=7), "field 'arm' = 7 must be a string"),
        (doc(checkpoint_uri=None), "field 'checkpoint_uri' = None must be a string"),
        (doc(tp_plan={"short_tp": 0, "long_tp": 1}), "tp_plan.short_tp = 0 must be a positive integer"),
        (doc(tp_plan={"short_tp": 1, "long_tp": "2"}), "tp_plan.long_tp = '2' must be a positive integer"),
        (doc(long_queue="p1"), "field 'long_queue' must be a list, got str"),
        (doc(length_history=[["p1"]]), "malformed field"),
        (doc(partial_cache=[1]), r"partial_cache\[0\]: a buffer entry must be an object"),
        (doc(timeout_anchors="{}"), "timeout_anchors' must be a list"),
        (doc(timeout_anchors=[["case", "x"]]), "malformed field"),
        (doc(rollback_step=-1), "'rollback_step' = -1 must be null or a step before this one"),
        (doc(rollback_step="0", step=3), "'rollback_step' = '0' must be null"),
    ],
)
def test_bad_documents_raise_state_error(text: str, match: str) -> None:
    with pytest.raises(StateError, match=match):
        ControllerState.from_json(text, where="s3://b/e/a/state/step-000003.json")


def test_error_names_where_the_document_came_from() -> None:
    with pytest.raises(StateError, match=r"^s3://b/x\.json: "):
        ControllerState.from_json("{", where="s3://b/x.json")


def test_a_tp_history_with_a_kind_missing_is_refused() -> None:
    with pytest.raises(StateError, match="round kinds"):
        TPPlan(preemption_history=(3,))
    doc = json.loads(ControllerState("e", "a", 0, 0, 0, 0).to_json())
    doc["tp_plan"]["preemption_history"] = [1, 2]
    doc["tp_plan"]["round_kinds"] = ["short"]
    with pytest.raises(StateError, match="tp_plan"):
        ControllerState.from_json(json.dumps(doc))


def test_a_schema_1_document_is_upgraded() -> None:
    """Schema 1 kept the sandbox's timeout anchors as AdaptiveTimeout.to_json() text."""
    old = json.loads(base().to_json())
    old["schema_version"] = 1
    old["timeout_anchors"] = json.dumps(
        {"config": {"adaptive": True, "lam": 1.5, "t_min_s": 2, "t_max_s": 30}, "anchors": {"b": 2.0, "a": 1}}
    )
    s = ControllerState.from_json(json.dumps(old))
    assert s.timeout_anchors == (("a", 1.0), ("b", 2.0)) and s.schema_version == SCHEMA_VERSION
    old["timeout_anchors"] = ""
    assert ControllerState.from_json(json.dumps(old)).timeout_anchors == ()


def test_a_step_between_checkpoints_names_the_step_it_rolls_back_to() -> None:
    s = base().successor().successor(rollback_step=-1)  # step 1, the last stored checkpoint at -1
    assert ControllerState.from_json(s.to_json()) == s and s.rollback_step == -1
    assert base().successor().rollback_step is None  # a stored checkpoint: nothing to roll back to
