"""Generation's few rows: every (token, slot) pair runs its expert with that expert's weights gathered.

Shape legend: S routed (sub-)tokens, K slots per token, N = S*K pairs, D_in expert width, F expert hidden width.

A decoding step routes one token per sequence (times the heads for MH-MoE): a handful of pairs. Grouping them
by expert (the other paths' row layout, counts, per-expert loop) then costs more than the experts' work. Here
the weights of each pair's expert are gathered ([N, D_in, F], ...) and the N one-row FFNs run as batched
GEMMs (``torch.bmm``): a few kernels whatever the number of experts, no host synchronisation. It reads each
chosen expert's weights once per pair, so :func:`fits` takes it only for forward-only calls whose gathered
weights stay small; :meth:`mhmoe.moe.layers.MoELayer.dispatch` runs it for ``impl="auto"``. On a CPU, plain
experts' pairs run in one C++ op that reads each pair's weights in place instead of gathering copies
(:func:`mhmoe.moe.dispatch.native.gathered_ffn`; pairs spread over the threads, so it keeps the same limit).
Tested against the loop oracle (:func:`mhmoe.moe.reference.loop_moe`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mhmoe.moe.dispatch.native import gathered_ffn
from mhmoe.moe.experts import GroupedExperts
from mhmoe.moe.routers import RouterOutput

MAX_GATHERED = 1 << 21  # weight elements gathered per call at most (4 MiB in bf16): generation's few pairs


def fits(route: RouterOutput, experts: GroupedExperts) -> bool:
    """Whether a call should run :func:`gathered_moe`: no gradient wanted (generation, evaluation) and the
    pairs' gathered weights within ``MAX_GATHERED`` elements. Shapes only: no host synchronisation."""
    if torch.is_grad_enabled():
        return False
    per_expert = sum(w.numel() for w in (experts.w1, experts.w2, experts.w3) if w is not None) // experts.n_experts
    return route.experts.numel() * per_expert <= MAX_GATHERED


def gathered_moe(x: Tensor, route: RouterOutput, experts: GroupedExperts) -> Tensor:
    """x: [S, D_in] -> [S, D_in]: out[s] = sum over valid slots k of w[s,k] * Expert_{e[s,k]}(x[s]), each pair's
    FFN on its expert's gathered weights (biases, sub-norms and quantized weights as the other paths)."""
    S, K = route.experts.shape
    ids = torch.where(route.valid, route.experts, 0).reshape(-1)  # [N]; invalid slots read expert 0, weigh 0
    rows = x[:, None, :].expand(S, K, x.shape[-1]).reshape(S * K, 1, -1)  # [N, 1, D_in]
    y = _pairs(experts, rows, ids).view(S, K, -1)  # [S, K, D_in]
    y = torch.where(route.valid[..., None], y, 0)  # an invalid slot contributes nothing, even from a non-finite row
    return (y * route.weights.to(y.dtype)[..., None]).sum(1)  # the weighted sum over the K slots (not a GEMM:
    # FLOP counts stay the experts' own, as on the other paths)


def _pairs(experts: GroupedExperts, rows: Tensor, ids: Tensor) -> Tensor:
    """rows [N, 1, D_in] through experts ``ids`` [N] -> [N, 1, D_in]: on a CPU, plain experts' weights read in
    place by the C++ op (:func:`mhmoe.moe.dispatch.native.gathered_ffn`), else gathered (forward_gathered)."""
    if experts.b1 is None and not experts.quantized:
        y = gathered_ffn(rows.view(rows.shape[0], -1), ids, experts.w1, experts.w2, experts.w3)
        if y is not None:
            return y.unsqueeze(1)
    return experts.forward_gathered(rows, ids)
