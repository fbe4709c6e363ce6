"""Expert capacity (GShard): how many (token, slot) pairs an expert accepts, and which overflow pairs
are dropped (in GShard's priority, or in a causal, position-major one for decoders). The one place
capacity is computed: token-choice layers (:class:`~mhmoe.moe.layers.MoELayer`) and the expert-choice
router both use :func:`expert_capacity`.

Shape legend: S routed (sub-)tokens, K slots per token, E experts.
"""

from __future__ import annotations

import math
from typing import overload

import torch
from torch import Tensor


@overload
def expert_capacity(n_tokens: int, top_k: int, n_experts: int, capacity_factor: float) -> int: ...
@overload
def expert_capacity(n_tokens: Tensor, top_k: int, n_experts: int, capacity_factor: float) -> Tensor: ...
def expert_capacity(n_tokens: int | Tensor, top_k: int, n_experts: int, capacity_factor: float) -> int | Tensor:
    """GShard capacity: ceil(capacity_factor * n_tokens * top_k / n_experts) slots per expert.

    ``n_tokens`` may be a 0-dim tensor (the routed tokens of a padded batch): the capacity is then a
    0-dim int64 tensor on its device, computed without a host synchronisation."""
    if isinstance(n_tokens, Tensor):
        return torch.ceil(capacity_factor * n_tokens.double() * top_k / n_experts).long()
    return math.ceil(capacity_factor * n_tokens * top_k / n_experts)


def apply_capacity(experts: Tensor, valid: Tensor, capacity: int | Tensor, n_experts: int,
                   seq_shape: tuple[int, int] | None = None) -> Tensor:
    """Drop (token, slot) pairs that overflow their expert's capacity.

    An expert keeps its first ``capacity`` pairs in priority order; dropped pairs become invalid, so
    the token gets zero output from that expert (the residual carries it). Priority:

    - ``seq_shape=None`` (GShard): every token's first choice before any second choice, then token
      order. A token's drops depend on every other token, later ones included.
    - ``seq_shape=(B, T)`` (causal): the S tokens are ``[B, T, R]`` in row-major order (R = S / (B*T)
      sub-tokens per position, e.g. MH-MoE heads); priority is position-major: (t, k, b, r), so a pair
      at position t competes only with pairs at positions <= t and never depends on later tokens.

    experts, valid: [S, K] (ids in 0..n_experts-1). Returns the new valid mask [S, K]. No host sync.
    """
    S, K = experts.shape
    E = n_experts
    e_slot = torch.where(valid, experts, E)
    if seq_shape is None:
        e_flat = e_slot.t().reshape(-1)  # slot-major: (k=0, s=0..S-1), (k=1, ...)
    else:
        B, T = seq_shape
        e_flat = e_slot.reshape(B, T, -1, K).permute(1, 3, 0, 2).reshape(-1)  # (t, k, b, r)
    order = torch.argsort(e_flat, stable=True)
    counts = expert_counts(e_flat, E + 1)
    starts = torch.cumsum(counts, 0) - counts
    pos_sorted = torch.arange(e_flat.numel(), device=experts.device) - starts[e_flat[order]]
    pos = torch.empty_like(pos_sorted)
    pos[order] = pos_sorted
    keep = pos < capacity
    if seq_shape is None:
        keep = keep.reshape(K, S).t()
    else:
        keep = keep.reshape(T, K, B, -1).permute(2, 0, 3, 1).reshape(S, K)
    return valid & keep


def expert_counts(ids: Tensor, n: int, weight: Tensor | None = None) -> Tensor:
    """[n] int64 occurrences of each id in ``ids`` (any shape, values in 0..n-1), counting only where
    ``weight`` (bool, same shape) is True. Unlike ``torch.bincount`` (whose CUDA kernel reads the
    maximum id on the host) this never synchronises with the device."""
    ones = torch.ones_like(ids, dtype=torch.int64) if weight is None else weight.to(torch.int64)
    return torch.zeros(n, dtype=torch.int64, device=ids.device).scatter_add_(0, ids.reshape(-1), ones.reshape(-1))
