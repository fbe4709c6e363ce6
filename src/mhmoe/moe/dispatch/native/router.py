"""The softmax router's element-wise work on a CPU in C++ (``router_topk.cpp``): after the score GEMM, the softmax,
the top-k (of the probabilities plus the selection bias), the combine weights (renormalised, masked) in one pass per
row, and their backward in one pass per row, where the reference router (:mod:`mhmoe.moe.routers`) runs about ten
ATen kernels each way. The score GEMM and its backward stay ATen's (autograd's).

Shape legend: S routed (sub-)tokens, E experts, K top-k slots.

The numbers are the reference's to fp32 rounding: the forward uses ATen's softmax formula and vectorised exp (its
probabilities and weights were the reference's bit for bit with torch 2.13), the backward sums in another order. The
experts are ``torch.topk``'s: a row whose top-k the tie rule decides (equal scores or a NaN) sends
the whole call to the reference ops, on the same scores.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from mhmoe.moe.dispatch import native


class _SoftmaxTopK(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: Tensor, bias: Tensor | None, mask: Tensor, k: int, renorm: bool,
                ops: Any) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        probs, weights, ids, tied = ops.softmax_topk(logits, bias, mask, k, renorm)
        ctx.save_for_backward(probs, ids, mask)
        ctx.renorm, ctx.ops = renorm, ops
        ctx.mark_non_differentiable(ids, tied)
        ctx.set_materialize_grads(False)
        return probs, weights, ids, tied

    @staticmethod
    def backward(ctx: Any, g_probs: Tensor | None, g_weights: Tensor | None, _ids: Any,
                 _tied: Any) -> tuple[Tensor | None, ...]:
        if g_probs is None and g_weights is None:
            return None, None, None, None, None, None
        probs, ids, mask = ctx.saved_tensors
        f32 = lambda g: None if g is None else g.float()  # noqa: E731
        dl = ctx.ops.softmax_topk_backward(probs, ids, mask, f32(g_probs), f32(g_weights), ctx.renorm)
        return dl, None, None, None, None, None


def applies(x: Tensor, n_experts: int, k: int) -> bool:
    """Whether :func:`softmax_topk` runs for scores of router inputs x [S, D] over ``n_experts``, top-``k``: on a CPU,
    1 <= k < E, k <= ``MAX_TOPK``, not under ``torch.compile`` or a dispatch mode (FLOP counts see the reference
    ops), the extension built and not turned off (``MHMOE_NATIVE=0``, :func:`~mhmoe.moe.dispatch.native.disabled`)."""
    return (not torch.compiler.is_compiling() and x.device.type == "cpu" and 1 <= k <= native.MAX_TOPK
            and k < n_experts and native.enabled() and not is_in_torch_dispatch_mode()
            and native._ops() is not None)


def softmax_topk(logits: Tensor, bias: Tensor | None, token_mask: Tensor, k: int,
                 renorm: bool) -> tuple[Tensor, Tensor, Tensor] | None:
    """``(probs [S, E], weights [S, K], experts [S, K])`` of the fp32 scores ``logits`` [S, E] where :func:`applies`:
    probs = softmax(logits), experts = the top-k of probs + ``bias`` [E] (or of probs), weights = probs at the
    experts, divided by their sum (floored at 1e-9) when ``renorm``, zero on tokens outside ``token_mask`` [S] bool;
    differentiable to the logits through probs and weights. None where a row's top-k is decided by the tie rule
    (equal scores, a NaN): the caller runs the reference ops on the same logits."""
    b = None if bias is None else bias.detach().float()
    probs, weights, experts, tied = _SoftmaxTopK.apply(logits.float().contiguous(), b, token_mask.reshape(-1), k,
                                                       renorm, native._ops())
    if bool(tied.any()):  # a CPU tensor: reading it is no device sync
        return None
    return probs, weights, experts
