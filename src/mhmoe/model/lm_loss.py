"""The language-model loss: mean token cross-entropy, from logits or fused with the LM head in row chunks.

Shape legend: N = B * T positions, D model dim, V vocabulary, C rows of one chunk.

:func:`token_loss` is the reference: cross-entropy in fp32 of given logits [B, T, V].
:func:`chunked_token_loss` computes the same loss from the final hidden states and the LM head weight
without ever holding the [N, V] logits: per chunk of C rows it computes the logits (in the input dtype,
as ``nn.Linear`` under autocast), each row's log-sum-exp in fp32, the loss and, when a gradient is needed,
the chunk's logit gradient ``softmax - onehot`` and from it the chunk's input gradient [C, D] and its share
of the weight gradient [V, D] (accumulated in fp32). The backward only scales those by the incoming gradient.
On a CPU one C++ op does a chunk's rows in place of its logits (:func:`mhmoe.moe.dispatch.native.token_xent_`:
a max pass, an exp pass into an fp32 row, a gradient pass); elsewhere torch ops do the same. Peak memory is
one chunk's logits (and, off the CPU op, their fp32 copy) instead of the [N, V] logits, an fp32 copy, its
log-softmax and their gradients.
Measurements: docs/PERFORMANCE.md, "Whole models".
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from mhmoe.moe.dispatch.native import token_xent_

IGNORE = -100  # target value of positions without a loss (masked or padding)
CHUNK_LOGITS = 1 << 23  # fp32 logits per chunk (32 MB): rows = CHUNK_LOGITS // V, at least MIN_CHUNK_ROWS
MIN_CHUNK_ROWS = 128
CHUNKED_OFF_CPU = 1 << 28  # off a CPU, chunks only when the batch's fp32 logits would reach 1 GiB


def token_loss(logits: Tensor, targets: Tensor, keep: Tensor | None = None) -> Tensor:
    """Mean cross-entropy, in fp32, of ``logits`` [B, T, V] against ``targets`` [B, T] over the positions
    ``keep`` [B, T] marks (all when None); no host synchronisation."""
    tgt = targets if keep is None else targets.masked_fill(~keep.bool(), IGNORE)
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=IGNORE)


def use_chunks(hidden: Tensor, vocab: int) -> bool:
    """Whether a loss-only forward takes :func:`chunked_token_loss`: on a CPU always (measured faster, see the module
    docstring); on other devices when the fp32 logits of the whole batch would reach ``CHUNKED_OFF_CPU`` elements
    (the memory they free matters there; their speed against the fused cross-entropy kernels is not measured);
    never while compiling (the compiler fuses the plain head and loss)."""
    if torch.compiler.is_compiling():
        return False
    return hidden.device.type == "cpu" or hidden.numel() // hidden.shape[-1] * vocab >= CHUNKED_OFF_CPU


def chunk_rows(vocab: int, positions: int) -> int:
    """Rows per chunk: each chunk's fp32 logits about CHUNK_LOGITS elements (at least MIN_CHUNK_ROWS rows)."""
    return max(1, min(positions, max(MIN_CHUNK_ROWS, CHUNK_LOGITS // max(vocab, 1))))


def chunked_token_loss(hidden: Tensor, weight: Tensor, targets: Tensor, keep: Tensor | None = None,
                       rows: int | None = None) -> Tensor:
    """``token_loss(hidden @ weight.T, targets, keep)`` without the [N, V] logits.

    hidden [B, T, D]; weight [V, D] (the LM head's); targets, keep [B, T]; rows: positions per chunk
    (default :func:`chunk_rows`). Under autocast both operands are cast to the autocast dtype first, as
    ``nn.Linear`` would. Returns the 0-dim fp32 mean over the kept positions (NaN when none is kept, as
    ``F.cross_entropy``). No host synchronisation; not twice differentiable."""
    tgt = targets if keep is None else targets.masked_fill(~keep.bool(), IGNORE)
    h = hidden.reshape(-1, hidden.shape[-1])
    if torch.is_autocast_enabled(h.device.type):
        dtype = torch.get_autocast_dtype(h.device.type)
        h, weight = h.to(dtype), weight.to(dtype)
    n_rows = rows or chunk_rows(weight.shape[0], h.shape[0])
    with torch.autocast(h.device.type, enabled=False):
        return _ChunkedLinearCrossEntropy.apply(h, weight, tgt.reshape(-1), n_rows)


def _rows(logits: Tensor, tgt: Tensor, grad: bool) -> tuple[Tensor, Tensor]:
    """One chunk: logits [C, V] (the compute dtype), tgt [C] -> (the rows' losses [C] fp32, 0 where ignored;
    softmax - onehot [C, V] in the logits' dtype, zero rows where ignored, only with ``grad``). On a CPU the C++
    op does it in place of the logits (:func:`mhmoe.moe.dispatch.native.token_xent_`), elsewhere torch ops."""
    losses = token_xent_(logits, tgt, grad)
    if losses is not None:
        return losses, logits
    kept = (tgt != IGNORE).unsqueeze(1)
    idx = tgt.clamp(min=0).unsqueeze(1)
    x = logits.float()
    lse = torch.logsumexp(x, dim=1, keepdim=True)
    losses = torch.where(kept, lse - x.gather(1, idx), 0.0).squeeze(1)
    if not grad:
        return losses, logits
    prob = x.sub_(lse).exp_().scatter_add_(1, idx, -kept.float()).masked_fill_(~kept, 0.0)  # softmax - onehot
    return losses, prob.to(logits.dtype)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """loss = mean over kept rows of logsumexp(h W^T) - (h W^T)[target]; gradients computed in forward."""

    @staticmethod
    def forward(ctx: Any, h: Tensor, w: Tensor, tgt: Tensor, rows: int) -> Tensor:
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        count = (tgt != IGNORE).sum().float()
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        dh = torch.empty_like(h) if want_h else None
        dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if want_w else None
        for s in range(0, h.shape[0], rows):
            hc = h[s:s + rows]
            losses, grad = _rows(hc @ w.t(), tgt[s:s + rows], dh is not None or dw is not None)
            total = total + losses.sum()
            if dh is not None:
                torch.mm(grad, w, out=dh[s:s + rows])
            if dw is not None:
                if dw.dtype == grad.dtype:
                    dw.addmm_(grad.t(), hc)
                else:
                    dw.add_(grad.t() @ hc)
        ctx.save_for_backward(dh, dw, count)
        ctx.w_dtype = w.dtype
        return total / count

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        dh, dw, count = ctx.saved_tensors
        scale = grad_out / count
        gh = None if dh is None else dh * scale
        gw = None if dw is None else (dw * scale).to(ctx.w_dtype)
        return gh, gw, None, None
