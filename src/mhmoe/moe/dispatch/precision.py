"""Compute dtype of a dispatch and PyTorch's TF32 setting for fp32 matmuls on CUDA, read without raising.

PyTorch has two APIs for TF32: the legacy flag ``torch.backends.cuda.matmul.allow_tf32`` (and
``torch.set_float32_matmul_precision``) and, since 2.9, ``torch.backends.cuda.matmul.fp32_precision``
("ieee" | "tf32" | "none" = inherit from ``torch.backends.fp32_precision``). Once anything has set the new
API (transformers does on import), *reading* the legacy flag raises "mix of the legacy and new APIs",
while the new getter always reflects whichever API was used last. So :func:`cuda_matmul_tf32` reads the
new API where it exists and the legacy one only on older torch; :func:`cuda_matmul_tf32_set` writes
through the same API it reads (never mixing them) and restores the previous value on exit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype the expert GEMMs run in: the autocast dtype of x's device when autocast is on, else x's."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def _new_api() -> bool:
    return hasattr(torch.backends.cuda.matmul, "fp32_precision")


def cuda_matmul_tf32() -> bool:
    """Whether fp32 matmuls on CUDA may use TF32 (PyTorch's setting; default False). Never raises."""
    m = torch.backends.cuda.matmul
    if _new_api():
        try:
            return m.fp32_precision == "tf32"  # "none" (nothing set anywhere) = ieee, torch's default
        except RuntimeError:  # pragma: no cover - defensive: the new getter does not check for mixing
            pass
    try:
        return bool(m.allow_tf32)
    except RuntimeError:  # legacy getter after the new API was used
        return False


@contextlib.contextmanager
def cuda_matmul_tf32_set(enabled: bool) -> Iterator[None]:
    """Within the block, fp32 CUDA matmuls use TF32 iff ``enabled``; the previous setting is restored.

    Writes through the legacy flag while the two APIs agree (its setter updates both, so they keep
    agreeing), and through the new API once something has set that one alone (legacy reads raise then).
    """
    m = torch.backends.cuda.matmul
    try:
        legacy = bool(m.allow_tf32)
    except RuntimeError:  # the new API is in use: stay with it
        old = m.fp32_precision
        m.fp32_precision = "tf32" if enabled else "ieee"
        try:
            yield
        finally:
            m.fp32_precision = old
        return
    m.allow_tf32 = enabled
    try:
        yield
    finally:
        m.allow_tf32 = legacy
