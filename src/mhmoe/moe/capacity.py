"""Expert capacity (GShard): how many (token, slot) pairs an expert accepts, and which overflow pairs
are dropped. The one place capacity is computed: token-choice layers (:class:`~mhmoe.moe.layers.MoELayer`)
and the expert-choice router both use :func:`expert_capacity`.

Shape legend: S routed (sub-)tokens, K slots per token, E experts.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def expert_capacity(n_tokens: int | Tensor, top_k: int, n_experts: int, capacity_factor: float) -> int | Tensor:
    """GShard capacity: ceil(capacity_factor * n_tokens * top_k / n_experts) slots per expert.

    ``n_tokens`` may be a 0-dim tensor (the routed tokens of a padded batch): the capacity is then a
    0-dim int64 tensor on its device, computed without a host synchronisation."""
    if isinstance(n_tokens, Tensor):
        return torch.ceil(capacity_factor * n_tokens.double() * top_k / n_experts).long()
    return math.ceil(capacity_factor * n_tokens * top_k / n_experts)


def apply_capacity(experts: Tensor, valid: Tensor, capacity: int | Tensor, n_experts: int) -> Tensor:
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
    counts = expert_counts(e_flat, E + 1)
    starts = torch.cumsum(counts, 0) - counts
    pos_sorted = torch.arange(e_flat.numel(), device=experts.device) - starts[e_flat[order]]
    pos = torch.empty_like(pos_sorted)
    pos[order] = pos_sorted
    keep = (pos < capacity).reshape(K, S).t()
    return valid & keep


def expert_counts(ids: Tensor, n: int, weight: Tensor | None = None) -> Tensor:
    """[n] int64 occurrences of each id in ``ids`` (any shape, values in 0..n-1), counting only where
    ``weight`` (bool, same shape) is True. Unlike ``torch.bincount`` (whose CUDA kernel reads the
    maximum id on the host) this never synchronises with the device."""
    ones = torch.ones_like(ids, dtype=torch.int64) if weight is None else weight.to(torch.int64)
    return torch.zeros(n, dtype=torch.int64, device=ids.device).scatter_add_(0, ids.reshape(-1), ones.reshape(-1))
