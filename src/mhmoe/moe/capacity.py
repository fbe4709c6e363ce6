"""Expert capacity (GShard): how many (token, slot) pairs an expert accepts, and which overflow pairs
are dropped. The one place capacity is computed: token-choice layers (:class:`~mhmoe.moe.layers.MoELayer`)
and the expert-choice router both use :func:`expert_capacity`.

Shape legend: S routed (sub-)tokens, K slots per token, E experts.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


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
