"""Token dispatch: capacity, grouping (sub-token, slot) pairs by expert, combine.

Shape legend: S routed (sub-)tokens, K slots per token, E experts, D_in expert width,
N = number of valid (token, slot) pairs (N <= S*K).

Execution paths over the same :class:`~mhmoe.routers.RouterOutput` (``MoEConfig.impl``):

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
- ``fused`` / ``chunked`` (:mod:`mhmoe.fused`): the sorted grouping in one ``autograd.Function``
  with gathers both ways and GEMMs into preallocated buffers; ``chunked`` also cuts every expert's
  rows into cache-sized chunks and recomputes the hidden layer in the backward (no [N, F] storage).
- ``loop`` (:func:`mhmoe.reference.loop_moe`): the per-expert masked loop, the oracle.
- ``auto``: :func:`choose_impl` picks by device from the measurements in docs/PERFORMANCE.md:
  ``grouped_mm`` on CUDA, ``fused`` on CPU (``sorted`` for thin, wide experts -- :func:`thin_wide`
  -- and for those ``fused`` does not cover: biases, quantization).
  ``chunked`` is the memory option (it keeps ~1/50 of the activations for thin, wide experts), not
  the default: with tcmalloc or ``MHMOE_MALLOC=tuned`` (:mod:`mhmoe.cpu_malloc`) it was slower than
  ``sorted`` in most rows (docs/PERFORMANCE.md, "Thin experts").

Quantized experts (``quant="bitnet158"``, docs/BITNET.md): ``sorted``, ``grouped_mm`` and ``loop``
run the quantized FFN; ``fused`` (a hand-written backward without activation quantization or
sub-norms) is not used -- :func:`choose_impl` falls back to ``sorted``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mhmoe.experts import GroupedExperts
from mhmoe.reference import loop_moe
from mhmoe.routers import RouterOutput

# impl="auto" on CPU: fused, except for thin, wide experts -- d_in < THIN_WIDTH and F >= WIDE_HIDDEN
# (MH-MoE with many heads at parameter parity: d_in 16-96, F in the thousands). Those are bound by
# element-wise work on the [N, F] hidden tensors, where sorted's stored activations need fewer passes
# than fused's recompute (benchmarks/thin_experts.py; docs/PERFORMANCE.md, "Thin experts").
THIN_WIDTH, WIDE_HIDDEN = 128, 1024


def thin_wide(experts: GroupedExperts) -> bool:
    """Experts that ``impl="auto"`` runs with ``sorted`` rather than ``fused`` on CPU."""
    return experts.d_in < THIN_WIDTH and experts.d_hidden >= WIDE_HIDDEN


def expert_capacity(n_tokens: int, top_k: int, n_experts: int, capacity_factor: float) -> int:
    """GShard capacity: ceil(capacity_factor * n_tokens * top_k / n_experts) slots per expert."""
    return math.ceil(capacity_factor * n_tokens * top_k / n_experts)


def apply_capacity(experts: Tensor, valid: Tensor, capacity: int, n_experts: int) -> Tensor:
    """Drop (token, slot) pairs that overflow their expert's capacity (GShard semantics).

    Priority: every token's first choice before any second choice, then token order. Dropped pairs
    become invalid, so the token gets zero output from that expert (the residual carries it).

    experts, valid: [S, K] (ids in 0..n_experts-1). Returns the new valid mask [S, K].
    """
    S, K = experts.shape
    E = n_experts
    # slot-major order: (k=0, s=0..S-1), (k=1, ...)
    e_flat = torch.where(valid, experts, E).t().reshape(-1)
    order = torch.argsort(e_flat, stable=True)
    counts = torch.bincount(e_flat, minlength=E + 1)
    starts = torch.cumsum(counts, 0) - counts
    pos_sorted = torch.arange(e_flat.numel(), device=experts.device) - starts[e_flat[order]]
    pos = torch.empty_like(pos_sorted)
    pos[order] = pos_sorted
    keep = (pos < capacity).reshape(K, S).t()
    return valid & keep


def sort_slots(experts: Tensor, valid: Tensor, n_experts: int) -> tuple[Tensor, Tensor, list[int]]:
    """Group valid slots by expert.

    Returns ``order`` [N] flat slot indices (into S*K) sorted by expert (stable: token order within
    an expert), ``counts`` [E] int64 rows per expert, and the same counts as python ints (one
    device-to-host copy; the per-expert loop needs the block sizes).
    """
    key = torch.where(valid, experts, n_experts).reshape(-1)
    counts = torch.bincount(key, minlength=n_experts + 1)[:n_experts]
    order = torch.argsort(key, stable=True)
    counts_list = counts.tolist()
    return order[: sum(counts_list)], counts, counts_list


def sorted_moe(x: Tensor, route: RouterOutput, experts: GroupedExperts) -> Tensor:
    """Dropless grouped dispatch. x: [S, D_in] -> [S, D_in] = sum_k w[s,k] * Expert_{e[s,k]}(x[s])."""
    K = route.experts.shape[1]
    order, _, counts = sort_slots(route.experts, route.valid, experts.n_experts)
    # index_select, not x[idx]: its backward is an index_add, not a serialised accumulate-index_put (6x faster)
    rows = experts.forward_sorted(x.index_select(0, order // K), counts)  # [N, D_in]
    return _combine(rows, order, route)


def _combine(rows: Tensor, order: Tensor, route: RouterOutput) -> Tensor:
    """out[s] = sum_k w[s,k] * rows[row of slot (s,k)] for expert outputs rows [N, D] in ``order``.

    One ``embedding_bag`` (gather + weighted sum over the K slots, no scatter into a [S*K, D] buffer);
    invalid slots read an appended zero row.
    """
    S, K = route.experts.shape
    N = order.numel()
    if N < S * K:
        rows = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
    slot_row = torch.full((S * K,), N, dtype=torch.long, device=rows.device)
    slot_row[order] = torch.arange(N, device=rows.device)
    return torch.nn.functional.embedding_bag(slot_row.view(S, K), rows, mode="sum",
                                             per_sample_weights=route.weights.to(rows.dtype))


def padded_moe(x: Tensor, route: RouterOutput, experts: GroupedExperts) -> Tensor:
    """Dropless dispatch on zero-padded per-expert blocks with batched GEMMs. x: [S, D_in] -> [S, D_in]."""
    S, K = route.experts.shape
    E = experts.n_experts
    key = torch.where(route.valid, route.experts, E).reshape(-1)  # [S*K], E = not dispatched
    counts = torch.bincount(key, minlength=E + 1)[:E]
    C = int(counts.max()) if S * K else 0  # the one host sync
    if C == 0:
        return x.new_zeros(x.shape)
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    live = sorted_key < E
    starts = torch.cumsum(counts, 0) - counts
    # padded row of every sorted slot; slots past the dispatched ones point at row 0 and are masked below
    dest = torch.where(live, sorted_key.clamp_max(E - 1) * C + torch.arange(S * K, device=x.device)
                       - starts[sorted_key.clamp_max(E - 1)], 0)
    n = int(counts.sum())  # == live.sum(); live slots come first in the stable sort
    xp = x.new_zeros(E * C, x.shape[1]).index_put((dest[:n],), x.index_select(0, order[:n] // K))
    y = experts.forward_padded(xp.view(E, C, -1)).view(E * C, -1)  # [E*C, D_in]
    slot_row = torch.empty_like(dest)
    slot_row[order] = dest  # [S*K]: padded row holding each slot's output
    w = torch.where(route.valid, route.weights, 0).to(y.dtype)  # invalid slots read row 0 with weight 0
    return (y.index_select(0, slot_row).view(S, K, -1) * w[:, :, None]).sum(1)


def grouped_moe(x: Tensor, route: RouterOutput, experts: GroupedExperts) -> Tensor:
    """Dropless grouped GEMM dispatch (``torch._grouped_mm``), no device-to-host sync."""
    S, K = route.experts.shape
    E = experts.n_experts
    key = torch.where(route.valid, route.experts, E).reshape(-1)
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    offsets = torch.cumsum(torch.bincount(key, minlength=E + 1)[:E], 0).to(torch.int32)
    live = (sorted_key < E)[:, None]
    # rows past offsets[-1] (invalid slots) are not computed: their outputs, and their input gradients
    # in the backward, are undefined memory -- torch.where on both sides discards them (a select, so
    # even NaN garbage cannot leak).
    xs = torch.where(live, x.index_select(0, order // K), 0)
    rows = torch.where(live, experts.forward_grouped(xs, offsets, torch.where(live[:, 0], sorted_key, -1)), 0)
    return _combine(rows, order, route)


def grouped_mm_supported(x: Tensor, experts: GroupedExperts) -> bool:
    """torch._grouped_mm exists and the row strides are 16-byte aligned."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    item = x.element_size() if x.dtype == experts.w1.dtype else max(x.element_size(), experts.w1.element_size())
    return all((n * item) % 16 == 0 for n in (experts.d_in, experts.d_hidden))


def choose_impl(impl: str, x: Tensor, experts: GroupedExperts):
    """The dispatch function for ``impl`` (``auto`` resolves by device and dtype).

    Quantized experts never get ``fused``: its hand-written backward has no activation quantization
    or sub-norms, so ``impl="fused"`` falls back to ``sorted`` (same result, see docs/BITNET.md).
    """
    if impl == "loop":
        return loop_moe
    if impl == "grouped_mm":
        return grouped_moe
    if impl == "padded":
        return padded_moe
    if impl in ("fused", "chunked") and not experts.quantized:
        from mhmoe.fused import chunked_moe, fused_moe

        return fused_moe if impl == "fused" else chunked_moe
    if impl == "auto" and x.is_cuda and grouped_mm_supported(x, experts):
        return grouped_moe
    if impl == "auto" and not x.is_cuda and not experts.quantized and experts.b1 is None and not thin_wide(experts):
        from mhmoe.fused import fused_moe

        return fused_moe
    return sorted_moe

