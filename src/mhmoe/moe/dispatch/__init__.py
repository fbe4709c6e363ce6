"""Token dispatch: grouping (sub-token, slot) pairs by expert, the expert GEMMs, and the weighted
combine back to sub-token order -- one module per execution path.

Shape legend: S routed (sub-)tokens, K slots per token, E experts, D_in expert width,
N = number of valid (token, slot) pairs (N <= S*K).

Execution paths over the same :class:`~mhmoe.moe.routers.RouterOutput` (``MoEConfig.impl``):

- ``sorted`` (:func:`sorted_moe`): a stable argsort of the slots by expert gives each expert a
  contiguous block of rows; rows are gathered once, each expert runs its GEMMs on its block (a
  Python loop over experts, one host sync for the block sizes), outputs are scattered back to slot
  order and combined with a weighted sum over the K slots (no atomics).
- ``grouped_mm`` (:func:`grouped_moe`): the same grouping, but all experts' GEMMs run in one
  ``torch._grouped_mm`` call per matrix with device-side offsets -- no host synchronisation.
- ``padded`` (:func:`padded_moe`): the same grouping, rows placed in per-expert blocks of equal size
  C = the largest expert's row count (zero padding), all experts run as three batched GEMMs
  (``torch.bmm``). One host sync (C); no per-expert Python loop, no cat/stack of outputs or weight
  gradients, element-wise SwiGLU in one pass. Costs E*C/N - 1 padding work (N routed rows).
- ``fused`` / ``chunked`` (:mod:`mhmoe.moe.dispatch.fused`): the sorted grouping in one ``autograd.Function``
  with gathers both ways and GEMMs into preallocated buffers; ``chunked`` also cuts every expert's
  rows into cache-sized chunks and recomputes the hidden layer in the backward (no [N, F] storage).
- ``triton`` (:mod:`mhmoe.moe.dispatch.triton`): Triton kernels -- the row gather fused into the first
  grouped GEMM + SwiGLU, the second grouped GEMM fused with the weighted scatter to slot order, matching
  backward kernels; no host synchronisation, no atomics (needs ``pip install 'mhmoe[triton]'``).
- ``loop`` (:func:`mhmoe.moe.reference.loop_moe`): the per-expert masked loop, the oracle.
- ``auto``: :func:`choose_impl` picks by device from the measurements in docs/PERFORMANCE.md:
  ``grouped_mm`` on CUDA (``triton`` is opt-in until the GPU benchmark shows it ahead), ``fused`` on
  CPU (``sorted`` for thin, wide experts -- :func:`thin_wide` -- and for those ``fused`` does not cover:
  biases, quantization).
  ``chunked`` is the memory option (it keeps ~1/50 of the activations for thin, wide experts), not
  the default: with tcmalloc or ``MHMOE_MALLOC=tuned`` (:mod:`mhmoe.runtime.cpu_malloc`) it was slower than
  ``sorted`` in most rows (docs/PERFORMANCE.md, "Thin experts").

Quantized experts (``quant="bitnet158"``, docs/BITNET.md): ``sorted``, ``grouped_mm`` and ``loop``
run the quantized FFN; ``fused`` and ``triton`` (hand-written backwards without biases, activation
quantization or sub-norms) are not used -- :func:`choose_impl` falls back to ``sorted``.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from mhmoe.moe.dispatch.fused import chunked_moe, fused_moe
from mhmoe.moe.dispatch.grouped import grouped_mm_supported, grouped_moe
from mhmoe.moe.dispatch.padded import padded_moe
from mhmoe.moe.dispatch.sorted import sorted_moe
from mhmoe.moe.dispatch.triton import triton_moe
from mhmoe.moe.experts import GroupedExperts
from mhmoe.moe.reference import loop_moe
from mhmoe.moe.routers import RouterOutput

DispatchFn = Callable[[Tensor, RouterOutput, GroupedExperts], Tensor]

# impl="auto" on CPU: fused, except for thin, wide experts -- d_in < THIN_WIDTH and F >= WIDE_HIDDEN
# (MH-MoE with many heads at parameter parity: d_in 16-96, F in the thousands). Those are bound by
# element-wise work on the [N, F] hidden tensors, where sorted's stored activations need fewer passes
# than fused's recompute (benchmarks/thin_experts.py; docs/PERFORMANCE.md, "Thin experts").
THIN_WIDTH, WIDE_HIDDEN = 128, 1024


def thin_wide(experts: GroupedExperts) -> bool:
    """Experts that ``impl="auto"`` runs with ``sorted`` rather than ``fused`` on CPU."""
    return experts.d_in < THIN_WIDTH and experts.d_hidden >= WIDE_HIDDEN


def choose_impl(impl: str, x: Tensor, experts: GroupedExperts) -> DispatchFn:
    """The dispatch function for ``impl`` (``auto`` resolves by device and experts).

    ``fused``/``chunked`` have a hand-written backward without biases, activation quantization or
    sub-norms: for biased or quantized experts they fall back to ``sorted`` (same result, docs/BITNET.md).
    """
    fused_ok = not experts.quantized and experts.b1 is None
    if impl == "loop":
        return loop_moe
    if impl == "grouped_mm":
        return grouped_moe
    if impl == "padded":
        return padded_moe
    if impl in ("fused", "chunked"):
        if not fused_ok:
            return sorted_moe
        return fused_moe if impl == "fused" else chunked_moe
    if impl == "triton":  # biased or quantized experts: sorted; a missing triton is a one-line error
        return triton_moe if fused_ok else sorted_moe
    if impl == "auto" and x.is_cuda and grouped_mm_supported(x, experts):
        return grouped_moe
    if impl == "auto" and not x.is_cuda and fused_ok and not thin_wide(experts):
        return fused_moe
    return sorted_moe
