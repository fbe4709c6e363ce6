"""Triton kernels for the dropless grouped MoE path (optional: importable without triton).

Public API: :func:`triton_moe` (same contract as :func:`mhmoe.moe.dispatch.sorted.sorted_moe`),
:func:`triton_available` and :func:`triton_supported` (for the dispatcher's fallback).
The algorithm is described in :mod:`mhmoe.moe.dispatch.triton.ops`; the kernels live in
:mod:`mhmoe.moe.dispatch.triton.kernels`, which is imported on first use only (it needs triton).
"""

from mhmoe.moe.dispatch.triton.ops import triton_available, triton_moe, triton_supported

__all__ = ["triton_available", "triton_moe", "triton_supported"]
