"""Kept files read back as their dataclasses say, every field checked for its type.

What the guard keeps on disk (block/records.py) is written with dataclasses.asdict()
and read back here, from the same dataclasses' fields and type hints: a field added
to a record is read with no reader written for it. A hand edit or a corruption that
stays valid JSON is a ValueError or TypeError naming the field, never a TypeError
later, in a pass. Only what records hold is known: str, int, float (an int too),
bool (never an int, nor an int a bool), enums (by value), lists, fixed tuples,
dicts keyed by str, optional fields, nested dataclasses, and Any (kept as it is).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from collections.abc import Hashable
from typing import Any, TypeVar

T = TypeVar("T")


def names(cls: type) -> set[str]:
    """The fields a dataclass is built from."""
    return {f.name for f in dataclasses.fields(cls) if f.init}


def decode(cls: type[T], data: object, where: str = "") -> T:
    """`data` (parsed JSON) as a `cls`: each field of its type, a missing one its default
    (ValueError "no FIELD" when it has none). A key that is not a field is a TypeError:
    a caller that keeps a newer version's fields takes them out first."""
    if not isinstance(data, dict):
        raise TypeError(f"{where or cls.__name__}: {type(data).__name__}, not an object")
    hints, fields = _shape(typing.cast(Hashable, cls))
    unknown = sorted(str(k) for k in set(data) - set(fields))
    if unknown:
        raise TypeError(f"{where or cls.__name__}: no field {unknown[0]!r}")
    values = {}
    for name, f in fields.items():
        at = f"{where}.{name}" if where else name
        if name in data:
            values[name] = _value(hints[name], data[name], at)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ValueError(f"no {at}")
    return cls(**values)


@functools.cache
def _shape(cls: Hashable) -> tuple[dict[str, Any], dict[str, dataclasses.Field[Any]]]:
    """A dataclass's type hints and init fields, worked out once per class (the hints
    evaluate every annotation's text: most of a record's read, each time)."""
    fields = {f.name: f for f in dataclasses.fields(typing.cast(type, cls)) if f.init}
    return typing.get_type_hints(cls), fields


def _value(kind: Any, value: object, at: str) -> Any:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = (a for a in args if a is not type(None))
        return _value(inner, value, at)
    if origin is list:
        return [_value(args[0], v, f"{at}[{i}]") for i, v in enumerate(_of(list, value, at))]
    if origin is tuple:
        items = _of(list, value, at)
        if len(items) != len(args):
            raise TypeError(f"{at}: {len(items)} items, not {len(args)}")
        pairs = enumerate(zip(args, items, strict=True))
        return tuple(_value(k, v, f"{at}[{i}]") for i, (k, v) in pairs)
    if origin is dict:
        return {
            _value(args[0], k, at): _value(args[1], v, f"{at}.{k}")
            for k, v in _of(dict, value, at).items()
        }
    if kind is Any:
        return value
    if dataclasses.is_dataclass(kind):
        return decode(typing.cast(type, kind), value, at)
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        base = int if issubclass(kind, int) else str
        try:
            return kind(_of(base, value, at))
        except ValueError:
            raise ValueError(f"{at}: {value!r} is not a {kind.__name__}") from None
    if kind is float and type(value) is int:
        return value  # written as JSON writes a whole number
    return _of(kind, value, at)


def _of(kind: type[T], value: object, at: str) -> T:
    # Exactly that type: bool is an int to Python, not to a record.
    if type(value) is not kind:
        raise TypeError(f"{at}: {type(value).__name__}, not {kind.__name__}")
    return value
