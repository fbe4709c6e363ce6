"""The language-model loss: mean token cross-entropy, from logits or fused with the LM head in row chunks.

Shape legend: N = B * T positions, D model dim, V vocabulary, C rows of one chunk.

:func:`token_loss` is the reference: cross-entropy in fp32 of given logits [B, T, V].
:func:`chunked_token_loss` computes the same loss from the final hidden states and the LM head weight
without ever holding the [N, V] logits: per chunk of C rows it computes the logits (in the input dtype,
as ``nn.Linear`` under autocast), their log-sum-exp in fp32, the loss and, when a gradient is needed, the
chunk's logit gradient ``softmax - onehot`` and from it the chunk's input gradient [C, D] and its share of
the weight gradient [V, D] (accumulated in fp32). The backward only scales those by the incoming gradient.
Peak memory is one chunk's fp32 logits instead of the [N, V] logits in the compute dtype, an fp32 copy,
its log-softmax and their gradients (on CPU those buffers are hundreds of MB per step at the tiny presets'
16 x 256 x 8,192 and page-fault in whenever the allocator hands back fresh memory).
Measurements: docs/PERFORMANCE.md, "Whole models".
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE = -100  # target value of positions without a loss (masked or padding)
CHUNK_LOGITS = 1 << 23  # fp32 logits per chunk (32 MB): rows = CHUNK_LOGITS // V, at least MIN_CHUNK_ROWS
MIN_CHUNK_ROWS = 128
TINY = torch.finfo(torch.float32).tiny  # a position's loss is -log(max(p, TINY)): at most 87.3 nats


def token_loss(logits: Tensor, targets: Tensor, keep: Tensor | None = None) -> Tensor:
    """Mean cross-entropy, in fp32, of ``logits`` [B, T, V] against ``targets`` [B, T] over the positions
    ``keep`` [B, T] marks (all when None); no host synchronisation."""
    tgt = targets if keep is None else targets.masked_fill(~keep.bool(), IGNORE)
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=IGNORE)


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


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """loss = mean over kept rows of logsumexp(h W^T) - (h W^T)[target]; gradients computed in forward."""

    @staticmethod
    def forward(ctx: Any, h: Tensor, w: Tensor, tgt: Tensor, rows: int) -> Tensor:
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        kept = tgt != IGNORE
        count = kept.sum().float()
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        dh = torch.empty_like(h) if want_h else None
        dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if want_w else None
        for s in range(0, h.shape[0], rows):
            hc, tc, kc = h[s:s + rows], tgt[s:s + rows], kept[s:s + rows].unsqueeze(1)
            prob = torch.softmax(hc @ w.t(), dim=1, dtype=torch.float32)  # [C, V]
            idx = tc.clamp(min=0).unsqueeze(1)
            total = total - (prob.gather(1, idx).clamp_(min=TINY).log_() * kc).sum()
            if dh is None and dw is None:
                continue
            grad = prob.scatter_add_(1, idx, -kc.float()).to(h.dtype)  # softmax - onehot
            if dh is not None:  # ignored rows: no gradient (zeroed on the [C, D] side, not the [C, V] one)
                torch.mm(grad, w, out=dh[s:s + rows]).mul_(kc)
            if dw is not None:
                hk = hc * kc
                if dw.dtype == grad.dtype:
                    dw.addmm_(grad.t(), hk)
                else:
                    dw.add_(grad.t() @ hk)
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
