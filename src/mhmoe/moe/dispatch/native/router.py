"""The softmax router's element-wise work on a CPU in C++ (``router_topk.cpp``): after the score GEMM, the softmax,
the top-k (of the probabilities plus the selection bias), the combine weights (renormalised, masked) in one pass per
row, and their backward in one pass per row, where the reference router (:mod:`mhmoe.moe.routers`) runs about ten
ATen kernels each way. The same pass reduces each row to what the router losses
read (its logsumexp and entropy, and the routed rows' probabilities summed per expert: :class:`~mhmoe.moe.routers.
GateSums`), so the losses make no further passes over the [S, E] scores. The score GEMM and its backward stay ATen's
(autograd's).

Shape legend: S routed (sub-)tokens, E experts, K top-k slots.

The numbers are the reference's to fp32 rounding: the forward uses ATen's softmax formula and vectorised exp (its
probabilities and weights were the reference's bit for bit with torch 2.13), the backward sums in another order; the
entropy is ``log(sum) - sum p (l - max)`` (``-sum p log p`` without a logarithm per element), and the per-expert sums
add blocks of 256 rows in order (the same numbers on any thread count). The
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
                ops: Any) -> tuple[Tensor, ...]:
        probs, weights, ids, tied, lse, entropy, prob_sum = ops.softmax_topk(logits, bias, mask, k, renorm)
        ctx.save_for_backward(logits, probs, lse, ids, mask)
        ctx.renorm, ctx.ops = renorm, ops
        ctx.mark_non_differentiable(ids, tied)
        ctx.set_materialize_grads(False)
        return probs, weights, ids, tied, lse, entropy, prob_sum

    @staticmethod
    def backward(ctx: Any, g_probs: Tensor | None, g_weights: Tensor | None, _ids: Any, _tied: Any,
                 g_lse: Tensor | None, g_entropy: Tensor | None, g_sum: Tensor | None) -> tuple[Tensor | None, ...]:
        grads = [None if g is None else g.float() for g in (g_probs, g_weights, g_lse, g_entropy, g_sum)]
        if all(g is None for g in grads):
            return None, None, None, None, None, None
        logits, probs, lse, ids, mask = ctx.saved_tensors
        dl = ctx.ops.softmax_topk_backward(logits, probs, lse, ids, mask, *grads, ctx.renorm)
        return dl, None, None, None, None, None


def applies(x: Tensor, n_experts: int, k: int) -> bool:
    """Whether :func:`softmax_topk` runs for scores of router inputs x [S, D] over ``n_experts``, top-``k``: on a CPU,
    1 <= k < E, k <= ``MAX_TOPK``, not under ``torch.compile`` or a dispatch mode (FLOP counts see the reference
    ops), the extension built and not turned off (``MHMOE_NATIVE=0``, :func:`~mhmoe.moe.dispatch.native.disabled`)."""
    return (not torch.compiler.is_compiling() and x.device.type == "cpu" and 1 <= k <= native.MAX_TOPK
            and k < n_experts and native.enabled() and not is_in_torch_dispatch_mode()
            and native._ops() is not None)


def softmax_topk(logits: Tensor, bias: Tensor | None, token_mask: Tensor, k: int,
                 renorm: bool) -> tuple[Tensor, Tensor, Tensor, tuple[Tensor, Tensor, Tensor]] | None:
    """``(probs [S, E], weights [S, K], experts [S, K], sums)`` of the fp32 scores ``logits`` [S, E] where
    :func:`applies`: probs = softmax(logits), experts = the top-k of probs + ``bias`` [E] (or of probs), weights =
    probs at the experts, divided by their sum (floored at 1e-9) when ``renorm``, zero on tokens outside ``token_mask``
    [S] bool; ``sums`` the router losses' reductions of the same rows (:class:`~mhmoe.moe.routers.GateSums`' fields):
    each row's logsumexp [S] and entropy [S] and the routed rows' probs summed per expert [E]. All differentiable to
    the logits. None where a row's top-k is decided by the tie rule (equal scores, a NaN): the caller runs the
    reference ops on the same logits."""
    b = None if bias is None else bias.detach().float()
    probs, weights, experts, tied, lse, entropy, prob_sum = _SoftmaxTopK.apply(
        logits.float().contiguous(), b, token_mask.reshape(-1), k, renorm, native._ops())
    if bool(tied.any()):  # a CPU tensor: reading it is no device sync
        return None
    return probs, weights, experts, (lse, entropy, prob_sum)
