"""``impl="grouped_mm"``: the sorted grouping, with all experts' GEMMs in one ``torch._grouped_mm`` call
per matrix and device-side offsets -- no host synchronisation.

Shape legend: S routed (sub-)tokens, K slots per token, E experts, D_in expert width, F hidden width.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mhmoe.moe.capacity import expert_counts
from mhmoe.moe.dispatch.common import combine
from mhmoe.moe.experts import GroupedExperts
from mhmoe.moe.routers import RouterOutput


def grouped_moe(x: Tensor, route: RouterOutput, experts: GroupedExperts) -> Tensor:
    """Dropless grouped GEMM dispatch (``torch._grouped_mm``), no device-to-host sync."""
    S, K = route.experts.shape
    E = experts.n_experts
    key = torch.where(route.valid, route.experts, E).reshape(-1)
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    offsets = torch.cumsum(expert_counts(key, E + 1)[:E], 0).to(torch.int32)
    live = (sorted_key < E)[:, None]
    # rows past offsets[-1] (invalid slots) are not computed: their outputs, and their input gradients
    # in the backward, are undefined memory -- torch.where on both sides discards them (a select, so
    # even NaN garbage cannot leak).
    xs = torch.where(live, x.index_select(0, order // K), 0)
    rows = torch.where(live, experts.forward_grouped(xs, offsets, torch.where(live[:, 0], sorted_key, -1)), 0)
    return combine(rows, order, route)


def grouped_mm_supported(x: Tensor, experts: GroupedExperts) -> bool:
    """torch._grouped_mm exists and the row strides are 16-byte aligned."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    item = x.element_size() if x.dtype == experts.w1.dtype else max(x.element_size(), experts.w1.element_size())
    return all((n * item) % 16 == 0 for n in (experts.d_in, experts.d_hidden))
