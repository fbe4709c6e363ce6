"""Device and precision helpers: resolve ``auto``/``cpu``/``cuda`` and the autocast context."""

from __future__ import annotations

import contextlib

import torch

from mhmoe.errors import ConfigError


def resolve_device(name: str, field: str = "train.device") -> torch.device:
    """``auto`` -> CUDA when available, else CPU; ``cuda`` without a CUDA device is a ConfigError."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(field, name, "cpu (no CUDA device is available) | auto")
    if name not in ("cpu", "cuda"):
        raise ConfigError(field, name, "auto | cpu | cuda")
    return torch.device(name)


def autocast_ctx(device: torch.device, dtype: str) -> contextlib.AbstractContextManager:
    """Autocast on ``device`` to ``dtype`` (``bfloat16`` or ``float16``), else (``float32``) a no-op context."""
    half = {"bfloat16": torch.bfloat16, "float16": torch.float16}
    return torch.autocast(device.type, dtype=half.get(dtype, torch.bfloat16), enabled=dtype in half)
