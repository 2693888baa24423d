"""Strict JSON for typed payloads (rollpacker.core.serde)."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollpacker.core.serde import Message, MessageError, from_data, to_data


class Kind(enum.Enum):
    A = "a"
    B = "b"


@dataclass(frozen=True)
class Inner(Message):
    name: str
    n: int


@dataclass(frozen=True)
class Outer(Message):
    x: float
    flag: bool
    kind: Kind
    items: tuple[Inner, ...]
    pair: tuple[str, int]
    table: dict[str, float]
    maybe: Inner | None = None
    tags: tuple[str, ...] = field(default_factory=tuple)


inner = st.builds(Inner, st.text(max_size=5), st.integers(-(10**9), 10**9))
outer = st.builds(
    Outer,
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
    st.sampled_from(Kind),
    st.lists(inner, max_size=3).map(tuple),
    st.tuples(st.text(max_size=3), st.integers(0, 9)),
    st.dictionaries(st.text(max_size=4), st.floats(allow_nan=False, allow_infinity=False), max_size=3),
    st.none() | inner,
    st.lists(st.text(max_size=3), max_size=3).map(tuple),
)


@given(outer)
def test_round_trip(m: Outer) -> None:
    assert Outer.from_json(m.to_json()) == m


def _doc(**changes: object) -> str:
    data = to_data(Outer(1.0, True, Kind.A, (Inner("p", 1),), ("s", 2), {"k": 1.5}))
    data.update(changes)
    return json.dumps(data)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{", r"Outer: not JSON"),
        ("[]", r"Outer: expected an object, got list"),
        (_doc(surprise=1), r"Outer: unknown field\(s\) \['surprise'\]"),
        (json.dumps({"x": 1.0}), r"Outer: missing field 'flag'"),
        (_doc(x="1"), r"Outer\.x: expected float, got str"),
        (_doc(x=True), r"Outer\.x: expected float, got bool"),
        (_doc(flag=1), r"Outer\.flag: expected bool, got int"),
        (_doc(kind="c"), r"Outer\.kind: 'c' is not one of \['a', 'b'\]"),
        (_doc(items=[{"name": "p"}]), r"Outer\.items\[0\]: missing field 'n'"),
        (_doc(items=[{"name": "p", "n": 1.5}]), r"Outer\.items\[0\]\.n: expected int, got float"),
        (_doc(pair=["s"]), r"Outer\.pair: expected 2 items, got 1"),
        (_doc(table={"k": "x"}), r"Outer\.table\['k'\]: expected float"),
        (_doc(maybe={"name": 1, "n": 1}), r"Outer\.maybe\.name: expected str, got int"),
    ],
)
def test_a_bad_payload_names_the_field(text: str, match: str) -> None:
    with pytest.raises(MessageError, match=match):
        Outer.from_json(text)


def test_an_int_is_a_float_but_a_float_is_not_an_int() -> None:
    m = Outer.from_json(_doc(x=3))
    assert m.x == 3.0 and isinstance(m.x, float)
    assert from_data(Inner, {"name": "a", "n": 2}) == Inner("a", 2)


V = TypeVar("V", bound=Message)


@dataclass(frozen=True)
class Boxed(Message, Generic[V]):
    """A generic message: its ``value`` is read as the type it is parametrised with."""

    value: V
    note: str


@dataclass(frozen=True)
class HoldsBoxes(Message):
    inner: Boxed[Inner]
    ticket: Boxed[Outer] | None = None


def test_a_generic_message_is_read_as_its_parametrised_type() -> None:
    m = HoldsBoxes(Boxed(Inner("p", 1), "n"))
    assert HoldsBoxes.from_json(m.to_json()) == m
    assert from_data(Boxed[Inner], to_data(Boxed(Inner("q", 2), "x"))) == Boxed(Inner("q", 2), "x")
    doc = json.loads(m.to_json())
    doc["inner"]["value"]["n"] = "one"
    with pytest.raises(MessageError, match=r"HoldsBoxes\.inner\.value\.n: expected int"):
        HoldsBoxes.from_json(json.dumps(doc))
    with pytest.raises(MessageError, match=r"Boxed\.value: type ~V unknown"):
        Boxed.from_json(to_data_json(Boxed(Inner("q", 2), "x")))


def to_data_json(m: Message) -> str:
    return json.dumps(to_data(m))
