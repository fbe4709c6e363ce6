"""Pieces every grouped dispatch path shares: grouping (token, slot) pairs by expert and the weighted
combine back to token order.

Shape legend: S routed (sub-)tokens, K slots per token, E experts, D_in expert width,
N = number of valid (token, slot) pairs (N <= S*K).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mhmoe.moe.capacity import expert_counts
from mhmoe.moe.dispatch.native import group_rows
from mhmoe.moe.routers import RouterOutput


def group_keys(key: Tensor, n_bins: int) -> tuple[Tensor, Tensor]:
    """``key`` [N] int64 in [0, n_bins) grouped by value: ``order`` [N] (``torch.argsort(key, stable=True)``: the
    positions of each value in their order) and ``counts`` [n_bins] int64; on a CPU one counting sort in C++
    (:func:`mhmoe.moe.dispatch.native.group_rows`), the same numbers."""
    grouped = group_rows(key, n_bins)
    if grouped is not None:
        return grouped
    return torch.argsort(key, stable=True), expert_counts(key, n_bins)


def sort_slots(experts: Tensor, valid: Tensor, n_experts: int) -> tuple[Tensor, Tensor, list[int]]:
    """Group valid slots by expert.

    Returns ``order`` [N] flat slot indices (into S*K) sorted by expert (stable: token order within
    an expert), ``counts`` [E] int64 rows per expert, and the same counts as python ints (one
    device-to-host copy; the per-expert loop needs the block sizes).
    """
    key = torch.where(valid, experts, n_experts).reshape(-1)
    order, counts = group_keys(key, n_experts + 1)
    counts = counts[:n_experts]
    counts_list = counts.tolist()
    return order[: sum(counts_list)], counts, counts_list


def combine(rows: Tensor, order: Tensor, route: RouterOutput) -> Tensor:
    """out[s] = sum_k w[s,k] * rows[row of slot (s,k)] for expert outputs rows [N, D] in ``order``.

    A gather by the inverse permutation and a weighted sum over the K slots (no scatter into a
    [S*K, D] buffer, no atomics); invalid slots read an appended zero row. On CPU one
    ``embedding_bag`` does both; on CUDA a gather and a batched [1, K] x [K, D] product (the CUDA
    ``embedding_bag`` has no bf16 backward for ``per_sample_weights``).
    """
    S, K = route.experts.shape
    N = order.numel()
    if N < S * K:
        rows = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
    slot_row = torch.full((S * K,), N, dtype=torch.long, device=rows.device)
    slot_row[order] = torch.arange(N, device=rows.device)
    w = route.weights.to(rows.dtype)
    if rows.is_cuda:
        y = rows.index_select(0, slot_row).view(S, K, rows.shape[1])
        return torch.bmm(w.unsqueeze(1), y).squeeze(1)
    return torch.nn.functional.embedding_bag(slot_row.view(S, K), rows, mode="sum", per_sample_weights=w)
