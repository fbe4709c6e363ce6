"""``impl="padded"``: rows placed in per-expert blocks of equal size C = the largest expert's row count
(zero padding); all experts run as batched GEMMs (``torch.bmm``). One host sync (C); costs E*C/N - 1
padding work. On CPU (bias-free, unquantized experts) the same layout runs in the fused CPU function
(:func:`mhmoe.moe.dispatch.fused.fused_moe` with every expert padded to the largest).

Shape legend: S routed (sub-)tokens, K slots per token, E experts, D_in expert width, C rows per block.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mhmoe.moe.capacity import expert_counts
from mhmoe.moe.dispatch.fused import fused_moe
from mhmoe.moe.experts import GroupedExperts
from mhmoe.moe.routers import RouterOutput


def padded_moe(x: Tensor, route: RouterOutput, experts: GroupedExperts) -> Tensor:
    """Dropless dispatch on zero-padded per-expert blocks with batched GEMMs. x: [S, D_in] -> [S, D_in]."""
    if x.device.type == "cpu" and not experts.quantized and experts.b1 is None:
        return fused_moe(x, route, experts, max_batch_padding=float("inf"))
    S, K = route.experts.shape
    E = experts.n_experts
    key = torch.where(route.valid, route.experts, E).reshape(-1)  # [S*K], E = not dispatched
    counts = expert_counts(key, E + 1)[:E]
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
