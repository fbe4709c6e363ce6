"""Exception types and the one-line message helper. Every user-facing error is a ``ValueError``
subclass with a one-line message that names the offending field (or path) and what is allowed; the
CLI prints it and exits 2 (:class:`NoSpaceError`: exit 74). Messages never embed an unbounded value:
values are shown through :func:`bounded_repr`, foreign exception texts through :func:`one_line`."""

from __future__ import annotations

import difflib
import reprlib
from collections.abc import Iterable

#: longest text :func:`one_line` and :func:`bounded_repr` return (characters)
MAX_CHARS = 300

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 120, 120
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = _REPR.maxfrozenset = _REPR.maxdeque = 12


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def bounded_repr(value: object, limit: int = MAX_CHARS) -> str:
    """``repr(value)`` cut to at most ``limit`` characters, in work bounded by a constant whatever the
    value's size (``reprlib``: at most 12 items per container, 3 levels, 120 characters per string);
    small values read exactly as ``repr``."""
    try:
        return _cut(_REPR.repr(value), limit)
    except Exception:  # noqa: BLE001 -- a value whose repr fails (e.g. an int beyond the digit limit)
        return f"<{type(value).__name__}>"


def one_line(message: object, limit: int = MAX_CHARS) -> str:
    """The first non-empty line of a message or exception, stripped and cut to ``limit`` characters;
    an exception without text gives its class name. The one way mhmoe shortens foreign messages."""
    text = str(message)[:64 * limit]  # a huge message is never split whole
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    if not line and isinstance(message, BaseException):
        line = type(message).__name__
    return _cut(line, limit)


def close_match(value: object, choices: Iterable[str]) -> str | None:
    """The choice closest to a misspelled ``value`` (:func:`difflib.get_close_matches`), or None."""
    found = difflib.get_close_matches(_cut(str(value), MAX_CHARS), list(choices), n=1, cutoff=0.6)
    return found[0] if found else None


def did_you_mean(value: object, choices: Iterable[str]) -> str:
    """``"did you mean X?"`` for the closest of ``choices``, or ``""``."""
    found = close_match(value, choices)
    return f"did you mean {found}?" if found else ""


class ConfigError(ValueError):
    """An invalid configuration value: ``ConfigError("moe.top_k", 9, "1..8 (<= n_experts)")``; ``hint``
    (e.g. "did you mean tiny-mh3?") goes before what is allowed."""

    def __init__(self, field: str, value: object, allowed: str, hint: str = "") -> None:
        self.field, self.value, self.allowed, self.hint = field, value, allowed, hint
        super().__init__(f"invalid {field}={bounded_repr(value)}: " + (f"{hint} " if hint else "")
                         + f"allowed {allowed}")


class DataError(ValueError):
    """Unusable input data (missing path, empty or binary file, too little text, ...)."""


class CheckpointError(ValueError):
    """A checkpoint that is missing, truncated or corrupted."""


class UnsafePathError(ValueError):
    """A path mhmoe would write through is a symlink (or a symlinked directory) inside a run, export or
    cache directory: refused, never followed."""


class TrainingStopped(RuntimeError):
    """A training stopped by its own rule (too many non-finite steps in a row, or all of them): the CLI
    prints the message and exits with status 1. Any other RuntimeError is not this."""


class NoSpaceError(OSError):
    """The disk (or the file-size limit, or the quota) ran out while writing; ``errno`` is ENOSPC, EFBIG
    or EDQUOT. The CLI prints the message and exits with :data:`NO_SPACE_EXIT`."""


#: exit status of the CLI for :class:`NoSpaceError` (``EX_IOERR`` of sysexits.h)
NO_SPACE_EXIT = 74
