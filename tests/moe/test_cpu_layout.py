"""The CPU row layouts (rows per expert rounded up, every expert padded to the largest for batched GEMMs) against
the per-expert loop oracle: outputs and every gradient, random and degenerate routings, float32 and bfloat16."""

import dataclasses
import math

import pytest
import torch

from mhmoe.moe.capacity import apply_capacity
from mhmoe.moe.dispatch import choose_impl
from mhmoe.moe.dispatch.fused import fused_moe
from mhmoe.moe.dispatch.layout import batch_padding, block_sizes, round_up, row_layout
from mhmoe.moe.dispatch.padded import padded_moe
from mhmoe.moe.experts import GroupedExperts
from mhmoe.moe.reference import loop_moe
from mhmoe.moe.routers import RouterOutput

BATCHED = math.inf


def _route(experts: torch.Tensor, valid: torch.Tensor | None = None, gen: torch.Generator | None = None,
           dtype: torch.dtype = torch.float32) -> RouterOutput:
    S, K = experts.shape
    valid = torch.ones(S, K, dtype=torch.bool) if valid is None else valid
    w = torch.rand(S, K, generator=gen) * valid
    E = int(experts.max()) + 1 if experts.numel() else 1
    logits = torch.zeros(S, E)
    return RouterOutput(w.to(dtype).requires_grad_(), experts, valid, logits, logits.softmax(-1),
                        torch.bincount(experts[valid], minlength=E), torch.ones(S, dtype=torch.bool))


def _random_route(S: int, E: int, K: int, gen: torch.Generator, skew: float = 0.0,
                  capacity: int | None = None) -> RouterOutput:
    logits = torch.randn(S, E, generator=gen)
    logits[:, 0] += skew
    idx = logits.topk(K).indices
    valid = torch.ones_like(idx, dtype=torch.bool)
    if capacity is not None:
        valid = apply_capacity(idx, valid, capacity, E)
    return _route(idx, valid, gen)


def _grads(fn, x, route, experts):
    for t in (x, route.weights, *experts.parameters()):
        t.grad = None
    out = fn(x, route, experts)
    (out.float() * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), [x.grad, route.weights.grad] + [p.grad for p in experts.parameters()]


def _check_fp32(fn, x, route, experts):
    got, g_got = _grads(fn, x, route, experts)
    want, g_want = _grads(loop_moe, x, route, experts)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


VARIANTS = [dict(align=1), dict(align=8), dict(align=5, workers=3), dict(align=4, max_batch_padding=BATCHED),
            dict(align=1, max_batch_padding=BATCHED), dict(align=16, max_batch_padding=0.5),
            dict(align=3, chunk=2)]
CASES = [  # S, E, K, D, F, ffn, skew, capacity
    (37, 5, 2, 8, 24, "swiglu", 0.0, None),
    (64, 7, 3, 4, 40, "relu", 2.0, None),
    (50, 16, 1, 6, 12, "swiglu", 4.0, None),  # most experts empty
    (45, 4, 2, 8, 16, "relu", 0.0, 9),  # capacity drops: invalid slots
    (1, 3, 2, 8, 8, "swiglu", 0.0, None),  # one token
]


@pytest.mark.parametrize("S, E, K, D, Fh, ffn, skew, capacity", CASES)
@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_layouts_match_oracle_fp32(S, E, K, D, Fh, ffn, skew, capacity, kw):
    gen = torch.Generator().manual_seed(S * 100 + E)
    torch.manual_seed(S)
    experts = GroupedExperts(E, D, Fh, ffn, init_std=0.3)
    x = torch.randn(S, D, generator=gen, requires_grad=True)
    route = _random_route(S, E, K, gen, skew, capacity)
    _check_fp32(lambda *a: fused_moe(*a, **kw), x, route, experts)


@pytest.mark.parametrize("kw", [dict(align=16), dict(align=16, max_batch_padding=BATCHED)], ids=["aligned", "batched"])
def test_degenerate_routings(kw):
    """One expert gets every row, one a single row, the rest none; every slot invalid; a single token."""
    gen = torch.Generator().manual_seed(0)
    experts = GroupedExperts(4, 8, 12, init_std=0.3)
    x = torch.randn(9, 8, generator=gen, requires_grad=True)
    lopsided = torch.tensor([[2]] * 8 + [[0]])  # expert 2: 8 rows (not a multiple of 16), expert 0: one, 1 and 3 none
    _check_fp32(lambda *a: fused_moe(*a, **kw), x, _route(lopsided, gen=gen), experts)
    dead = _route(torch.zeros(9, 2, dtype=torch.long), torch.zeros(9, 2, dtype=torch.bool), gen)
    got, grads = _grads(lambda *a: fused_moe(*a, **kw), x, dead, experts)
    assert torch.equal(got, torch.zeros_like(got)) and all(torch.equal(g, torch.zeros_like(g)) for g in grads)
    one = x[:1].detach().requires_grad_()
    _check_fp32(lambda *a: fused_moe(*a, **kw), one, _route(torch.tensor([[3, 1]]), gen=gen), experts)


def test_layout_rows_and_padding():
    experts = torch.tensor([[1, 0], [1, 3], [0, 1], [1, 1]])
    valid = torch.tensor([[True, True], [True, True], [True, False], [True, True]])
    lay = row_layout(experts, valid, 4, align=4)
    assert lay.counts == [2, 4, 0, 1] and lay.sizes == [4, 4, 0, 4] and lay.starts == [0, 4, 8, 8] and not lay.batched
    assert lay.pad.tolist() == [2, 3, 9, 10, 11]
    assert lay.inv.tolist() == [4, 0, 5, 8, 1, 12, 6, 7]  # slot (s, k) -> row; the invalid slot -> R = 12
    assert lay.tok[lay.inv[valid.reshape(-1)]].tolist() == [0, 0, 1, 1, 2, 3, 3]
    batched = row_layout(experts, valid, 4, align=4, max_batch_padding=BATCHED)
    assert batched.batched and batched.sizes == [4] * 4 and batched.rows == 16
    assert batch_padding([2, 4, 0, 1], 4) == pytest.approx(16 / 7 - 1)
    assert not row_layout(experts, valid, 4, align=4, max_batch_padding=1.2).batched  # pads 16 / 7 - 1 = 1.29 > 1.2
    assert row_layout(experts, valid, 4, align=4, max_batch_padding=1.3).batched
    assert batch_padding([0, 0], 4) == math.inf and block_sizes([0, 3], 4, True) == [4, 4]
    assert [round_up(n, 16) for n in (0, 1, 16, 17)] == [0, 16, 16, 32]


def test_bf16_layouts_close_to_fp32_oracle():
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    experts = GroupedExperts(6, 16, 48, "swiglu", init_std=0.2)
    x = torch.randn(80, 16, generator=gen, requires_grad=True)
    route = _random_route(80, 6, 2, gen, skew=1.0)
    want, g_want = _grads(loop_moe, x, route, experts)
    eb = GroupedExperts(6, 16, 48, "swiglu").to(torch.bfloat16)
    eb.load_state_dict(experts.state_dict())
    for kw in (dict(align=16), dict(align=8, max_batch_padding=BATCHED), dict(align=1, workers=2)):
        xb = x.detach().bfloat16().requires_grad_()
        rb = dataclasses.replace(route, weights=route.weights.detach().bfloat16().requires_grad_())
        got, g_got = _grads(lambda *a, kw=kw: fused_moe(*a, **kw), xb, rb, eb)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.02)
        for a, b in zip(g_got, g_want, strict=True):
            torch.testing.assert_close(a.float(), b, rtol=0.05, atol=0.05 * float(b.abs().max()))


def test_padded_on_cpu_runs_the_batched_layout():
    gen = torch.Generator().manual_seed(2)
    experts = GroupedExperts(5, 8, 24, init_std=0.3)
    x = torch.randn(30, 8, generator=gen, requires_grad=True)
    route = _random_route(30, 5, 2, gen, skew=1.0)
    _check_fp32(padded_moe, x, route, experts)
    biased = GroupedExperts(5, 8, 24, bias=True, init_std=0.3)  # the composed path, not the fused function
    _check_fp32(padded_moe, x, route, biased)
    assert choose_impl("padded", x, experts) is padded_moe
