"""The oracle: a per-expert masked loop, simple enough to be obviously correct.

This is what HF-eager / litgpt-style MoE code does: for each expert, find the (token, slot) pairs
routed to it, run the expert on those tokens and add the weighted result back. Every fast path in
:mod:`mhmoe.moe.dispatch` is tested against it (outputs and gradients).

Shape legend: S tokens, K slots, E experts, D_in expert width.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mhmoe.moe.experts import GroupedExperts, expert_ffn
from mhmoe.moe.routers import RouterOutput


def loop_moe(x: Tensor, route: RouterOutput, experts: GroupedExperts) -> Tensor:
    """x: [S, D_in] -> [S, D_in]: out[s] = sum over valid slots k of w[s,k] * Expert_{e[s,k]}(x[s])."""
    # per-expert weight views via unbind (like a ModuleList of experts: O(E) gradient bookkeeping);
    # quantized experts: the same effective (ternary x gamma) weights and sub-norms as every fast path
    params = experts.expert_params()
    out = None
    for e in range(experts.n_experts):
        tok, slot = torch.nonzero((route.experts == e) & route.valid, as_tuple=True)
        if tok.numel() == 0:
            continue
        y = expert_ffn(x[tok], [None if t is None else t[e] for t in params], experts.quantized)  # bf16 (autocast)
        out = torch.zeros(x.shape, dtype=y.dtype, device=x.device) if out is None else out
        out = out.index_add(0, tok, y * route.weights[tok, slot, None].to(y.dtype))
    return torch.zeros_like(x) if out is None else out
