"""MoE / MH-MoE layers: the grouped dispatch path against the per-expert loop oracle, and the
invariants (h=1 without head/merge == plain MoE; one expert with k=1 == dense FFN)."""


import pytest
import torch
from helpers import BF16_REL, assert_close_in_norm, oracle_pair

from mhmoe.config.moe import ROUTERS, MoEConfig
from mhmoe.moe.capacity import apply_capacity
from mhmoe.moe.experts import DenseFFN
from mhmoe.moe.layers import DenseLayer, MHMoELayer, MoELayer, build_ffn_layer


def _run(layer, x, mask, seed=0):
    torch.manual_seed(seed)  # noisy router: identical noise in both paths
    x = x.clone().requires_grad_(True)
    out = layer(x, mask)
    g = torch.randn_like(out.out, dtype=torch.float32).to(out.out.dtype)  # the same draw in every dtype
    ((out.out * g).sum() + out.aux_loss).backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return out, x.grad, grads


CASES = [
    # (router, top_k, capacity_factor, heads, masked)
    ("softmax", 1, None, 1, False),
    ("softmax", 2, None, 2, True),
    ("softmax", 3, 1.0, 4, True),
    ("softmax", 2, 0.5, 1, False),
    ("sigmoid", 3, None, 2, True),
    ("xmoe", 2, 1.25, 4, True),
    ("noisy", 2, None, 2, False),
    ("expert_choice", 2, None, 2, True),
]


@pytest.mark.parametrize("router, k, cf, heads, masked", CASES)
@pytest.mark.parametrize("ffn", ["swiglu", "relu"])
@pytest.mark.parametrize("impl", ["padded", "sorted", "grouped_mm", "fused", "chunked", "triton"])
def test_dispatch_paths_match_loop_oracle(router, k, cf, heads, masked, ffn, impl):
    gen = torch.Generator().manual_seed(sum(map(ord, f"{router}{k}{heads}{ffn}")))
    B, T = int(torch.randint(1, 4, (1,), generator=gen)), int(torch.randint(3, 9, (1,), generator=gen))
    E = int(torch.randint(max(k, 3), 9, (1,), generator=gen))
    d_model = 8 * heads * int(torch.randint(1, 3, (1,), generator=gen))
    cfg = MoEConfig(n_experts=E, top_k=k, d_expert=16, ffn=ffn, router=router, capacity_factor=cf,
                    heads=heads, head_layer=heads > 1, merge_layer=heads > 1, n_shared=1 if heads == 2 else 0,
                    d_shared=8, z_loss_weight=1e-3, entropy_loss_weight=1e-3,
                    expert_bias=ffn == "relu" and impl not in ("fused", "chunked", "triton"), impl=impl)
    fast, ref = oracle_pair(d_model, cfg)
    x = torch.randn(B, T, d_model)
    mask = None
    if masked:
        mask = torch.rand(B, T, generator=gen) > 0.3
        mask[0, 0] = True
    o1, gx1, g1 = _run(fast, x, mask)
    o2, gx2, g2 = _run(ref, x, mask)
    torch.testing.assert_close(o1.out, o2.out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(o1.aux_loss, o2.aux_loss)
    torch.testing.assert_close(gx1, gx2, rtol=1e-5, atol=1e-6)
    assert g1.keys() == g2.keys() and len(g1) > 0
    for name in g1:
        torch.testing.assert_close(g1[name], g2[name], rtol=1e-5, atol=1e-6, msg=name)
    if mask is not None:  # padding: not routed, not counted
        n_sub = int(mask.sum()) * fast_heads(fast)
        assert o1.stats.tokens == n_sub
        if router != "expert_choice":
            assert int(o1.stats.counts.sum()) == n_sub * k


def fast_heads(layer):
    return layer.heads if isinstance(layer, MHMoELayer) else 1


def test_empty_experts_and_all_masked():
    cfg = MoEConfig(n_experts=16, top_k=1, d_expert=8)
    fast, ref = oracle_pair(8, cfg)
    x = torch.randn(3, 8)  # 3 tokens, 16 experts: most are empty
    torch.testing.assert_close(fast(x).out, ref(x).out)
    none = torch.zeros(3, dtype=torch.bool)
    out = fast(x, none)
    assert torch.equal(out.out, torch.zeros_like(x))
    assert out.stats.tokens == 0 and int(out.stats.counts.sum()) == 0
    assert torch.isfinite(out.aux_loss)


def test_padding_does_not_change_real_tokens():
    cfg = MoEConfig(n_experts=4, top_k=2, d_expert=8, heads=2, head_layer=True, merge_layer=True)
    layer = build_ffn_layer(16, cfg)
    x = torch.randn(1, 5, 16)
    mask = torch.tensor([[True, True, True, False, False]])
    full = layer(x[:, :3])
    padded = layer(torch.cat([x[:, :3], 100 * torch.randn(1, 2, 16)], 1), mask)
    torch.testing.assert_close(padded.out[:, :3], full.out)
    torch.testing.assert_close(padded.aux_loss, full.aux_loss)
    assert torch.equal(padded.stats.counts, full.stats.counts)


def test_bf16_sorted_close_to_fp32_oracle():
    cfg = MoEConfig(n_experts=6, top_k=2, d_expert=32, heads=2, head_layer=True, merge_layer=True)
    fast, ref = oracle_pair(64, cfg)
    x = torch.randn(4, 7, 64)
    expect = ref(x).out
    got = fast.to(torch.bfloat16)(x.to(torch.bfloat16))
    assert got.out.dtype == torch.bfloat16 and got.aux_loss.dtype == torch.float32
    assert got.route.logits.dtype == torch.float32  # router math in fp32
    torch.testing.assert_close(got.out.float(), expect, rtol=0.05, atol=0.02)


@pytest.mark.parametrize("impl", ["padded", "sorted", "grouped_mm", "fused", "chunked", "triton"])
def test_every_path_under_bf16_autocast_close_to_fp32_oracle(impl):
    # fp32 weights, bf16 autocast (the training setup): every path runs, and its outputs and
    # fp32 weight gradients stay close to the fp32 oracle
    cfg = MoEConfig(n_experts=6, top_k=2, d_expert=32, heads=2, head_layer=True, merge_layer=True, impl=impl)
    fast, ref = oracle_pair(64, cfg)
    x = torch.randn(3, 5, 64)
    want, _, g_want = _run(ref, x, None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _, g_got = _run(fast, x, None)
    assert got.out.dtype == torch.bfloat16
    assert_close_in_norm(got.out.float(), want.out, BF16_REL)
    for name, g in g_want.items():
        assert g_got[name].dtype == torch.float32, name
        assert_close_in_norm(g_got[name], g, BF16_REL, name)
        with pytest.raises(AssertionError):  # the tolerance is tight enough to see a 10% error
            assert_close_in_norm(g_got[name] * 1.1, g, BF16_REL, name)


def test_h1_without_head_merge_equals_plain_moe():
    cfg = MoEConfig(n_experts=5, top_k=2, d_expert=16, n_shared=1, d_shared=8)
    plain = MoELayer(24, cfg)
    mh = MHMoELayer(24, cfg)  # heads=1, head/merge off: identity projections
    mh.moe.load_state_dict(plain.state_dict(), strict=False)
    mh.shared.load_state_dict(plain.shared.state_dict())
    x = torch.randn(2, 6, 24)
    torch.testing.assert_close(mh(x).out, plain(x).out)
    assert isinstance(build_ffn_layer(24, cfg), MoELayer)


@pytest.mark.parametrize("ffn", ["swiglu", "relu"])
def test_one_expert_top1_equals_dense_ffn(ffn):
    cfg = MoEConfig(n_experts=1, top_k=1, d_expert=20, ffn=ffn)
    moe = MoELayer(12, cfg)
    dense = DenseFFN(12, 20, ffn)
    dense.experts.load_state_dict(moe.experts.state_dict())
    x = torch.randn(3, 4, 12)
    torch.testing.assert_close(moe(x).out, dense(x))
    layer = DenseLayer(12, MoEConfig(kind="dense", d_expert=20, ffn=ffn))
    layer.ffn.load_state_dict(dense.state_dict())
    torch.testing.assert_close(layer(x).out, dense(x))


def test_split_order_is_token_major():
    """ICML Eq.4 / App. E: sub-token j of token i is row i*h + j, columns j*d/h:(j+1)*d/h."""
    cfg = MoEConfig(n_experts=2, top_k=1, d_expert=4, heads=4)
    layer = MHMoELayer(8, cfg)
    seen = {}
    layer.moe.register_forward_pre_hook(lambda m, args: seen.setdefault("sub", args[0]))
    x = torch.arange(2 * 3 * 8, dtype=torch.float32).reshape(2, 3, 8)
    layer(x)
    sub = seen["sub"]
    assert sub.shape == (2 * 3 * 4, 2)
    torch.testing.assert_close(sub[1 * 4 + 2], x[0, 1, 4:6])  # batch 0, token 1, head 2
    torch.testing.assert_close(sub[(3 + 2) * 4 + 3], x[1, 2, 6:8])


def test_subtoken_residual_adds_subtokens_before_merge():
    cfg = MoEConfig(n_experts=3, top_k=1, d_expert=8, heads=2, merge_layer=True, residual="subtoken")
    layer = MHMoELayer(8, cfg)
    block = MHMoELayer(8, MoEConfig(**{**cfg.to_dict(), "residual": "block"}))
    block.load_state_dict(layer.state_dict())
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(layer(x).out, block(x).out + layer.merge(x))


def test_ablation_switches_build_expected_modules():
    def n_linear(m):
        return sum(isinstance(x, torch.nn.Linear) for x in m.modules())

    for n in range(4):
        layer = MHMoELayer(16, MoEConfig(heads=2, head_layer=True, merge_layer=True, mlp_layers=n, d_expert=8))
        assert n_linear(layer.head) == n and n_linear(layer.merge) == n
        assert sum(isinstance(x, torch.nn.ReLU) for x in layer.head.modules()) == max(0, n - 1)
    no_split = MHMoELayer(16, MoEConfig(heads=4, token_split=False, head_layer=True, d_expert=8))
    assert no_split.moe.d_in == 16
    w = MHMoELayer(64, MoEConfig(heads=2, head_layer=True, merge_layer=True)).head[0].weight.detach()
    bound = (2 ** -0.5) * (6 / 128) ** 0.5  # xavier-uniform with gain 1/sqrt(2)
    assert float(w.abs().max()) <= bound and float(w.abs().max()) > 0.9 * bound


def test_capacity_drops_in_gshard_priority():
    experts = torch.tensor([[0, 1], [0, 1], [0, 2], [1, 0]])
    valid = torch.ones_like(experts, dtype=torch.bool)
    keep = apply_capacity(experts, valid, capacity=2, n_experts=3)
    # first choices go first: expert 0 keeps tokens 0,1 (drops token 2's first and token 3's second
    # choice); expert 1 keeps token 3's first choice, then token 0's second, and drops token 1's second
    assert keep.tolist() == [[True, True], [True, False], [False, True], [True, False]]


def test_train_and_eval_capacity_are_separate():
    cfg = MoEConfig(n_experts=4, top_k=1, d_expert=8, capacity_factor=0.25, eval_capacity_factor=None)
    layer = MoELayer(8, cfg)
    x = torch.randn(64, 8)
    assert layer.train()(x).stats.dropped > 0
    assert layer.eval()(x).stats.dropped == 0


@pytest.mark.parametrize("router", ROUTERS)
def test_routers_return_typed_consistent_output(router):
    cfg = MoEConfig(n_experts=6, top_k=2, d_expert=8, router=router, renormalize=True)
    layer = MoELayer(16, cfg)
    out = layer(torch.randn(10, 16))
    r = out.route
    assert r.logits.dtype == torch.float32 and r.probs.shape == (10, 6)
    assert torch.equal(r.counts, torch.bincount(r.experts[r.valid], minlength=6))
    assert bool((r.weights[~r.valid] == 0).all())
    if router != "expert_choice":
        torch.testing.assert_close(r.weights.sum(-1), torch.ones(10))


def test_aux_free_bias_moves_toward_balance():
    cfg = MoEConfig(n_experts=4, top_k=1, d_expert=8, aux_free_bias=True, bias_update_rate=0.1)
    layer = MoELayer(8, cfg)
    layer.router.update_bias(torch.tensor([10, 0, 5, 5]))
    assert layer.router.selection_bias.tolist() == pytest.approx([-0.1, 0.1, 0.0, 0.0])
    # the bias changes the choice, not the weights
    out = layer(torch.randn(5, 8))
    torch.testing.assert_close(out.route.weights, torch.gather(out.route.probs, 1, out.route.experts))


@pytest.mark.parametrize("weights", [(0.01, 0.0, 0.0), (0.01, 1e-3, 0.0), (0.0, 0.0, 0.5), (0.0, 0.0, 0.0)])
def test_router_losses_of_weight_zero_are_logged_not_trained(weights):
    """A router loss of weight 0 is computed for the statistics without an autograd graph; the aux loss is the
    weighted sum of the others (zero when every weight is 0), and its gradients are those of that sum."""
    wb, wz, we = weights
    cfg = MoEConfig(n_experts=4, top_k=2, d_expert=16, balance_loss_weight=wb, z_loss_weight=wz,
                    entropy_loss_weight=we, impl="sorted")
    layer = MoELayer(8, cfg)
    x = torch.randn(2, 5, 8)
    out = layer(x)
    for name, w in zip(("balance", "z", "entropy"), weights, strict=True):
        assert out.losses[name].requires_grad == (w != 0), name
        assert torch.isfinite(out.stats.losses[name]), name  # still logged
    expected = wb * out.losses["balance"] + wz * out.losses["z"] + we * out.losses["entropy"]
    torch.testing.assert_close(out.aux_loss, expected)
    assert out.aux_loss.requires_grad == any(w != 0 for w in weights)
    if out.aux_loss.requires_grad:
        out.aux_loss.backward()
        assert torch.isfinite(layer.router.weight.grad).all()


def test_a_non_finite_loss_of_weight_zero_stays_out_of_the_aux_loss():
    """Huge router logits: the z-loss (logsumexp squared) overflows to inf; at weight 0 it is logged as inf
    while the aux loss and the router's gradient stay finite (0 * inf would have made both NaN)."""
    cfg = MoEConfig(n_experts=4, top_k=1, d_expert=16, balance_loss_weight=0.01, z_loss_weight=0.0, impl="sorted")
    layer = MoELayer(8, cfg)
    with torch.no_grad():
        layer.router.weight.fill_(1e20)
    out = layer(torch.ones(3, 8))
    assert torch.isinf(out.losses["z"])
    assert torch.isfinite(out.aux_loss)
    out.aux_loss.backward()
    assert torch.isfinite(layer.router.weight.grad).all()
