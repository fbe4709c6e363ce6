"""Where every routed (token, slot) pair's row lives in an expert-grouped row buffer (CPU paths).

Shape legend: S routed (sub-)tokens, K slots per token, E experts, N valid pairs, R rows of the buffer
(R >= N: padding), D expert width.

The valid pairs are sorted by expert (stable: token order within an expert) and expert ``e``'s rows are
one contiguous block of the buffer. A block can be longer than the expert's row count: ``align`` rounds
every block up to a multiple of ``align`` rows, and ``batched`` makes every block the same length (the
largest count, rounded up to ``align``), so that all experts run as one batched GEMM over ``[E, C, D]``.
Padding rows are zero inputs (and zero output gradients): they add exact zeros to every weight gradient
and their outputs are never read.

Why pad at all: oneDNN (PyTorch's bf16 matmul on x86 CPUs with ``avx512_bf16`` or AMX) builds and caches a
kernel per GEMM shape; a row count per expert that changes every step (it does, with every batch) builds
new kernels every step, which costs more than the GEMMs (docs/PERFORMANCE.md, "Where the time goes").
With rows rounded to a multiple of ``align`` the shapes repeat and stay cached.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

from mhmoe.moe.dispatch.common import group_keys


def round_up(n: int, align: int) -> int:
    """The smallest multiple of ``align`` that is >= n."""
    return -(-n // align) * align


@dataclass
class RowLayout:
    """An expert-grouped row buffer of R rows (plus one zero row at index R that invalid slots read).

    counts: E real rows per expert; sizes: E block lengths (>= counts; multiples of ``align``; all equal when
    batched); starts: E first rows of the blocks; tok: [R] int64 token of every row (padding rows: 0);
    slot: [R] int64 flat slot ``s * K + k`` of every row (padding rows: 0); inv: [S*K] int64 row of every slot
    (invalid slots: R); pad: [P] int64 the padding rows.
    """

    counts: list[int]
    sizes: list[int]
    starts: list[int]
    tok: Tensor
    slot: Tensor
    inv: Tensor
    pad: Tensor
    batched: bool

    @property
    def rows(self) -> int:
        """R, the rows of the buffer (without the zero row)."""
        return sum(self.sizes)


def block_sizes(counts: list[int], align: int = 1, batched: bool = False) -> list[int]:
    """Rows of every expert's block: its count rounded up to ``align`` (0 stays 0); ``batched``: the largest
    count rounded up to ``align``, for every expert."""
    if batched:
        c = round_up(max(counts, default=0), align)
        return [c] * len(counts)
    return [round_up(c, align) for c in counts]


def batch_padding(counts: list[int], align: int = 1) -> float:
    """Extra rows of the batched layout, as a fraction of the routed rows: E * C / N - 1 (inf when N = 0)."""
    n = sum(counts)
    return sum(block_sizes(counts, align, True)) / n - 1 if n else float("inf")


def row_layout(experts: Tensor, valid: Tensor, n_experts: int, align: int = 1,
               max_batch_padding: float = -1.0) -> RowLayout:
    """The layout of the valid slots of ``experts``/``valid`` [S, K] (one device-to-host copy: the counts).

    Batched (every block as long as the largest) when that pads at most ``max_batch_padding`` of the routed
    rows (:func:`batch_padding`; ``inf``: always, negative: never), else one block per expert."""
    S, K = experts.shape
    dev = experts.device
    key = torch.where(valid, experts, n_experts).reshape(-1)
    order, counts_t = group_keys(key, n_experts + 1)
    counts = counts_t[:n_experts].tolist()
    batched = max_batch_padding == float("inf") or batch_padding(counts, align) <= max_batch_padding
    sizes = block_sizes(counts, align, batched)
    starts = [0, *itertools.accumulate(sizes[:-1])]
    R, N = sum(sizes), sum(counts)
    sorted_slots = order[:N]
    if sizes == counts:  # no padding: the buffer is the sorted order itself
        row = torch.arange(N, device=dev)
        tok, slot = torch.div(sorted_slots, K, rounding_mode="floor"), sorted_slots
        pad = torch.empty(0, dtype=torch.long, device=dev)
    else:
        first = [0, *itertools.accumulate(counts[:-1])]  # first sorted position of every expert
        shift = torch.tensor([s - f for s, f in zip(starts, first, strict=True)], device=dev)
        row = torch.arange(N, device=dev) + shift[key[sorted_slots]]
        slot = torch.zeros(R, dtype=torch.long, device=dev).index_copy_(0, row, sorted_slots)
        tok = torch.div(slot, K, rounding_mode="floor")
        pad = torch.tensor([r for s, c, n in zip(starts, counts, sizes, strict=True) for r in range(s + c, s + n)],
                           dtype=torch.long, device=dev)
    inv = torch.full((S * K,), R, dtype=torch.long, device=dev).index_copy_(0, sorted_slots, row)
    return RowLayout(counts, sizes, starts, tok, slot, inv, pad, batched)
