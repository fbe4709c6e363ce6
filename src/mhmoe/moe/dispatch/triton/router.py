"""The fused token-choice router on the GPU: scores, gate, top-k, combine weights and per-expert counts in one
Triton kernel per block of tokens, and a two-kernel backward -- the same function as the softmax and
sigmoid routers of :mod:`mhmoe.moe.routers` (the reference), exact to fp32 rounding (see
:mod:`~mhmoe.moe.dispatch.triton.router_kernels` for how bf16 tensor-core MMAs give fp32 scores).

Shape legend: S routed (sub-)tokens, D router input width, E experts, K top-k slots.

:func:`fused_route` is a PyTorch custom operator (``mhmoe::triton_router``, opaque to ``torch.compile``, with
an autograd formula ``mhmoe::triton_router_backward``) and synchronises nothing with the host. What it
replaces, per forward and backward: the fp32 CUDA-core GEMM x W^T and its two backward GEMMs (now bf16
tensor-core MMAs on split operands), the copy of x to fp32, and the softmax, top-k, gather, renormalisation
and count passes over the [S, E] scores with their backward (now in registers), and the router losses' passes over
the scores: the kernel also reduces each row to its logsumexp and entropy and sums the routed rows' probabilities
per expert (``RouterOutput.sums``); their gradients join the scores' and probabilities' in torch ops before the
backward kernel, only for the losses that train.

:func:`supported` says where it runs: softmax or sigmoid gates, E <= :data:`MAX_EXPERTS`, K <= E, bf16 or fp32
inputs, on CUDA -- or on CPU tensors when the kernels were imported under the Triton interpreter (tests).
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from mhmoe.moe.dispatch.triton import kernels as K_
from mhmoe.moe.dispatch.triton import router_kernels as RK
from mhmoe.moe.dispatch.triton.tiles import next_pow2, padded

MAX_EXPERTS = 256  # the scores of a block of tokens stay in registers: [BM, next_pow2(E)] fp32
GATES = ("softmax", "sigmoid")
INTERPRETED = K_.INTERPRETED
# tokens per program (BM), reduction step over D (BK), output step over D in the backward (BN), warps
FWD = dict(BM=16, BK=32, num_warps=4) if INTERPRETED else dict(BM=64, BK=64, num_warps=8, num_stages=3)
BWD = dict(BM=16, BN=32, num_warps=4) if INTERPRETED else dict(BM=64, BN=64, num_warps=8, num_stages=2)
WGRAD = dict(BN=32, BK=32, num_warps=4) if INTERPRETED else dict(BN=64, BK=64, num_warps=8, num_stages=3)
WGRAD_CHUNKS = 64  # at most this many row chunks (partial weight gradients [chunks, E, D] fp32)


def supported(x: Tensor, n_experts: int, top_k: int, gate: str) -> bool:
    """Whether :func:`fused_route` runs for inputs x [S, D] (else the reference router runs)."""
    on_device = x.is_cuda or (x.device.type == "cpu" and INTERPRETED)
    return (on_device and gate in GATES and 1 <= top_k <= n_experts <= MAX_EXPERTS and x.dim() == 2
            and x.shape[0] > 0 and x.dtype in (torch.bfloat16, torch.float32))


def split_weight(w: Tensor) -> Tensor:
    """[3, E, D] bf16 (hi, mid, lo) with hi + mid + lo == w exactly in fp32, for w [E, D] fp32."""
    w = w.detach().float()
    hi = w.bfloat16()
    r = w - hi.float()
    mid = r.bfloat16()
    lo = (r - mid.float()).bfloat16()
    return torch.stack([hi, mid, lo]).contiguous()


def _ep(n_experts: int) -> int:
    return max(16, next_pow2(n_experts))


def _aligned(x: Tensor) -> Tensor:
    """x [S, D] with D zero-padded to a multiple of 16 (a copy, only for such widths): aligned row strides,
    pipelined loads. Zero columns meet zero columns of the padded weight parts: the scores are unchanged."""
    pad = padded(x.shape[1]) - x.shape[1]
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


def _weight_parts(w: Tensor) -> Tensor:
    """:func:`split_weight` with D zero-padded like :func:`_aligned`."""
    parts = split_weight(w)
    pad = padded(w.shape[1]) - w.shape[1]
    return torch.nn.functional.pad(parts, (0, pad)) if pad else parts


JIT = {"router_fwd": RK._router_fwd_kernel, "router_bwd": RK._router_bwd_kernel,
       "router_wgrad": RK._router_wgrad_kernel}


def smem_bytes(name: str, c: dict, x_item: int, ep: int) -> int:
    """Shared memory a router kernel's config needs (bytes; pipelined operand tiles per stage plus the operands
    staged once for the MMAs; at or above the sm_90a compiles of the report)."""
    stages = c.get("num_stages", 1)
    if name == "router_fwd":  # x [BM, BK] and three W^T parts [BK, EP] per stage
        return stages * (c["BM"] * c["BK"] * x_item + 3 * c["BK"] * ep * 2) + 8192
    if name == "router_bwd":  # three W parts [EP, BN] per stage; the split score gradient [BM, EP] x 3 once
        return stages * 3 * ep * c["BN"] * 2 + 3 * c["BM"] * ep * 2 + 16384
    return stages * (ep * c["BK"] * 4 + c["BK"] * c["BN"] * x_item) + 3 * ep * c["BK"] * 2  # router_wgrad: dl, x


def _fit(name: str, c: dict, x_item: int, ep: int) -> dict:
    """``c`` with fewer pipeline stages where the current GPU's shared memory is smaller than an H100's."""
    from mhmoe.moe.dispatch.triton.launch import _smem_limit

    limit = _smem_limit() if not INTERPRETED else None
    while limit is not None and c.get("num_stages", 1) > 1 and smem_bytes(name, c, x_item, ep) > limit:
        c = {**c, "num_stages": c["num_stages"] - 1}
    return c


def _launch(name: str, dtype: torch.dtype, grid: tuple, args: tuple, consts: dict) -> None:
    """Run (or, inside :func:`mhmoe.moe.dispatch.triton.launch.recording`, record for the compile report) one
    router kernel; ``dtype``: the input's (the MMAs are bf16 either way)."""
    from mhmoe.moe.dispatch.triton import launch as L

    if L._RECORD is not None:
        L._RECORD.append(L.Launch(name, L.dkey(dtype), args, consts))
        return
    JIT[name][grid](*args, **_fit(name, consts, torch.empty((), dtype=dtype).element_size(), consts["EP"]))


def _forward(x: Tensor, w: Tensor, bias: Tensor | None, token_mask: Tensor, top_k: int, gate: str,
             renorm: bool) -> list[Tensor]:
    """[logits [S, E] fp32, probs [S, E] fp32, weights [S, K] fp32, experts [S, K] int64, counts [E] int64, lse [S]
    fp32, entropy [S] fp32, prob_sum [E] fp32]: the last three the router losses' reductions
    (:class:`~mhmoe.moe.routers.GateSums`)."""
    x = _aligned(x)
    S, D = x.shape
    E = w.shape[0]
    EP, dev = _ep(E), x.device
    logits = torch.empty(S, E, dtype=torch.float32, device=dev)
    probs = torch.empty_like(logits)
    weights = torch.empty(S, top_k, dtype=torch.float32, device=dev)
    experts = torch.empty(S, top_k, dtype=torch.int64, device=dev)
    G = triton.cdiv(S, FWD["BM"])
    part = torch.empty(G, EP, dtype=torch.int32, device=dev)
    lse, entropy = torch.empty(S, dtype=torch.float32, device=dev), torch.empty(S, dtype=torch.float32, device=dev)
    psum = torch.empty(G, EP, dtype=torch.float32, device=dev)
    mask = token_mask.reshape(-1).contiguous().view(torch.uint8)
    wp = _weight_parts(w)
    _launch("router_fwd", x.dtype, (G,),
            (x, x.stride(0), x.stride(1), wp, wp if bias is None else bias.float().contiguous(), mask, logits, probs,
             weights, experts, part, lse, entropy, psum, S, D, E),
            dict(K=top_k, KP=next_pow2(top_k), EP=EP, X_SPLIT=x.dtype != torch.bfloat16, SIGMOID=gate == "sigmoid",
                 HAS_BIAS=bias is not None, RENORM=renorm, **FWD))
    counts = part.sum(0, dtype=torch.int64)[:E]
    return [logits, probs, weights, experts, counts, lse, entropy, psum.sum(0)[:E]]


def _backward(g_logits: Tensor | None, g_probs: Tensor | None, g_weights: Tensor | None, x: Tensor, w: Tensor,
              logits: Tensor, experts: Tensor, token_mask: Tensor, gate: str, renorm: bool,
              need_x: bool, need_w: bool) -> tuple[Tensor | None, Tensor | None]:
    """(dx [S, D] in x's dtype, dW [E, D] in w's dtype), None where not needed."""
    D0 = x.shape[1]
    x = _aligned(x)
    S, D = x.shape
    E, K = w.shape[0], experts.shape[1]
    EP, dev = _ep(E), x.device
    dl = torch.empty(S, E, dtype=torch.float32, device=dev)
    dx = torch.empty(S, D, dtype=x.dtype, device=dev) if need_x else None
    wp = _weight_parts(w)
    f32 = lambda g: None if g is None else g.float().contiguous()  # noqa: E731
    gl, gp, gw = f32(g_logits), f32(g_probs), f32(g_weights)
    mask = token_mask.reshape(-1).contiguous().view(torch.uint8)
    _launch("router_bwd", x.dtype, (triton.cdiv(S, BWD["BM"]),),
            (logits, experts, mask, logits if gl is None else gl, logits if gp is None else gp,
             logits if gw is None else gw, wp, dl, dl if dx is None else dx, D, S, D, E),
            dict(K=K, KP=next_pow2(K), EP=EP, SIGMOID=gate == "sigmoid", RENORM=renorm, HAS_GL=gl is not None,
                 HAS_GP=gp is not None, HAS_GW=gw is not None, NEED_DX=need_x, **BWD))
    dw = None
    if need_w:
        chunks = max(1, min(WGRAD_CHUNKS, triton.cdiv(S, 4 * WGRAD["BK"])))
        rows = triton.cdiv(triton.cdiv(S, chunks), WGRAD["BK"]) * WGRAD["BK"]
        chunks = triton.cdiv(S, rows)
        part = torch.empty(chunks, E, D, dtype=torch.float32, device=dev)
        _launch("router_wgrad", x.dtype, (triton.cdiv(D, WGRAD["BN"]), chunks),
                (dl, x, x.stride(0), x.stride(1), part, S, D, E, rows),
                dict(EP=EP, X_SPLIT=x.dtype != torch.bfloat16, **WGRAD))
        dw = part.sum(0)[:, :D0].to(w.dtype)
    return (None if dx is None else dx[:, :D0]), dw


@torch.library.custom_op("mhmoe::triton_router", mutates_args=())
def triton_router(x: Tensor, w: Tensor, bias: Tensor | None, token_mask: Tensor, top_k: int, gate: str,
                  renorm: bool) -> list[Tensor]:
    """[logits, probs, weights, experts, counts, lse, entropy, prob_sum] (see :func:`_forward`)."""
    return _forward(x, w, bias, token_mask, top_k, gate, renorm)


@triton_router.register_fake
def _(x, w, bias, token_mask, top_k, gate, renorm):
    S, E = x.shape[0], w.shape[0]
    f32 = dict(dtype=torch.float32)
    return [x.new_empty(S, E, **f32), x.new_empty(S, E, **f32), x.new_empty(S, top_k, **f32),
            x.new_empty(S, top_k, dtype=torch.int64), x.new_empty(E, dtype=torch.int64), x.new_empty(S, **f32),
            x.new_empty(S, **f32), x.new_empty(E, **f32)]


@torch.library.custom_op("mhmoe::triton_router_backward", mutates_args=())
def triton_router_backward(g_logits: Tensor | None, g_probs: Tensor | None, g_weights: Tensor | None, x: Tensor,
                           w: Tensor, logits: Tensor, experts: Tensor, token_mask: Tensor, gate: str, renorm: bool,
                           needs: list[bool]) -> list[Tensor]:
    """[dx, dW]; an empty tensor where ``needs`` (x, w) is False."""
    dx, dw = _backward(g_logits, g_probs, g_weights, x, w, logits, experts, token_mask, gate, renorm, *needs)
    return [x.new_empty(0) if dx is None else dx, w.new_empty(0) if dw is None else dw]


@triton_router_backward.register_fake
def _(g_logits, g_probs, g_weights, x, w, logits, experts, token_mask, gate, renorm, needs):
    return [x.new_empty(x.shape) if needs[0] else x.new_empty(0), w.new_empty(w.shape) if needs[1] else w.new_empty(0)]


def _setup_context(ctx, inputs, output) -> None:
    x, w, bias, token_mask, top_k, gate, renorm = inputs
    logits, probs, _, experts, *_ = output
    ctx.gate, ctx.renorm = gate, renorm
    ctx.set_materialize_grads(False)  # an output the loss does not use contributes nothing (None, not zeros)
    ctx.save_for_backward(x, w, logits, probs, experts, token_mask)


def _sums_grads(g_logits: Tensor | None, g_probs: Tensor | None, g_lse: Tensor | None, g_entropy: Tensor | None,
                g_sum: Tensor | None, logits: Tensor, probs: Tensor, token_mask: Tensor,
                gate: str) -> tuple[Tensor | None, Tensor | None]:
    """The gradients of the reductions (lse [S], entropy [S], prob_sum [E]) added to those of the scores and the
    probabilities the backward kernel takes: d lse / d logits = softmax(logits) (the probabilities of a softmax
    gate); d(-p log(p + tiny)) / dp = -(log(p + tiny) + p / (p + tiny)) (the reference's formula); d prob_sum /
    d probs = the token mask. Torch ops, only for the reductions a loss trains (weight 0: logged, no gradient)."""
    if g_lse is not None:
        d = g_lse.float()[:, None] * (probs if gate == "softmax" else logits.softmax(-1))
        g_logits = d if g_logits is None else g_logits + d
    extra = []
    if g_entropy is not None:
        tiny = torch.finfo(torch.float32).tiny
        extra.append(-g_entropy.float()[:, None] * ((probs + tiny).log() + probs / (probs + tiny)))
    if g_sum is not None:
        extra.append(token_mask.reshape(-1, 1).to(torch.float32) * g_sum.float()[None, :])
    for d in extra:
        g_probs = d if g_probs is None else g_probs + d
    return g_logits, g_probs


def _autograd(ctx, grads: list[Tensor | None]):
    x, w, logits, probs, experts, token_mask = ctx.saved_tensors
    needs = [bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1])]
    g_weights = grads[2]
    g_logits, g_probs = _sums_grads(grads[0], grads[1], grads[5], grads[6], grads[7], logits, probs, token_mask,
                                    ctx.gate)
    if not any(needs) or all(g is None for g in (g_logits, g_probs, g_weights)):
        return None, None, None, None, None, None, None
    dx, dw = triton_router_backward(g_logits, g_probs, g_weights, x, w, logits, experts, token_mask, ctx.gate,
                                    ctx.renorm, needs)
    return dx if needs[0] else None, dw if needs[1] else None, None, None, None, None, None


triton_router.register_autograd(_autograd, setup_context=_setup_context)


def fused_route(x: Tensor, w: Tensor, bias: Tensor | None, token_mask: Tensor, top_k: int, gate: str,
                renorm: bool) -> tuple[Tensor, ...]:
    """(logits [S, E], probs [S, E], weights [S, K], experts [S, K], counts [E], lse [S], entropy [S], prob_sum [E])
    of x [S, D] (bf16 or fp32) with the router weight w [E, D] (fp32), the selection bias [E] (or None) and
    token_mask [S] bool: the gate ``softmax`` (probs = gate) or ``sigmoid`` (probs = gate / sum), top-k of gate +
    bias, combine weights gathered from the gate (divided by their sum, floored at 1e-9, when ``renorm``), 0 on
    masked tokens; counts of the valid slots; each row's logsumexp of the scores and entropy of the probabilities,
    and the probabilities of the routed tokens summed per expert (the router losses' reductions). Autograd: to x and
    w through logits, probs, weights and the reductions."""
    return tuple(triton_router(x, w, bias, token_mask, top_k, gate, renorm))
