"""Expert feed-forward networks.

Shape legend: E experts, D_in expert input/output width (d_model / H for MH-MoE), F expert hidden
width, N rows (tokens or sub-tokens) fed to one expert.

Experts are stored as stacked tensors ``w1``/``w3`` [E, D_in, F] and ``w2`` [E, F, D_in], so the
same storage serves the per-expert loop, grouped dispatch and (later) grouped GEMM kernels.
FFN types: ``swiglu`` = (silu(x W1) * x W3) W2 and ``relu`` = relu(x W1) W2 (Huang et al. Eq.5).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def ffn_forward(
    x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor | None = None,
    b1: Tensor | None = None, b2: Tensor | None = None, b3: Tensor | None = None,
) -> Tensor:
    """One FFN on rows x [N, D_in] with w1 [D_in, F], w2 [F, D_in], w3 [D_in, F] (SwiGLU) or None."""
    h = x @ w1
    if b1 is not None:
        h = h + b1
    if w3 is None:
        h = F.relu(h)
    else:
        g = x @ w3
        if b3 is not None:
            g = g + b3
        h = F.silu(h) * g
    y = h @ w2
    return y + b2 if b2 is not None else y


class GroupedExperts(nn.Module):
    """E independent FFN experts with stacked weights.

    Args: n_experts E, d_in D_in, d_hidden F, ffn "swiglu"|"relu", bias (off by default).
    """

    def __init__(self, n_experts: int, d_in: int, d_hidden: int, ffn: str = "swiglu",
                 bias: bool = False, init_std: float = 0.02) -> None:
        super().__init__()
        self.n_experts, self.d_in, self.d_hidden, self.ffn = n_experts, d_in, d_hidden, ffn
        self.w1 = nn.Parameter(torch.empty(n_experts, d_in, d_hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, d_hidden, d_in))
        self.w3 = nn.Parameter(torch.empty(n_experts, d_in, d_hidden)) if ffn == "swiglu" else None
        self.b1 = nn.Parameter(torch.zeros(n_experts, d_hidden)) if bias else None
        self.b2 = nn.Parameter(torch.zeros(n_experts, d_in)) if bias else None
        self.b3 = nn.Parameter(torch.zeros(n_experts, d_hidden)) if bias and ffn == "swiglu" else None
        self.init_std = init_std
        self.reset_parameters()

    def reset_parameters(self, std: float | None = None, out_std: float | None = None) -> None:
        """Normal init: ``std`` for the input matrices, ``out_std`` (default std) for W2."""
        std = self.init_std if std is None else std
        for w in (self.w1, self.w3):
            if w is not None:
                nn.init.normal_(w, std=std)
        nn.init.normal_(self.w2, std=std if out_std is None else out_std)

    def expert_forward(self, e: int, x: Tensor) -> Tensor:
        """Expert ``e`` on rows x [N, D_in] -> [N, D_in]."""
        pick = lambda t: None if t is None else t[e]  # noqa: E731
        return ffn_forward(x, self.w1[e], self.w2[e], pick(self.w3), pick(self.b1), pick(self.b2), pick(self.b3))

    def forward_sorted(self, x_sorted: Tensor, counts: list[int]) -> Tensor:
        """Run every expert on its contiguous block of rows.

        x_sorted: [N, D_in] rows grouped by expert (expert 0 first); counts: E python ints summing
        to N. Returns [N, D_in]. Empty experts cost nothing.
        """
        # unbind once: its backward stacks the per-expert gradients in one allocation, whereas
        # indexing w[e] per expert would materialise a full-size zero gradient per expert (O(E^2)).
        params = [None if t is None else t.unbind(0) for t in (self.w1, self.w2, self.w3, self.b1, self.b2, self.b3)]
        # torch.split for the same reason: slicing per expert would backprop a full-size zero per slice.
        outs = [ffn_forward(rows, *[None if t is None else t[e] for t in params])
                for e, rows in enumerate(torch.split(x_sorted, counts)) if counts[e]]
        if not outs:
            return x_sorted.new_zeros(x_sorted.shape)
        return torch.cat(outs, 0)

    def forward_grouped(self, x_sorted: Tensor, offsets: Tensor, expert_of_row: Tensor | None = None) -> Tensor:
        """Grouped-GEMM version of :meth:`forward_sorted` with ``torch._grouped_mm``.

        offsets: [E] int32 cumulative row counts (end of each expert's block), on the device -- no
        host synchronisation. Rows past ``offsets[-1]`` are not computed (their output is undefined;
        the caller masks them). ``expert_of_row`` [N] (-1 for rows past the end) is needed only for
        biases.
        """
        gmm = torch._grouped_mm
        if self.b1 is not None:
            assert expert_of_row is not None, "biased experts need expert_of_row"
            live = (expert_of_row >= 0)[:, None]
            idx = expert_of_row.clamp_min(0)
            bias = lambda b: torch.where(live, b[idx], 0)  # noqa: E731 -- select: no gradient to dead rows
        h = gmm(x_sorted, self.w1, offs=offsets)
        if self.b1 is not None:
            h = h + bias(self.b1)
        if self.w3 is None:
            h = F.relu(h)
        else:
            g = gmm(x_sorted, self.w3, offs=offsets)
            if self.b3 is not None:
                g = g + bias(self.b3)
            h = F.silu(h) * g
        y = gmm(h, self.w2, offs=offsets)
        return y + bias(self.b2) if self.b2 is not None else y

    def extra_repr(self) -> str:
        return f"n_experts={self.n_experts}, d_in={self.d_in}, d_hidden={self.d_hidden}, ffn={self.ffn}"


class DenseFFN(nn.Module):
    """A single FFN of hidden width F (the dense baseline, and the shared experts' building block).

    Stored as a one-expert :class:`GroupedExperts` so weights can be copied into an MoE expert.
    forward: x [..., D] -> [..., D].
    """

    def __init__(self, d_model: int, d_hidden: int, ffn: str = "swiglu", bias: bool = False,
                 init_std: float = 0.02) -> None:
        super().__init__()
        self.experts = GroupedExperts(1, d_model, d_hidden, ffn, bias, init_std)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        return self.experts.expert_forward(0, x.reshape(-1, shape[-1])).reshape(shape)


class SharedExperts(nn.Module):
    """DeepSeekMoE shared experts: ``n`` always-on FFNs of width F_s, outputs summed.

    Implemented as one FFN of width n*F_s, which is mathematically identical to n separate FFNs
    whose outputs are added (the hidden units are independent). forward: x [..., D] -> [..., D].
    """

    def __init__(self, d_model: int, n_shared: int, d_hidden: int, ffn: str = "swiglu",
                 bias: bool = False, init_std: float = 0.02) -> None:
        super().__init__()
        self.n_shared = n_shared
        self.ffn = DenseFFN(d_model, n_shared * d_hidden, ffn, bias, init_std)

    def forward(self, x: Tensor) -> Tensor:
        return self.ffn(x)
