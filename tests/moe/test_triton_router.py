"""The fused Triton router (mhmoe.moe.dispatch.triton.router) against the reference routers of mhmoe.moe.routers:
scores, probabilities, combine weights, expert ids and counts, the router losses' reductions (logsumexp, entropy,
probabilities summed per expert), and the gradients of x and the router weight through all of them, at the router
tests' tolerances (rtol 1e-5); random and degenerate shapes (one token, one expert, k = E, widths off every tile,
masked tokens, selection bias); and causality.

Without CUDA the kernels run under the Triton interpreter (set before the kernels are imported, as in
test_triton_dispatch.py).
"""

import importlib
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from mhmoe.config.moe import MoEConfig  # noqa: E402
from mhmoe.moe.routers import build_router  # noqa: E402

kernels = importlib.import_module("mhmoe.moe.dispatch.triton.kernels")
if not CUDA and not kernels.INTERPRETED:  # imported compiled before this module set the variable
    kernels = importlib.reload(kernels)
    for name in ("launch", "router_kernels", "router"):
        importlib.reload(importlib.import_module(f"mhmoe.moe.dispatch.triton.{name}"))
fused = importlib.import_module("mhmoe.moe.dispatch.triton.router")
DEV = "cuda" if CUDA else "cpu"


def _pair(router: str, E: int, K: int, D: int, renorm: bool, aux_free: bool, seed: int):
    """(reference router, the same router on the fused path), equal weights."""
    cfg = dict(n_experts=E, top_k=K, d_expert=8, router=router, renormalize=renorm, aux_free_bias=aux_free,
               init_std=0.5)
    ref = build_router(D, MoEConfig(**cfg, impl="sorted")).to(DEV)
    new = build_router(D, MoEConfig(**cfg, impl="triton")).to(DEV)
    torch.manual_seed(seed)
    new.load_state_dict(ref.state_dict())
    if aux_free:
        bias = torch.randn(E, device=DEV) * 0.05
        ref.selection_bias.copy_(bias)
        new.selection_bias.copy_(bias)
    return ref, new


def _sums(out, mask, own: bool):
    """The router losses' reductions of a route: the router's own (``own``: GateSums), else the reference formulas
    of mhmoe.moe.losses on its scores and probabilities."""
    if own:
        return out.sums.lse, out.sums.entropy, out.sums.prob_sum
    m = torch.ones(out.probs.shape[0], device=out.probs.device) if mask is None else mask.float()
    tiny = torch.finfo(torch.float32).tiny
    return (torch.logsumexp(out.logits, -1), -(out.probs * (out.probs + tiny).log()).sum(-1),
            (out.probs * m[:, None]).sum(0))


def _run(router, x, mask, coef, own_sums: bool):
    """Outputs, the losses' reductions and the gradients of x and the weight under a fixed linear loss of logits,
    probs, weights and the reductions."""
    x = x.detach().clone().requires_grad_()
    router.weight.grad = None
    out = router(x, mask)
    sums = _sums(out, mask, own_sums)
    loss = (out.logits * coef[0]).sum() + (out.probs * coef[1]).sum() + (out.weights * coef[2]).sum()
    loss = loss + sum((s * c).sum() for s, c in zip(sums, coef[3:], strict=True))
    loss.backward()
    return out, sums, x.grad, router.weight.grad


CASES = [  # router, S, E, K, D, renorm, aux_free, x dtype, masked
    ("softmax", 37, 5, 2, 8, True, False, torch.float32, False),
    ("softmax", 29, 93, 3, 40, True, False, torch.bfloat16, True),  # mh3's expert count, D past one step
    ("sigmoid", 23, 16, 3, 100, True, True, torch.float32, True),  # selection bias, D off the tile
    ("sigmoid", 19, 6, 2, 24, False, False, torch.bfloat16, False),
    ("softmax", 1, 7, 1, 12, False, True, torch.float32, False),  # one token
    ("softmax", 21, 1, 1, 16, True, False, torch.bfloat16, True),  # one expert
    ("softmax", 18, 4, 4, 20, True, False, torch.float32, False),  # k = E
]


@pytest.mark.parametrize("router, S, E, K, D, renorm, aux_free, dtype, masked", CASES)
def test_matches_the_reference_router(router, S, E, K, D, renorm, aux_free, dtype, masked):
    ref, new = _pair(router, E, K, D, renorm, aux_free, seed=S + E)
    gen = torch.Generator().manual_seed(S * 7 + E)
    x = torch.randn(S, D, generator=gen).to(DEV, dtype)
    mask = (torch.rand(S, generator=gen) > 0.3).to(DEV) if masked else None
    coef = [torch.randn(S, E, generator=gen).to(DEV), torch.randn(S, E, generator=gen).to(DEV),
            torch.randn(S, K, generator=gen).to(DEV), torch.randn(S, generator=gen).to(DEV),
            torch.randn(S, generator=gen).to(DEV), torch.randn(E, generator=gen).to(DEV)]
    assert fused.supported(x, E, K, router)
    want, want_sums, gx_want, gw_want = _run(ref, x, mask, coef, own_sums=False)
    got, got_sums, gx_got, gw_got = _run(new, x, mask, coef, own_sums=True)  # the kernel's reductions
    assert torch.equal(got.experts, want.experts) and torch.equal(got.valid, want.valid)
    assert torch.equal(got.counts, want.counts) and got.counts.dtype == torch.int64
    for name in ("logits", "probs", "weights"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-5, atol=1e-6, msg=name)
    for name, g, w in zip(("lse", "entropy", "prob_sum"), got_sums, want_sums, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=name)
    scale = gw_want.abs().max().item()
    torch.testing.assert_close(gw_got, gw_want, rtol=1e-5, atol=1e-5 * scale)
    assert gx_got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(gx_got, gx_want, rtol=1e-5, atol=1e-5 * gx_want.abs().max().item())
    else:  # the reference rounds its fp32 input gradient to bf16 once, and so does the kernel: 1 ulp apart at most
        torch.testing.assert_close(gx_got.float(), gx_want.float(), rtol=2**-7, atol=2**-7 * gx_want.abs().max().item())


def test_routing_is_causal():
    """A token's routing depends on its own row only: changing later tokens changes nothing before them."""
    _, new = _pair("softmax", 9, 3, 16, True, True, seed=0)
    x = torch.randn(20, 16, device=DEV)
    a = new(x)
    x2 = x.clone()
    x2[12:] = torch.randn(8, 16, device=DEV) * 5
    b = new(x2)
    for name in ("logits", "probs", "weights", "experts"):
        assert torch.equal(getattr(a, name)[:12], getattr(b, name)[:12]), name


def test_used_only_where_it_applies():
    """The fused path runs for softmax/sigmoid routers with impl auto/triton on CUDA (on CPU: impl triton under
    the interpreter); other routers, impls and an empty batch take the reference path."""
    x = torch.randn(5, 8, device=DEV)
    seen = []
    real = fused.fused_route
    try:
        fused.fused_route = lambda *a: seen.append(1) or real(*a)
        for router, impl, calls in (("softmax", "triton", 1), ("sigmoid", "triton", 1), ("noisy", "triton", 0),
                                    ("xmoe", "triton", 0), ("softmax", "sorted", 0),
                                    ("softmax", "auto", 1 if CUDA else 0)):
            seen.clear()
            build_router(8, MoEConfig(n_experts=4, top_k=2, d_expert=8, router=router, impl=impl)).to(DEV)(x)
            assert len(seen) == calls, (router, impl)
        seen.clear()
        out = build_router(8, MoEConfig(n_experts=4, top_k=2, d_expert=8, impl="triton")).to(DEV)(x[:0])
        assert not seen and out.weights.shape == (0, 2)
    finally:
        fused.fused_route = real


def test_split_weight_is_exact():
    w = torch.randn(93, 256) * 0.02
    parts = fused.split_weight(w)
    assert parts.dtype == torch.bfloat16 and parts.shape == (3, 93, 256)
    assert torch.equal(parts[0].float() + parts[1].float() + parts[2].float(), w)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_at_mh3_size_matches_and_never_synchronises(dtype):
    """Compiled on the GPU at the mh3 router's size (49,152 sub-tokens of width 256, 93 experts, top-3): the same
    routing and gradients as the reference, and no host synchronisation in the forward or the backward."""
    S, E, K, D = 49152, 93, 3, 256
    ref, new = _pair("softmax", E, K, D, True, False, seed=0)
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(S, D, generator=gen) * 0.5).to(DEV, dtype)
    coef = [torch.randn(S, E, generator=gen).to(DEV), torch.randn(S, E, generator=gen).to(DEV),
            torch.randn(S, K, generator=gen).to(DEV), torch.randn(S, generator=gen).to(DEV),
            torch.randn(S, generator=gen).to(DEV), torch.randn(E, generator=gen).to(DEV)]
    want, want_sums, gx_want, gw_want = _run(ref, x, None, coef, own_sums=False)
    got, got_sums, gx_got, gw_got = _run(new, x, None, coef, own_sums=True)  # compiles first: that synchronises
    assert (got.experts == want.experts).float().mean() > 0.999  # ties within fp32 rounding may swap a slot
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    for name, g, w in zip(("lse", "entropy", "prob_sum"), got_sums, want_sums, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-4, msg=name)
    torch.testing.assert_close(gw_got, gw_want, rtol=1e-4, atol=1e-4 * gw_want.abs().max().item())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _run(new, x, None, coef, own_sums=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
