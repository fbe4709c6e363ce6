"""Exception types. Every user-facing error is a ``ValueError`` subclass with a one-line message
that names the offending field (or path) and what is allowed; the CLI prints it and exits 2."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def close_match(value: object, choices: Iterable[str]) -> str | None:
    """The choice closest to a misspelled ``value`` (:func:`difflib.get_close_matches`), or None."""
    found = difflib.get_close_matches(str(value), list(choices), n=1, cutoff=0.6)
    return found[0] if found else None


class ConfigError(ValueError):
    """An invalid configuration value: ``ConfigError("moe.top_k", 9, "1..8 (<= n_experts)")``; ``hint``
    (e.g. "did you mean tiny-mh3?") goes before what is allowed."""

    def __init__(self, field: str, value: object, allowed: str, hint: str = "") -> None:
        self.field, self.value, self.allowed, self.hint = field, value, allowed, hint
        super().__init__(f"invalid {field}={value!r}: " + (f"{hint} " if hint else "") + f"allowed {allowed}")


def did_you_mean(value: object, choices: Iterable[str]) -> str:
    """``"did you mean X?"`` for the closest of ``choices``, or ``""``."""
    found = close_match(value, choices)
    return f"did you mean {found}?" if found else ""


class DataError(ValueError):
    """Unusable input data (missing path, empty or binary file, too little text, ...)."""


class CheckpointError(ValueError):
    """A checkpoint that is missing, truncated or corrupted."""
