"""Keep freed CPU memory in the process: glibc ``malloc`` tuning for large-tensor workloads.

PyTorch's CPU allocator is the C library's ``malloc``. glibc serves every request above its mmap
threshold (at most 32 MB) with a fresh ``mmap`` and returns it to the OS on ``free``, so a training
step whose activations are hundreds of MB (MH-MoE hidden tensors: routed rows x expert width)
page-faults and zero-fills every one of them again on every step. Measured on the 2-core CPU
(docs/PERFORMANCE.md, "CPU allocator"): the h=8 ICML-parity model's training step takes 10.8 s
with default glibc and 5.6 s with :func:`tune_malloc` (tcmalloc: 5.8 s).

:func:`tune_malloc` calls ``mallopt`` so that ``malloc`` never uses ``mmap`` (``M_MMAP_MAX=0``)
and never trims the heap (``M_TRIM_THRESHOLD=-1``): freed blocks are reused by the next step. The
price is that the process keeps its peak heap until it exits -- right for training, benchmarking
and evaluation processes, which is where the ``mhmoe`` command applies it. It is process-wide, so
the library never calls it on import; ``MHMOE_MALLOC=system`` turns it off for the command. Other
allocators (tcmalloc, jemalloc via ``LD_PRELOAD``) and non-glibc platforms are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
M_MMAP_MAX = -4
ENV = "MHMOE_MALLOC"  # "system" = leave malloc alone


def tune_malloc() -> bool:
    """Apply the glibc settings above; True when applied. No-op (False) when ``MHMOE_MALLOC=system``,
    off Linux/glibc, or when another allocator is preloaded."""
    if os.environ.get(ENV, "").lower() == "system" or not sys.platform.startswith("linux"):
        return False
    if any(name in os.environ.get("LD_PRELOAD", "") for name in ("tcmalloc", "jemalloc", "mimalloc")):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 -- glibc only (musl has no mallopt knobs of these numbers)
    except (OSError, AttributeError):
        return False
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, -1))
