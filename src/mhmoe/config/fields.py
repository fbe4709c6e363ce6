"""Validation helpers shared by the config dataclasses: one-line :class:`~mhmoe.errors.ConfigError`
naming the field, and YAML scalar coercion to the declared field types."""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

from mhmoe.errors import ConfigError, did_you_mean

INT64 = 2**63  # every integer field fits a signed 64-bit integer (torch and numpy take them as such)


def is_int(value: object) -> bool:
    """An int that is not a bool (YAML ``true`` is an int in Python)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """An int (not a bool) or a float, finite."""
    return (is_int(value) or isinstance(value, float)) and math.isfinite(value)


def check_types(obj: Any, prefix: str) -> None:
    """Check every field of dataclass ``obj`` against its declared type before any range check runs:
    ``int`` (not a bool, within int64), ``float`` (an int or a float, finite), ``float | None``,
    ``bool``, ``bool | None`` (None: decided from other fields), ``str``. Other annotations (nested
    configs, tuples) are left to the class. The error names ``prefix + field``."""
    for f in fields(obj):
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
        v, name = getattr(obj, f.name), prefix + f.name
        if kind == "int":
            check(is_int(v) and -INT64 <= v < INT64, name, v, "an integer (64-bit)")
        elif kind == "float":
            check(is_number(v), name, v, "a finite number")
        elif kind in ("float | None", "Optional[float]"):
            check(v is None or is_number(v), name, v, "null or a finite number")
        elif kind == "bool":
            check(isinstance(v, bool), name, v, "true | false")
        elif kind in ("bool | None", "Optional[bool]"):
            check(v is None or isinstance(v, bool), name, v, "null (auto) | true | false")
        elif kind == "str":
            check(isinstance(v, str), name, v, "a string")


def check(cond: bool, field: str, value: object, allowed: str) -> None:
    """Raise ``ConfigError(field, value, allowed)`` unless ``cond``."""
    if not cond:
        raise ConfigError(field, value, allowed)


def coerce_fields(cls: type, d: dict[str, Any], prefix: str) -> dict[str, Any]:
    """Check the keys of ``d`` against dataclass ``cls`` and coerce YAML scalars to the field types
    (YAML reads ``1e-3`` as a string and ``2`` as an int where a float is expected)."""
    if not isinstance(d, dict):
        raise ConfigError(prefix, d, "a mapping")
    by_name = {f.name: f for f in fields(cls)}
    out = dict(d)
    for key, value in d.items():
        if key not in by_name:
            raise ConfigError(f"{prefix}.{key}", value, "one of " + ", ".join(sorted(by_name)),
                              did_you_mean(key, by_name))
        f = by_name[key]
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
        if kind.startswith("float") and isinstance(value, (str, int)) and not isinstance(value, bool):
            try:
                out[key] = float(value)
            except (ValueError, OverflowError):
                raise ConfigError(f"{prefix}.{key}", value, "a number") from None
        elif kind == "int" and isinstance(value, float) and value.is_integer():
            out[key] = int(value)
        elif kind == "int" and isinstance(value, str):
            raise ConfigError(f"{prefix}.{key}", value, "an integer")
    return out
