"""The expert backward of the Triton MoE path: which kernels run for which gradients (the kernels and their
launch wrappers are in :mod:`~mhmoe.moe.dispatch.triton.launch`, imported on first use: it needs triton).

Shape legend: S routed (sub-)tokens, K slots per token, SK = S*K, E experts, D expert width, F hidden width.

Its own module so that the import graph of this package is a DAG: :mod:`~mhmoe.moe.dispatch.triton.ops`
(the public entry) imports :mod:`~mhmoe.moe.dispatch.triton.custom_ops` lazily, and the custom ops import
this module, never ``ops``.
"""

from __future__ import annotations

from typing import cast

from torch import Tensor

from mhmoe.moe.dispatch.triton.tiles import fuse_dx


def kernels():
    """The launch module (:mod:`mhmoe.moe.dispatch.triton.launch`), imported on first use (needs triton)."""
    from mhmoe.moe.dispatch.triton import launch

    return launch


def expert_backward(dout: Tensor, x: Tensor, weights: Tensor, w1: Tensor, w2: Tensor, w3: Tensor | None, h1: Tensor,
                    h3: Tensor | None, valid: Tensor, plan, needs: tuple[bool, ...],
                    fused: bool | None = None) -> tuple[Tensor | None, ...]:
    """(dx [S, D], dweights [S, K], dW1 [E, D, F], dW2 [E, F, D], dW3 [E, D, F]), None where ``needs`` (x, weights,
    w1, w2, w3) is False. ``h1``, ``h3`` [SK, F]: the saved pre-activations by sorted row; ``plan``: the forward's
    :class:`~mhmoe.moe.dispatch.triton.launch.Plan`. Where :func:`~mhmoe.moe.dispatch.triton.tiles.fuse_dx` says
    so (``fused``: override) and the GPU's shared memory holds one of its configs, the input gradient comes out of
    the act_bwd pass itself (act_dx: the hidden gradients are never read back for dx)."""
    k = kernels()
    need_x, need_w, need_w1, need_w2, need_w3 = needs
    dh1 = dh3 = dw = gx = gw1 = gw2 = gw3 = None
    D = w1.shape[1]
    if need_x and fuse_dx(D, str(h1.dtype), fused) and k.fits_device("act_dx", k.dkey(h1.dtype), h3 is not None, D):
        gx, dh1, dh3, dw = k.act_dx_backward(dout, w1, w3, w2, weights, h1, h3, valid, plan,
                                             store_dh=need_w1 or need_w3, need_dw=need_w)
    else:
        need_dh = need_x or need_w1 or need_w3
        if need_dh or need_w:
            dh1, dh3, dw = k.act_backward(dout, w2, weights, h1, h3, plan, need_dh, need_w)
        if need_x:
            gx = k.dx_backward(dh1, dh3, w1, w3, valid, plan)
    if need_w1 or need_w3:
        gw1, gw3 = k.wgrad_up(x, dh1, dh3, plan)
    if need_w2:
        gw2 = k.wgrad_down(h1, h3, dout, weights, plan)
    dweights = cast(Tensor, dw).view(weights.shape).to(weights.dtype) if need_w else None  # set when need_w
    return gx, dweights, gw1 if need_w1 else None, gw2, gw3 if need_w3 else None
