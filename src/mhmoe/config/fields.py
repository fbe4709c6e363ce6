"""Validation helpers shared by the config dataclasses: one-line :class:`~mhmoe.errors.ConfigError`
naming the field, and YAML scalar coercion to the declared field types. Types are read from the
annotations (:func:`typing.get_type_hints`): ``int``, ``float``, ``bool``, ``str``, ``X | None`` and
``Literal[...]`` options (the allowed values are the Literal's arguments)."""

from __future__ import annotations

import functools
import math
import types
import typing
from dataclasses import fields
from typing import Any, Literal, Union

from mhmoe.errors import ConfigError, did_you_mean

INT64 = 2**63  # every integer field fits a signed 64-bit integer (torch and numpy take them as such)


def is_int(value: object) -> bool:
    """An int that is not a bool (YAML ``true`` is an int in Python)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """An int (not a bool) or a float, finite."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@functools.cache
def field_types(cls: type) -> dict[str, tuple[Any, bool]]:
    """``{field: (type, optional)}`` of dataclass ``cls`` from its resolved annotations; ``X | None`` is
    ``(X, True)``."""
    out = {}
    for name, tp in typing.get_type_hints(cls).items():
        args = typing.get_args(tp)
        optional = typing.get_origin(tp) in (Union, types.UnionType) and type(None) in args
        if optional:
            rest = tuple(a for a in args if a is not type(None))
            tp = rest[0] if len(rest) == 1 else Union[rest]  # noqa: UP007 -- built from a tuple at run time
        out[name] = (tp, optional)
    return out


def literal_values(tp: Any) -> tuple[Any, ...] | None:
    """The allowed values of a ``Literal[...]`` type, else None."""
    return typing.get_args(tp) if typing.get_origin(tp) is Literal else None


def check_types(obj: Any, prefix: str) -> None:
    """Check every field of dataclass ``obj`` against its declared type before any range check runs:
    ``int`` (not a bool, within int64), ``float`` (an int or a float, finite), ``bool``, ``str``,
    ``Literal[...]`` (one of its values), each also ``| None`` (None: decided from other fields). Other
    annotations (nested configs, tuples) are left to the class. The error names ``prefix + field``."""
    cls: type = obj.__class__
    types_ = field_types(cls)
    for f in fields(obj):
        tp, optional = types_[f.name]
        v, name = getattr(obj, f.name), prefix + f.name
        if optional and v is None:
            continue
        null = "null or " if optional else ""
        if tp is int:
            check(is_int(v) and -INT64 <= v < INT64, name, v, "an integer (64-bit)")
        elif tp is float:
            check(is_number(v), name, v, f"{null}a finite number")
        elif tp is bool:
            check(isinstance(v, bool), name, v, "null (auto) | true | false" if optional else "true | false")
        elif tp is str:
            check(isinstance(v, str), name, v, "a string")
        elif (allowed := literal_values(tp)) is not None:
            check(isinstance(v, str) and v in allowed, name, v, ("null | " if optional else "") + " | ".join(allowed))


def check(cond: bool, field: str, value: object, allowed: str) -> None:
    """Raise ``ConfigError(field, value, allowed)`` unless ``cond``."""
    if not cond:
        raise ConfigError(field, value, allowed)


def coerce_fields(cls: type, d: dict[str, Any], prefix: str) -> dict[str, Any]:
    """Check the keys of ``d`` against dataclass ``cls`` and coerce YAML scalars to the field types
    (YAML reads ``1e-3`` as a string and ``2`` as an int where a float is expected)."""
    if not isinstance(d, dict):
        raise ConfigError(prefix, d, "a mapping")
    types_ = field_types(cls)
    out = dict(d)
    for key, value in d.items():
        if key not in types_:
            raise ConfigError(f"{prefix}.{key}", value, "one of " + ", ".join(sorted(types_)),
                              did_you_mean(key, types_))
        tp, _ = types_[key]
        if tp is float and isinstance(value, (str, int)) and not isinstance(value, bool):
            try:
                out[key] = float(value)
            except (ValueError, OverflowError):
                raise ConfigError(f"{prefix}.{key}", value, "a number") from None
        elif tp is int and isinstance(value, float) and value.is_integer():
            out[key] = int(value)
        elif tp is int and isinstance(value, str):
            raise ConfigError(f"{prefix}.{key}", value, "an integer")
    return out
