"""Opt-in glibc ``malloc`` setting that keeps freed CPU memory in the process (``MHMOE_MALLOC=tuned``).

PyTorch's CPU allocator is the C library's ``malloc``. glibc serves every request above its mmap
threshold (at most 32 MB) with a fresh ``mmap`` and returns it to the OS on ``free``, so a training
step whose activations are hundreds of MB (MH-MoE hidden tensors: routed rows x expert width)
page-faults and zero-fills every one of them again on every step.

:func:`tune_malloc` calls ``mallopt`` so that ``malloc`` never uses ``mmap`` (``M_MMAP_MAX=0``)
and never trims the heap (``M_TRIM_THRESHOLD=-1``): freed blocks are reused by the next step, and
the process keeps its peak heap until it exits. Measured on the 2-core CPU (docs/PERFORMANCE.md,
"CPU allocator"), training-step time: h=8 ICML-parity model 10.8 s -> 4.9 s, tiny-mh3 1.51 s ->
1.01 s, but tiny-smoe 0.92-1.10 s -> 1.17-1.28 s (slower). tcmalloc (``LD_PRELOAD``) was as good or
better on all three (5.8 s, 1.00 s, 0.87 s), so it is the recommendation and this setting is only
the no-install fallback: the ``mhmoe`` command applies it when ``MHMOE_MALLOC=tuned``. It is
process-wide, so the library never calls it on import. Preloaded allocators (tcmalloc, jemalloc,
mimalloc) and non-glibc platforms are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
M_MMAP_MAX = -4
ENV = "MHMOE_MALLOC"  # "tuned" = apply tune_malloc in the mhmoe command


def malloc_from_env() -> bool:
    """:func:`tune_malloc` if ``MHMOE_MALLOC=tuned`` (what the ``mhmoe`` command and the benchmark
    scripts call at start); True when applied."""
    return os.environ.get(ENV, "").lower() == "tuned" and tune_malloc()


def _glibc() -> ctypes.CDLL | None:
    """The process's glibc, or None off Linux/glibc or when another allocator is preloaded (it keeps its own
    heap, which glibc's knobs and counters do not see)."""
    if not sys.platform.startswith("linux"):
        return None
    if any(name in os.environ.get("LD_PRELOAD", "") for name in ("tcmalloc", "jemalloc", "mimalloc")):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 -- glibc only (musl has no mallopt knobs of these numbers)
    except (OSError, AttributeError):
        return None
    return libc


def tune_malloc() -> bool:
    """Apply the glibc settings above; True when applied. No-op (False) off Linux/glibc or when
    another allocator is preloaded."""
    libc = _glibc()
    return libc is not None and bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, -1))


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (<malloc.h>, glibc 2.33 and later)."""

    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def held_bytes() -> int | None:
    """Bytes of CPU memory ``malloc`` has handed out and not had back (glibc's ``mallinfo2``: ``uordblks``, the
    heap's allocated bytes, plus ``hblkhd``, the mmap'ed ones) -- PyTorch's CPU tensors among them. None where it
    cannot say: not Linux/glibc (2.33+), or another allocator preloaded (it keeps its own books). Benchmarks and
    tests take differences of it, e.g. the activations a training forward keeps for the backward."""
    libc = _glibc()
    mallinfo2 = getattr(libc, "mallinfo2", None) if libc is not None else None  # glibc 2.33+
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return int(info.uordblks + info.hblkhd)
