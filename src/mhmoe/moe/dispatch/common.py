"""Pieces every grouped dispatch path shares: grouping (token, slot) pairs by expert and the weighted
combine back to token order.

Shape legend: S routed (sub-)tokens, K slots per token, E experts, D_in expert width,
N = number of valid (token, slot) pairs (N <= S*K).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mhmoe.moe.routers import RouterOutput


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


def combine(rows: Tensor, order: Tensor, route: RouterOutput) -> Tensor:
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
