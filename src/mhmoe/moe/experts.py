"""Expert feed-forward networks.

Shape legend: E experts, D_in expert input/output width (d_model / H for MH-MoE), F expert hidden
width, N rows (tokens or sub-tokens) fed to one expert.

Experts are stored as stacked tensors ``w1``/``w3`` [E, D_in, F] and ``w2`` [E, F, D_in], so the
same storage serves the per-expert loop, grouped dispatch and (later) grouped GEMM kernels.
FFN types: ``swiglu`` = (silu(x W1) * x W3) W2 and ``relu`` = relu(x W1) W2 (Huang et al. Eq.5).

Quantization (``quant="bitnet158"``, docs/BITNET.md): every dispatch path takes its weights from
:meth:`GroupedExperts.effective_weights` (ternary x gamma, one gamma per expert) and runs the same
row-wise FFN: x -> activation_quant -> W1/W3 -> act -> per-expert sub-norm -> activation_quant -> W2.
The row-wise ops act on each row alone, so they commute with the gather/sort of the dispatch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mhmoe.quant.bitnet import QUANT_NONE, SUBNORM_EPS, ReduceGamma, activation_quant, weight_quant


def sub_norm_rows(h: Tensor, weight: Tensor) -> Tensor:
    """RMSNorm of rows h [N, F] (eps 1e-5) times ``weight`` ([F], or [N, F] gathered per row)."""
    return F.rms_norm(h, (h.shape[-1],), eps=SUBNORM_EPS) * weight.to(h.dtype)


def ffn_forward(
    x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor | None = None,
    b1: Tensor | None = None, b2: Tensor | None = None, b3: Tensor | None = None,
    sub_norm: Tensor | None = None, act_quant: bool = False,
) -> Tensor:
    """One FFN on rows x [N, D_in] with w1 [D_in, F], w2 [F, D_in], w3 [D_in, F] (SwiGLU) or None.

    Also batched over experts: x [E, C, D_in], weights [E, D_in, F] / [E, F, D_in], biases and
    ``sub_norm`` [E, 1, X] (``@`` is then ``torch.bmm``).

    Quantized experts pass their (already quantized) weights, ``sub_norm`` [F] (the RMSNorm weight
    applied to the hidden rows before W2) and ``act_quant=True`` (8-bit rows before W1/W3 and W2).
    """
    if act_quant:
        x = activation_quant(x)
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
    if sub_norm is not None:
        h = sub_norm_rows(h, sub_norm)
    if act_quant:
        h = activation_quant(h)
    y = h @ w2
    return y + b2 if b2 is not None else y


def expert_ffn(x: Tensor, params: Sequence[Tensor | None], act_quant: bool = False) -> Tensor:
    """:func:`ffn_forward` of one expert whose ``params`` are (w1, w2, w3, b1, b2, b3, sub_norm), as
    :meth:`GroupedExperts.expert_params` gives them per expert (w1 and w2 are never None)."""
    w1, w2, w3, b1, b2, b3, sub_norm = params
    assert w1 is not None and w2 is not None
    return ffn_forward(x, w1, w2, w3, b1, b2, b3, sub_norm, act_quant)


class GroupedExperts(nn.Module):
    """E independent FFN experts with stacked weights.

    Args: n_experts E, d_in D_in, d_hidden F, ffn "swiglu"|"relu", bias (off by default),
    quant "none"|"bitnet158" (BitNet b1.58 fake quantization, gamma per expert; adds the per-expert
    sub-norm weight ``sub_norm`` [E, F], initialised to ones).
    """

    def __init__(self, n_experts: int, d_in: int, d_hidden: int, ffn: str = "swiglu",
                 bias: bool = False, init_std: float = 0.02, quant: str = QUANT_NONE) -> None:
        super().__init__()
        self.n_experts, self.d_in, self.d_hidden, self.ffn = n_experts, d_in, d_hidden, ffn
        self.w1 = nn.Parameter(torch.empty(n_experts, d_in, d_hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, d_hidden, d_in))
        self.w3 = nn.Parameter(torch.empty(n_experts, d_in, d_hidden)) if ffn == "swiglu" else None
        self.b1 = nn.Parameter(torch.zeros(n_experts, d_hidden)) if bias else None
        self.b2 = nn.Parameter(torch.zeros(n_experts, d_in)) if bias else None
        self.b3 = nn.Parameter(torch.zeros(n_experts, d_hidden)) if bias and ffn == "swiglu" else None
        self.quant = quant
        self.sub_norm = nn.Parameter(torch.ones(n_experts, d_hidden)) if self.quantized else None
        self.prequantized = False  # weights already ternary x gamma (packed export loader)
        self.reduce_gamma: ReduceGamma | None = None  # sharded training hook, see mhmoe.quant.bitnet
        self.init_std = init_std
        self.reset_parameters()

    @property
    def quantized(self) -> bool:
        return self.quant != QUANT_NONE

    def reset_parameters(self, std: float | None = None, out_std: float | None = None) -> None:
        """Normal init: ``std`` for the input matrices, ``out_std`` (default std) for W2; sub-norms 1."""
        std = self.init_std if std is None else std
        for w in (self.w1, self.w3):
            if w is not None:
                nn.init.normal_(w, std=std)
        nn.init.normal_(self.w2, std=std if out_std is None else out_std)
        if self.sub_norm is not None:
            nn.init.ones_(self.sub_norm)

    def effective_weights(self) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
        """(w1, w2, w3, b1, b2, b3) as every dispatch path must use them: with quantization on, the
        weights are ``weight_quant(w, dims=(1, 2))`` -- ternary x gamma with one gamma per expert
        (STE to the fp32 latent weights); biases stay full precision."""
        w1: Tensor = self.w1
        w2: Tensor = self.w2
        w3: Tensor | None = self.w3
        if self.quantized and not self.prequantized:
            w1, w2 = weight_quant(w1, (1, 2), self.reduce_gamma), weight_quant(w2, (1, 2), self.reduce_gamma)
            w3 = None if w3 is None else weight_quant(w3, (1, 2), self.reduce_gamma)
        return w1, w2, w3, self.b1, self.b2, self.b3

    def expert_params(self) -> list[tuple[Tensor, ...] | None]:
        """Per-expert views of (w1, w2, w3, b1, b2, b3, sub_norm): ``expert_ffn(x, [t[e] ...])``.

        ``unbind`` once: its backward stacks the per-expert gradients in one allocation, whereas
        indexing w[e] per expert would materialise a full-size zero gradient per expert (O(E^2)).
        """
        return [None if t is None else t.unbind(0) for t in (*self.effective_weights(), self.sub_norm)]

    def expert_forward(self, e: int, x: Tensor) -> Tensor:
        """Expert ``e`` on rows x [N, D_in] -> [N, D_in]."""
        pick = lambda t: None if t is None else t[e]  # noqa: E731
        return expert_ffn(x, [pick(t) for t in (*self.effective_weights(), self.sub_norm)], self.quantized)

    def forward_sorted(self, x_sorted: Tensor, counts: list[int]) -> Tensor:
        """Run every expert on its contiguous block of rows.

        x_sorted: [N, D_in] rows grouped by expert (expert 0 first); counts: E python ints summing
        to N. Returns [N, D_in]. Empty experts cost nothing.
        """
        params = self.expert_params()
        # torch.split for the same reason as unbind: slicing per expert would backprop a full-size zero per slice.
        outs = [expert_ffn(rows, [None if t is None else t[e] for t in params], self.quantized)
                for e, rows in enumerate(torch.split(x_sorted, counts)) if counts[e]]
        if not outs:
            return x_sorted.new_zeros(x_sorted.shape)
        return torch.cat(outs, 0)

    def forward_padded(self, x_padded: Tensor) -> Tensor:
        """All experts as batched GEMMs (``torch.bmm``) on equal-sized, zero-padded blocks.

        x_padded: [E, C, D_in] -- expert e's rows in ``x_padded[e]``, padding rows zero. Returns
        [E, C, D_in]. Padding rows give finite outputs (zero for bias-free experts) that the caller
        discards; the weight gradients come out of the batched GEMM already stacked [E, D_in, F].
        """
        w1, w2, w3, b1, b2, b3 = self.effective_weights()
        per_expert = lambda t: None if t is None else t[:, None, :]  # noqa: E731 -- [E, X] -> [E, 1, X]
        return ffn_forward(x_padded, w1, w2, w3, per_expert(b1), per_expert(b2), per_expert(b3),
                           per_expert(self.sub_norm), act_quant=self.quantized)

    def forward_gathered(self, x_rows: Tensor, ids: Tensor) -> Tensor:
        """Row n on expert ``ids[n]``, with that expert's weights gathered: x_rows [N, 1, D_in], ids [N] ->
        [N, 1, D_in] (batched GEMMs over the N rows; generation's few rows, :mod:`mhmoe.moe.dispatch.gathered`)."""
        w1, w2, w3, b1, b2, b3 = self.effective_weights()
        pick = lambda t: None if t is None else t.index_select(0, ids)  # noqa: E731 -- [E, ...] -> [N, ...]
        per_row = lambda t: None if t is None else t.index_select(0, ids)[:, None, :]  # noqa: E731 -- [N, 1, X]
        return ffn_forward(x_rows, w1.index_select(0, ids), w2.index_select(0, ids), pick(w3), per_row(b1),
                           per_row(b2), per_row(b3), per_row(self.sub_norm), act_quant=self.quantized)

    def forward_grouped(self, x_sorted: Tensor, offsets: Tensor, expert_of_row: Tensor | None = None) -> Tensor:
        """Grouped-GEMM version of :meth:`forward_sorted` with ``torch._grouped_mm``.

        offsets: [E] int32 cumulative row counts (end of each expert's block), on the device -- no
        host synchronisation. Rows past ``offsets[-1]`` are not computed (their output is undefined;
        the caller masks them). ``expert_of_row`` [N] (-1 for rows past the end) is needed only for
        biases and for the per-expert sub-norms of quantized experts.
        """
        gmm = torch._grouped_mm
        w1, w2, w3, b1, b2, b3 = self.effective_weights()
        if b1 is not None or self.quantized:
            assert expert_of_row is not None, "biased or quantized experts need expert_of_row"
            live = (expert_of_row >= 0)[:, None]
            idx = expert_of_row.clamp_min(0)
            bias = lambda b: torch.where(live, b[idx], 0)  # noqa: E731 -- select: no gradient to dead rows
        x = activation_quant(x_sorted) if self.quantized else x_sorted
        if torch.is_autocast_enabled(x.device.type):  # _grouped_mm is not autocast-aware: cast like a matmul
            dt = torch.get_autocast_dtype(x.device.type)
            x, w1, w2 = x.to(dt), w1.to(dt), w2.to(dt)
            w3 = None if w3 is None else w3.to(dt)
        h = gmm(x, w1, offs=offsets)
        if b1 is not None:
            h = h + bias(b1)
        if w3 is None:
            h = F.relu(h)
        else:
            g = gmm(x, w3, offs=offsets)
            if b3 is not None:
                g = g + bias(b3)
            h = F.silu(h) * g
        if self.quantized:
            # rows past the end hold undefined memory (maybe NaN), and so do their gradients coming
            # back from the W2 GEMM: select them away on both sides of the sub-norm, so neither the
            # output nor the sub-norm weight's gradient can see them.
            assert self.sub_norm is not None  # quantized experts have one
            h = torch.where(live, h, 0)
            h = torch.where(live, activation_quant(sub_norm_rows(h, self.sub_norm[idx])), 0)
        y = gmm(h, w2, offs=offsets)
        return y + bias(b2) if b2 is not None else y

    def extra_repr(self) -> str:
        q = f", quant={self.quant}" + (", prequantized" if self.prequantized else "") if self.quantized else ""
        return f"n_experts={self.n_experts}, d_in={self.d_in}, d_hidden={self.d_hidden}, ffn={self.ffn}{q}"


class DenseFFN(nn.Module):
    """A single FFN of hidden width F (the dense baseline, and the shared experts' building block).

    Stored as a one-expert :class:`GroupedExperts` so weights can be copied into an MoE expert.
    forward: x [..., D] -> [..., D].
    """

    def __init__(self, d_model: int, d_hidden: int, ffn: str = "swiglu", bias: bool = False,
                 init_std: float = 0.02, quant: str = QUANT_NONE) -> None:
        super().__init__()
        self.experts = GroupedExperts(1, d_model, d_hidden, ffn, bias, init_std, quant)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        return self.experts.expert_forward(0, x.reshape(-1, shape[-1])).reshape(shape)


class SharedExperts(nn.Module):
    """DeepSeekMoE shared experts: ``n`` always-on FFNs of width F_s, outputs summed.

    Implemented as one FFN of width n*F_s, which is mathematically identical to n separate FFNs
    whose outputs are added (the hidden units are independent). forward: x [..., D] -> [..., D].
    Quantized (bitnet158) with n > 1, the identity breaks (one gamma and one sub-norm would span all
    n experts), so the n experts are stacked instead (``self.experts``, gamma and sub-norm per expert).
    """

    def __init__(self, d_model: int, n_shared: int, d_hidden: int, ffn: str = "swiglu",
                 bias: bool = False, init_std: float = 0.02, quant: str = QUANT_NONE) -> None:
        super().__init__()
        self.n_shared = n_shared
        if quant != QUANT_NONE and n_shared > 1:
            self.ffn = None
            self.experts = GroupedExperts(n_shared, d_model, d_hidden, ffn, bias, init_std, quant)
        else:
            self.ffn = DenseFFN(d_model, n_shared * d_hidden, ffn, bias, init_std, quant)

    def forward(self, x: Tensor) -> Tensor:
        if self.ffn is not None:
            return self.ffn(x)
        shape, n = x.shape, self.n_shared
        rows = x.reshape(-1, shape[-1])
        out = self.experts.forward_sorted(rows.repeat(n, 1), [rows.shape[0]] * n)
        return out.view(n, *rows.shape).sum(0).reshape(shape)
