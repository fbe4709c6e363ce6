"""Exception types. Every user-facing error is a ``ValueError`` subclass with a one-line message
that names the offending field (or path) and what is allowed; the CLI prints it and exits 2."""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid configuration value: ``ConfigError("moe.top_k", 9, "1..8 (<= n_experts)")``."""

    def __init__(self, field: str, value: object, allowed: str) -> None:
        self.field, self.value, self.allowed = field, value, allowed
        super().__init__(f"invalid {field}={value!r}: allowed {allowed}")


class DataError(ValueError):
    """Unusable input data (missing path, empty or binary file, too little text, ...)."""


class CheckpointError(ValueError):
    """A checkpoint that is missing, truncated or corrupted."""
