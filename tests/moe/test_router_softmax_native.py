"""The softmax router's C++ element-wise pass (mhmoe.moe.dispatch.native.router) against the reference router ops:
the same experts, the weights, probabilities and every gradient to fp32 rounding; the reference wherever it does
not apply."""

import pytest
import torch
import torch.utils.flop_counter

from mhmoe.config.moe import MoEConfig
from mhmoe.moe.dispatch import native
from mhmoe.moe.dispatch.native import router as native_router
from mhmoe.moe.routers import build_router

needs_ext = pytest.mark.skipif(native.expert_ops(torch.float32) is None, reason="C++ extension not built here")


def _run(router, x, mask, loss_of, reference: bool):
    """The router's output and the gradients of loss_of(output) to x and the router weight."""
    xx = x.clone().requires_grad_()
    router.zero_grad()
    if reference:
        with native.disabled():
            out = router(xx, mask)
    else:
        out = router(xx, mask)
    loss_of(out).backward()
    return out, xx.grad, router.weight.grad.clone()


LOSSES = {
    "weights": lambda o: (o.weights * torch.linspace(-1, 2, o.weights.shape[1])).sum(),
    "probs": lambda o: (o.probs ** 2).sum(),  # as the balance loss: through probs alone
    "all": lambda o: o.weights.sum() + (o.probs ** 2).sum() + torch.logsumexp(o.logits, -1).pow(2).mean(),
}


@needs_ext
@pytest.mark.parametrize("aux_free", [False, True])
@pytest.mark.parametrize("k, E, renorm", [(1, 16, None), (2, 16, None), (3, 96, None), (2, 8, False), (8, 33, True)])
@pytest.mark.parametrize("loss", list(LOSSES))
def test_matches_the_reference_router(aux_free, k, E, renorm, loss):
    torch.manual_seed(k * E)
    extra = {} if renorm is None else {"renormalize": renorm}
    cfg = MoEConfig(n_experts=E, top_k=k, aux_free_bias=aux_free, **extra)
    router = build_router(40, cfg)
    if aux_free:
        router.selection_bias.copy_(torch.randn(E) * 0.01)
    x, mask = torch.randn(300, 40), torch.rand(300) > 0.1
    calls = []
    real = native_router.softmax_topk

    def spy(*a, **kw):
        out = real(*a, **kw)
        calls.append(out is not None)
        return out

    native_router.softmax_topk, was = spy, native_router.softmax_topk
    try:
        got, gx, gw = _run(router, x, mask, LOSSES[loss], reference=False)
    finally:
        native_router.softmax_topk = was
    want, wx, ww = _run(router, x, mask, LOSSES[loss], reference=True)
    assert calls == [True]  # the C++ pass ran (and the reference did not call it)
    assert torch.equal(got.experts, want.experts) and torch.equal(got.counts, want.counts)
    assert torch.equal(got.valid, want.valid) and (got.weights[~mask] == 0).all()
    torch.testing.assert_close(got.probs, want.probs, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got.weights, want.weights, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)
    for g, w in ((gx, wx), (gw, ww)):  # sums of cancelling terms: to the gradient's scale
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-4 * w.abs().max().item())


@needs_ext
def test_tied_scores_run_the_reference():
    """A zero router weight gives every expert the same probability: torch.topk's tie rule decides, as without the
    extension."""
    router = build_router(16, MoEConfig(n_experts=8, top_k=2))
    with torch.no_grad():
        router.weight.zero_()
    x, mask = torch.randn(50, 16), torch.ones(50, dtype=torch.bool)
    got = router(x, mask)
    with native.disabled():
        want = router(x, mask)
    assert torch.equal(got.experts, want.experts) and torch.equal(got.weights, want.weights)
    assert native_router.softmax_topk(torch.zeros(4, 8), None, torch.ones(4, dtype=torch.bool), 2, True) is None
    assert native_router.softmax_topk(torch.tensor([[0.0, float("nan"), 1.0]]), None, torch.ones(1, dtype=torch.bool),
                                      1, True) is None


@needs_ext
@pytest.mark.parametrize("name", ["sigmoid", "noisy", "xmoe"])
def test_other_routers_keep_their_ops(name, monkeypatch):
    def refuse(*a, **kw):
        raise AssertionError("the softmax pass ran for another gate")

    monkeypatch.setattr(native_router, "softmax_topk", refuse)
    router = build_router(16, MoEConfig(n_experts=8, top_k=2, router=name))
    out = router(torch.randn(20, 16))
    assert out.experts.shape == (20, 2)


def test_does_not_apply_off_its_inputs():
    x = torch.randn(4, 8)
    assert not native_router.applies(x, 8, 8)  # k = E: torch.topk's domain
    assert not native_router.applies(x, 8, native.MAX_TOPK + 1)
    with native.disabled():
        assert not native_router.applies(x, 8, 2)
    with torch.utils.flop_counter.FlopCounterMode(display=False):  # FLOP counts see the reference ops
        assert not native_router.applies(x, 8, 2)
    assert native_router.applies(x, 8, 2) == (native.expert_ops(torch.float32) is not None)


def _reference_sums(out, mask):
    """The GateSums fields from the reference formulas (mhmoe.moe.losses' own) on a route's logits and probs."""
    eps = torch.finfo(torch.float32).tiny
    return (torch.logsumexp(out.logits, -1), -(out.probs * (out.probs + eps).log()).sum(-1),
            (out.probs * mask[:, None]).sum(0))


@needs_ext
@pytest.mark.parametrize("spread", [1.0, 60.0])  # 60: most probabilities underflow to zero
def test_gate_sums_match_the_reference_formulas(spread):
    """The pass's logsumexp, entropy and per-expert sums: the reference formulas' values and gradients (to x and the
    router weight) to fp32 rounding, with and without underflowing probabilities."""
    torch.manual_seed(3)
    router = build_router(40, MoEConfig(n_experts=96, top_k=3))
    x, mask = torch.randn(700, 40) * spread, torch.rand(700) > 0.2
    coef = [torch.randn(700), torch.randn(700), torch.randn(96)]

    def loss_of(sums):
        return sum((c * s).sum() for c, s in zip(coef, sums, strict=True))

    got, gx, gw = _run(router, x, mask, lambda o: loss_of((o.sums.lse, o.sums.entropy, o.sums.prob_sum)), False)
    want, wx, ww = _run(router, x, mask, lambda o: loss_of(_reference_sums(o, mask)), True)
    assert want.sums is None and got.sums is not None
    for g, w in zip((got.sums.lse, got.sums.entropy, got.sums.prob_sum), _reference_sums(want, mask), strict=True):
        torch.testing.assert_close(g, w.detach(), rtol=1e-5, atol=1e-5)
    assert got.sums.entropy.min() >= -1e-6 and got.sums.entropy.max() <= torch.log(torch.tensor(96.0)) + 1e-5
    for g, w in ((gx, wx), (gw, ww)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4 * w.abs().max().item())


@needs_ext
def test_prob_sum_is_the_same_on_any_thread_count():
    router = build_router(32, MoEConfig(n_experts=24, top_k=2))
    x, mask = torch.randn(3000, 32), torch.rand(3000) > 0.1
    was = torch.get_num_threads()
    try:
        sums = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            with torch.no_grad():
                sums.append(router(x, mask).sums.prob_sum)
    finally:
        torch.set_num_threads(was)
    assert torch.equal(sums[0], sums[1]) and torch.equal(sums[0], sums[2])


@needs_ext
@pytest.mark.parametrize("mode", ["token", "batch"])
def test_router_losses_from_the_pass_match_the_reference(mode):
    """A layer whose balance, z and entropy losses all train: the same aux loss and gradients with the pass's
    reductions as with the reference ops over the scores."""
    from mhmoe.moe.layers import MoELayer

    torch.manual_seed(1)
    cfg = MoEConfig(n_experts=16, top_k=2, d_expert=32, z_loss_weight=0.1, entropy_loss_weight=0.3,
                    entropy_mode=mode)
    layer = MoELayer(24, cfg)
    x, mask = torch.randn(400, 24), torch.rand(400) > 0.1

    def run(reference: bool):
        layer.zero_grad()
        xx = x.clone().requires_grad_()
        if reference:
            with native.disabled():
                out = layer(xx, mask)
        else:
            out = layer(xx, mask)
        assert (out.route.sums is None) == reference
        out.aux_loss.backward()
        return out, xx.grad, layer.router.weight.grad.clone()

    got, gx, gw = run(False)
    want, wx, ww = run(True)
    for k in ("balance", "z", "entropy"):  # the batch entropy log E - H(mean p) cancels to ~1e-5: fp32 steps of 2e-7
        torch.testing.assert_close(got.losses[k], want.losses[k], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=1e-5, atol=1e-6)
    for g, w in ((gx, wx), (gw, ww)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4 * w.abs().max().item())


@needs_ext
def test_entropy_gradient_is_finite_at_a_minus_inf_score():
    """A score of -inf (probability 0): the entropy's gradient takes log(p + tiny) there, as the reference formula,
    not -inf (whose product with p = 0 would be NaN)."""
    ops = native._ops()
    logits = torch.tensor([[0.0, 1.0, float("-inf"), 2.0], [0.5, -1.0, 0.0, 3.0]], requires_grad=True)
    mask = torch.ones(2, dtype=torch.bool)
    probs, _, ids, tied, lse, entropy, _ = ops.softmax_topk(logits.detach(), None, mask, 1, True)
    assert not tied.any()
    eps = torch.finfo(torch.float32).tiny
    p = logits.softmax(-1)
    (-(p * (p + eps).log()).sum(-1)).sum().backward()
    dl = ops.softmax_topk_backward(logits.detach(), probs, lse, ids, mask, None, None, None, torch.ones(2), None, True)
    assert torch.isfinite(dl).all()
    torch.testing.assert_close(entropy, -(p * (p + eps).log()).sum(-1).detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dl, logits.grad, rtol=1e-5, atol=1e-6)
