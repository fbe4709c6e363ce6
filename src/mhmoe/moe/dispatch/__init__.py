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
- generation's few rows (:mod:`mhmoe.moe.dispatch.gathered`, not an ``impl`` of its own): forward-only calls
  whose pairs' gathered weights are small run every (token, slot) pair on its expert's gathered weights as
  batched GEMMs; :meth:`mhmoe.moe.layers.MoELayer.dispatch` takes it for ``auto``.
- ``auto``: :func:`choose_impl` picks by device, compute dtype and alignment (:func:`auto_impl`, a pure
  function of those) a path without host synchronisation where one exists: on CUDA ``grouped_mm`` only
  where ``torch._grouped_mm`` takes its CUTLASS fast path -- bf16 on a Hopper/Blackwell GPU (compute
  capability 9.x/10.x) with 16-byte aligned row strides (D_in and F multiples of 8); everywhere else
  (fp32, pre-Hopper GPUs, unaligned widths) its fallback copies the offsets to the host and loops over
  the experts, so ``auto`` runs ``triton`` instead, or ``padded`` (one host sync, batched GEMMs) where
  Triton cannot run (not installed, fp16, biased or quantized experts). On CPU the path, its row alignment
  and when to batch the experts' GEMMs come from the CPU dispatch table
  (:mod:`mhmoe.moe.dispatch.cpu_table`, per ISA, compute dtype and shape class, built from measurements);
  ``sorted`` for experts ``fused`` does not cover (biases, quantization). On CPU ``padded`` runs the
  ``fused`` function with every expert padded to the largest (one ``bmm`` per matrix).
  ``chunked`` is also the memory option (it keeps ~1/50 of the activations for thin, wide experts); the
  table picks it where it was measured fastest (bf16 thin, wide experts on the Xeon with AMX;
  docs/PERFORMANCE.md, "How impl=auto picks a CPU path").

Quantized experts (``quant="bitnet158"``, docs/BITNET.md): ``sorted``, ``grouped_mm`` and ``loop``
run the quantized FFN; ``fused`` and ``triton`` (hand-written backwards without biases, activation
quantization or sub-norms) are not used -- :func:`choose_impl` falls back to ``sorted``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from mhmoe.config.moe import Impl
from mhmoe.moe.dispatch.cpu_table import TABLE, dtype_key, shape_class
from mhmoe.moe.dispatch.cpu_table import THIN_WIDTH as THIN_WIDTH  # re-exported
from mhmoe.moe.dispatch.cpu_table import WIDE_HIDDEN as WIDE_HIDDEN
from mhmoe.moe.dispatch.fused import chunked_moe, fused_moe
from mhmoe.moe.dispatch.grouped import grouped_moe
from mhmoe.moe.dispatch.padded import padded_moe
from mhmoe.moe.dispatch.precision import compute_dtype
from mhmoe.moe.dispatch.sorted import sorted_moe
from mhmoe.moe.dispatch.triton import triton_moe, triton_supported
from mhmoe.moe.experts import GroupedExperts
from mhmoe.moe.reference import loop_moe
from mhmoe.moe.routers import RouterOutput
from mhmoe.runtime.cpu import cpu_isa

DispatchFn = Callable[[Tensor, RouterOutput, GroupedExperts], Tensor]

def thin_wide(experts: GroupedExperts) -> bool:
    """Thin, wide experts (d_in < THIN_WIDTH, F >= WIDE_HIDDEN): the ``thin_wide`` class of the CPU table."""
    return shape_class(experts) == "thin_wide"


GROUPED_MM_FAST_MAJORS = (9, 10)  # torch._grouped_mm's CUTLASS kernels: sm90 (Hopper), sm100 (Blackwell)
IMPL_FNS: dict[str, DispatchFn] = {"loop": loop_moe, "grouped_mm": grouped_moe, "padded": padded_moe,
                                   "fused": fused_moe, "chunked": chunked_moe, "sorted": sorted_moe,
                                   "triton": triton_moe}


def auto_impl(device: str, dtype: torch.dtype, aligned: bool, *, capability: tuple[int, int] | None = None,
              triton: bool = False, fused_ok: bool = True, thin: bool = False, isa: str | None = None,
              shape: str | None = None) -> str:
    """The path ``impl="auto"`` runs, from the facts that decide it (a pure function, unit-tested over
    every combination).

    device: "cuda" | "cpu" (anything else is treated like the CPU); dtype: the compute dtype (autocast's
    when on); aligned: every GEMM operand's row stride is a multiple of 16 bytes in that dtype;
    capability: the CUDA device's (major, minor); triton: :func:`~mhmoe.moe.dispatch.triton.triton_supported`
    for these experts and inputs; fused_ok: bias-free, unquantized experts; thin: :func:`thin_wide`; on CPU:
    isa (:func:`mhmoe.runtime.cpu.cpu_isa`, None: this CPU's) and shape
    (:func:`~mhmoe.moe.dispatch.cpu_table.shape_class`, None: ``thin_wide`` if thin else ``few``) pick the
    entry of the CPU table.
    """
    if device == "cuda":
        fast_grouped = (dtype == torch.bfloat16 and aligned and capability is not None
                        and capability[0] in GROUPED_MM_FAST_MAJORS)
        if fast_grouped:
            return "grouped_mm"  # CUTLASS grouped GEMM, device-side offsets: no host sync
        return "triton" if triton else "padded"
    if not fused_ok:
        return "sorted"
    return TABLE[(isa or cpu_isa(), dtype_key(dtype), shape or ("thin_wide" if thin else "few"))].impl


def gemm_aligned(dtype: torch.dtype, experts: GroupedExperts) -> bool:
    """Row strides of every expert GEMM operand ([N, D_in], [N, F], weights) are 16-byte multiples."""
    item = torch.empty((), dtype=dtype).element_size()
    return all((n * item) % 16 == 0 for n in (experts.d_in, experts.d_hidden))


def resolve_impl(impl: Impl, x: Tensor, experts: GroupedExperts) -> str:
    """The name of the path that runs ``impl`` for x and ``experts`` (``auto`` resolved, fallbacks applied).

    ``fused``/``chunked``/``triton`` have a hand-written backward without biases, activation quantization or
    sub-norms: for biased or quantized experts they fall back to ``sorted`` (same result, docs/BITNET.md).
    """
    fused_ok = not experts.quantized and experts.b1 is None
    if impl in ("fused", "chunked", "triton"):  # a missing triton is a one-line error from triton_moe
        return impl if fused_ok else "sorted"
    if impl != "auto":
        return impl
    dt = compute_dtype(x)
    cap = torch.cuda.get_device_capability(x.device) if x.is_cuda else None
    return auto_impl(x.device.type, dt, gemm_aligned(dt, experts), capability=cap,
                     triton=x.is_cuda and triton_supported(x, experts), fused_ok=fused_ok, thin=thin_wide(experts),
                     shape=shape_class(experts))


def choose_impl(impl: Impl, x: Tensor, experts: GroupedExperts) -> DispatchFn:
    """The dispatch function for ``impl`` (``auto`` resolves by device, dtype and alignment: :func:`resolve_impl`)."""
    return IMPL_FNS[resolve_impl(impl, x, experts)]
