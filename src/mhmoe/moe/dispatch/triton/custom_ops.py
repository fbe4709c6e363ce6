"""The Triton MoE path as PyTorch custom operators (``torch.library.custom_op``): opaque to ``torch.compile``
(no graph break, no tracing into Triton launches), with shape-only fake implementations, and free of host
synchronisation -- so a compiled training step that runs them can be captured as a CUDA graph.

Shape legend: S routed (sub-)tokens, K slots per token, SK = S*K, E experts, D expert width, F hidden width.

- ``mhmoe::triton_moe_train`` (x, weights [S, K], W1, W2, W3?, experts [S, K], valid [S, K], E) -> [out [S, D],
  h1 [SK, F], h3 [SK, F] (empty for ReLU), the routing plan's tensors]; its autograd formula runs
- ``mhmoe::triton_moe_backward`` -> [dx, dweights, dW1, dW2, dW3] (empty tensors where no gradient is needed);
- ``mhmoe::triton_moe_infer`` (same inputs) -> out, storing only the activation (no autograd).

The plan (sort order, expert row ranges, one tile table per row-tile size) is an output of the forward so
the backward reuses it instead of sorting again.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mhmoe.moe.dispatch.triton.backward import expert_backward
from mhmoe.moe.dispatch.triton.backward import kernels as _L


def _plan_tensors(plan) -> list[Tensor]:
    out = [plan.order, plan.starts, plan.ends]
    for bm in sorted(plan.tiles):
        out += list(plan.tiles[bm])
    return out


def _plan(tensors: list[Tensor], dtype: torch.dtype, S: int, K: int, E: int):
    L = _L()
    bms = L.plan_block_ms(dtype)
    tiles = {bm: (tensors[3 + 2 * i], tensors[4 + 2 * i]) for i, bm in enumerate(bms)}
    return L.Plan(tensors[0], tensors[1], tensors[2], tiles, S, K, E)


def _fake_plan(experts: Tensor, dtype: torch.dtype, E: int) -> list[Tensor]:
    L = _L()
    SK = experts.numel()
    i32: dict[str, Any] = dict(dtype=torch.int32, device=experts.device)
    out = [experts.new_empty(SK, **i32), experts.new_empty(E, **i32), experts.new_empty(E, **i32)]
    for bm in L.plan_block_ms(dtype):
        n = L.n_tiles(SK, E, bm)
        out += [experts.new_empty(n, **i32), experts.new_empty(n, **i32)]
    return out


def _act(w3: Tensor | None) -> str:
    return "relu" if w3 is None else "swiglu"


@torch.library.custom_op("mhmoe::triton_moe_train", mutates_args=())
def triton_moe_train(x: Tensor, weights: Tensor, w1: Tensor, w2: Tensor, w3: Tensor | None, experts: Tensor,
                     valid: Tensor, n_experts: int) -> list[Tensor]:
    """Forward for training: [out, h1, h3, *plan]."""
    L = _L()
    plan = L.route_plan(experts, valid, n_experts, L.plan_block_ms(x.dtype))
    h1, h3, _ = L.up_forward(x, w1, w3, plan, store_pre=True)
    out = L.down_forward(h1, h3, w2, weights, valid, plan, _act(w3))
    return [out, h1, h3 if h3 is not None else h1.new_empty(0), *_plan_tensors(plan)]


@triton_moe_train.register_fake
def _(x, weights, w1, w2, w3, experts, valid, n_experts):
    SK, F = experts.numel(), w1.shape[2]
    h = x.new_empty(SK, F)
    return [x.new_empty(x.shape), h, x.new_empty(SK, F) if w3 is not None else x.new_empty(0),
            *_fake_plan(experts, x.dtype, n_experts)]


@torch.library.custom_op("mhmoe::triton_moe_infer", mutates_args=())
def triton_moe_infer(x: Tensor, weights: Tensor, w1: Tensor, w2: Tensor, w3: Tensor | None, experts: Tensor,
                     valid: Tensor, n_experts: int) -> Tensor:
    """Forward without autograd: only the activation [SK, F] is stored between the two GEMMs."""
    L = _L()
    plan = L.route_plan(experts, valid, n_experts, L.plan_block_ms(x.dtype))
    _, _, act = L.up_forward(x, w1, w3, plan, store_pre=False)
    return L.down_forward(act, None, w2, weights, valid, plan, "none")


@triton_moe_infer.register_fake
def _(x, weights, w1, w2, w3, experts, valid, n_experts):
    return x.new_empty(x.shape)


@torch.library.custom_op("mhmoe::triton_moe_backward", mutates_args=())
def triton_moe_backward(dout: Tensor, x: Tensor, weights: Tensor, w1: Tensor, w2: Tensor, w3: Tensor | None,
                        h1: Tensor, h3: Tensor | None, valid: Tensor, plan: list[Tensor], n_experts: int,
                        needs: list[bool]) -> list[Tensor]:
    """[dx, dweights, dW1, dW2, dW3]; an empty tensor where ``needs`` (x, weights, w1, w2, w3) is False."""
    S, K = valid.shape
    grads = expert_backward(dout.to(h1.dtype), x, weights, w1, w2, w3, h1, h3, valid,
                            _plan(plan, h1.dtype, S, K, n_experts), tuple(needs))
    return [g if g is not None else x.new_empty(0) for g in grads]


@triton_moe_backward.register_fake
def _(dout, x, weights, w1, w2, w3, h1, h3, valid, plan, n_experts, needs):
    like = [x, weights, w1, w2, w3]
    return [t.new_empty(t.shape) if need and t is not None else x.new_empty(0) for t, need in zip(like, needs,
                                                                                                 strict=True)]


def _setup_context(ctx, inputs, output) -> None:
    x, weights, w1, w2, w3, experts, valid, n_experts = inputs
    _, h1, h3, *plan = output
    ctx.n_experts, ctx.gated, ctx.n_plan = n_experts, w3 is not None, len(plan)
    ctx.save_for_backward(x, weights, w1, w2, w3, h1, h3 if w3 is not None else None, valid, *plan)


def _backward(ctx, grads: list[Tensor]):
    x, weights, w1, w2, w3, h1, h3, valid, *plan = ctx.saved_tensors
    needs = [bool(n) for n in ctx.needs_input_grad[:5]]
    if w3 is None:
        needs[4] = False
    dout = grads[0]
    if dout is None or not any(needs):
        return None, None, None, None, None, None, None, None
    g = triton_moe_backward(dout, x, weights, w1, w2, w3, h1, h3, valid, list(plan), ctx.n_experts, needs)
    return (*[t if need else None for t, need in zip(g, needs, strict=True)], None, None, None)


triton_moe_train.register_autograd(_backward, setup_context=_setup_context)
