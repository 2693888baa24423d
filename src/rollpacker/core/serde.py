"""Strict JSON for the frozen dataclasses that cross a stage, service or process edge.

``to_data`` turns a message into JSON-able data; ``from_data`` rebuilds it from data, checking
every field against the dataclass's type hints. A message type inherits ``Message`` to get
``to_json`` / ``from_json``.

Supported field types: ``bool``, ``int``, ``float``, ``str``, enums (by value), nested
dataclasses, ``tuple[X, ...]``, ``tuple[X, Y]``, ``dict[str, X]`` and ``X | None``. A generic
dataclass is read through its parametrised type (``Collected[RoundReport]``): a field typed with
the class's own type variable is read as the argument given for it.

Invariants (tests/core/test_serde.py):
- ``from_json(to_json(m)) == m`` for every message;
- a missing field, an unknown field or a wrong type is refused with a ``MessageError`` that names
  the message and the field's path (``RolloutOutput.round.metrics['rollout/time_s']``); a message is
  never half-read;
- ``bool`` is not accepted where an ``int`` or ``float`` is due; an ``int`` is accepted as ``float``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import types
import typing
from typing import Any, TypeVar, Union

from rollpacker.core.errors import RollpackerError

T = TypeVar("T")
M = TypeVar("M", bound="Message")


class MessageError(RollpackerError):
    """A payload between stages, services or processes is malformed: it names the field."""


def to_data(obj: Any) -> Any:
    """JSON-able data of a dataclass (recursively); enums by value, tuples as lists."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_data(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (tuple, list)):
        return [to_data(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): to_data(v) for k, v in obj.items()}
    return obj


@functools.lru_cache(maxsize=256)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def from_data(cls: type[T], data: Any, where: str = "") -> T:
    """``cls`` rebuilt from ``data``; raises ``MessageError`` naming the first bad field."""
    return typing.cast(T, _read(cls, data, where or cls.__name__))


def _read_dataclass(cls: type, data: Any, where: str, bound: dict[Any, Any] | None = None) -> Any:
    if not isinstance(data, dict):
        raise MessageError(f"{where}: expected an object, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise MessageError(f"{where}: unknown field(s) {unknown}; known: {sorted(fields)}")
    hints = _hints(cls)
    kw: dict[str, Any] = {}
    for name, f in fields.items():
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise MessageError(f"{where}: missing field {name!r}")
            continue
        hint = hints[name]
        if isinstance(hint, TypeVar):
            if bound is None or hint not in bound:
                raise MessageError(f"{where}.{name}: type {hint} unknown; read {cls.__name__}[...] instead")
            hint = bound[hint]
        kw[name] = _read(hint, data[name], f"{where}.{name}")
    try:
        return cls(**kw)
    except (TypeError, ValueError) as e:
        raise MessageError(f"{where}: {e}") from e


def _read(tp: Any, data: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _read_dataclass(tp, data, where)
    if dataclasses.is_dataclass(origin) and isinstance(origin, type):  # a generic message, parametrised
        params = getattr(origin, "__parameters__", ())
        return _read_dataclass(origin, data, where, dict(zip(params, typing.get_args(tp), strict=True)))
    if origin in (Union, types.UnionType):
        return _read_union(typing.get_args(tp), data, where)
    if origin is tuple:
        return _read_tuple(typing.get_args(tp), data, where)
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        if not isinstance(data, dict):
            raise MessageError(f"{where}: expected an object, got {type(data).__name__}")
        return {
            _read(key_tp, k, f"{where} key"): _read(val_tp, v, f"{where}[{k!r}]") for k, v in data.items()
        }
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(data)
        except ValueError:
            allowed = [m.value for m in tp]
            raise MessageError(f"{where}: {data!r} is not one of {allowed}") from None
    if tp is Any:
        return data
    return _read_scalar(tp, data, where)


def _read_union(args: tuple[Any, ...], data: Any, where: str) -> Any:
    if data is None and type(None) in args:
        return None
    errors = []
    for a in args:
        if a is type(None):
            continue
        try:
            return _read(a, data, where)
        except MessageError as e:
            errors.append(str(e))
    raise MessageError(errors[0] if len(errors) == 1 else f"{where}: {data!r} fits none of {args}")


def _read_tuple(args: tuple[Any, ...], data: Any, where: str) -> tuple[Any, ...]:
    if not isinstance(data, list):
        raise MessageError(f"{where}: expected a list, got {type(data).__name__}")
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(_read(args[0], x, f"{where}[{i}]") for i, x in enumerate(data))
    if len(args) != len(data):
        raise MessageError(f"{where}: expected {len(args)} items, got {len(data)}")
    return tuple(_read(a, x, f"{where}[{i}]") for i, (a, x) in enumerate(zip(args, data, strict=True)))


def _read_scalar(tp: Any, data: Any, where: str) -> Any:
    if tp is float:
        if isinstance(data, (int, float)) and not isinstance(data, bool):
            return float(data)
    elif tp is int:
        if isinstance(data, int) and not isinstance(data, bool):
            return data
    elif tp in (str, bool):
        if isinstance(data, tp):
            return data
    else:
        raise MessageError(f"{where}: unsupported field type {tp!r}")
    raise MessageError(f"{where}: expected {tp.__name__}, got {type(data).__name__} {data!r}"[:300])


class Message:
    """Mixin for a frozen dataclass payload: strict ``to_json`` / ``from_json``."""

    def to_json(self) -> str:
        return json.dumps(to_data(self), sort_keys=True)

    @classmethod
    def from_json(cls: type[M], text: str, where: str = "") -> M:
        name = where or cls.__name__
        try:
            data = json.loads(text)
        except (TypeError, ValueError) as e:
            raise MessageError(f"{name}: not JSON ({e}); was it written by this rollpacker?") from e
        return from_data(cls, data, name)
