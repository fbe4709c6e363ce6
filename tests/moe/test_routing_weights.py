"""Routing weights and capacity follow the reference implementations: top-k weights renormalised for
k > 1 (GShard / X-MoE; DeepSeek-V3 for the sigmoid gate), raw for k = 1 (Switch); the other reading
as an option; the causal capacity priority; the head-projection bias of the official code; the ICML
routing dimension 16/h."""

from __future__ import annotations

import math

import pytest
import torch

from mhmoe.config.moe import MoEConfig
from mhmoe.config.presets import get_preset, icml_router_dim
from mhmoe.errors import ConfigError
from mhmoe.model.lm import LM
from mhmoe.moe.capacity import apply_capacity
from mhmoe.moe.layers import MHMoELayer, MoELayer
from mhmoe.research import reproduce

TOKEN_CHOICE = ["softmax", "xmoe", "noisy", "sigmoid"]


def _route(router: str, k: int, renormalize: bool | None = None, E: int = 8):
    torch.manual_seed(0)
    layer = MoELayer(16, MoEConfig(n_experts=E, top_k=k, d_expert=8, router=router, renormalize=renormalize))
    with torch.no_grad():
        return layer(torch.randn(40, 16)).route


@pytest.mark.parametrize("router", TOKEN_CHOICE)
@pytest.mark.parametrize("k", [2, 3])
def test_top_k_weights_sum_to_one_by_default(router, k):
    r = _route(router, k)
    torch.testing.assert_close(r.weights.sum(-1), torch.ones(40))
    chosen = torch.gather(r.probs if router != "sigmoid" else torch.sigmoid(r.logits), 1, r.experts)
    torch.testing.assert_close(r.weights, chosen / chosen.sum(-1, keepdim=True))  # same ratios as the gate


@pytest.mark.parametrize("router", ["softmax", "xmoe", "sigmoid"])
def test_raw_gate_values_remain_an_option(router):
    r = _route(router, 2, renormalize=False)
    gate = torch.sigmoid(r.logits) if router == "sigmoid" else r.probs
    torch.testing.assert_close(r.weights, torch.gather(gate, 1, r.experts))
    assert float((r.weights.sum(-1) - 1).abs().max()) > 1e-3


def test_sigmoid_router_normalises_the_selected_affinities_like_deepseek_v3():
    r = _route("sigmoid", 2)
    raw = torch.gather(torch.sigmoid(r.logits), 1, r.experts)
    assert float((raw.sum(-1) - 1).abs().max()) > 1e-4  # two raw sigmoids do not sum to one
    torch.testing.assert_close(r.weights, raw / raw.sum(-1, keepdim=True))


@pytest.mark.parametrize("router", ["softmax", "xmoe", "sigmoid"])
def test_top1_keeps_the_gate_value(router):
    r = _route(router, 1)  # Switch: weight = gate probability, so the router gets the LM gradient
    gate = torch.sigmoid(r.logits) if router == "sigmoid" else r.probs
    torch.testing.assert_close(r.weights, torch.gather(gate, 1, r.experts))
    assert float(r.weights.max()) < 1
    assert _route(router, 1, renormalize=True).weights.eq(1).all()


def test_renormalize_resolves_and_validates():
    assert MoEConfig(top_k=2).renormalize_weights and not MoEConfig(top_k=1).renormalize_weights
    assert not MoEConfig(top_k=2, renormalize=False).renormalize_weights
    assert MoEConfig(top_k=1, renormalize=True).renormalize_weights
    assert MoEConfig.from_dict({"renormalize": None, "top_k": 2}).renormalize is None
    for bad, field in ((dict(renormalize="yes"), "renormalize"), (dict(capacity_priority="fifo"), "capacity_priority"),
                       (dict(head_bias_init="normal"), "head_bias_init")):
        with pytest.raises(ConfigError) as info:
            MoEConfig(**bad)
        assert info.value.field == field


@pytest.mark.parametrize("name", ["tiny-fgmoe", "tiny-mh2", "tiny-mh3", "tiny-icml-mh4-8", "tiny-icml-xmoe-8"])
def test_presets_with_top_k_above_one_renormalise(name):
    """The audit's case: raw tiny-mh3 weights summed to ~0.04 per sub-token (vs >= 0.125 for SMoE)."""
    run = get_preset(name)
    assert run.model.moe.top_k > 1 and run.model.moe.renormalize is None
    torch.manual_seed(0)
    model = LM(run.model.__class__(**{**run.model.__dict__, "vocab_size": 64}))
    out = model(torch.randint(0, 64, (2, 16)), return_routing=True)
    for f in out.layer_outputs:
        torch.testing.assert_close(f.route.weights.sum(-1), torch.ones(f.route.weights.shape[0]))
    raw = get_preset(name).with_overrides(["model.moe.renormalize=false"]).model.moe
    assert raw.renormalize is False and not raw.renormalize_weights


def test_capacity_renormalises_over_the_kept_slots():
    torch.manual_seed(0)
    layer = MoELayer(8, MoEConfig(n_experts=4, top_k=2, d_expert=8, capacity_factor=0.5)).train()
    r = layer(torch.randn(32, 8)).route
    kept = r.valid.sum(-1)
    assert bool((kept == 1).any()) and bool((kept == 0).any())  # drops happened
    torch.testing.assert_close(r.weights.sum(-1), (kept > 0).float())
    assert bool((r.weights[r.valid.sum(-1) == 1].max(-1).values == 1).all())


def test_causal_capacity_priority_is_position_major():
    # B=2 rows, T=2 positions, K=2 slots; capacity 2 per expert; every slot wants expert 0 or 1
    experts = torch.tensor([[0, 1], [0, 1], [0, 1], [1, 0]])  # rows (b, t): (0,0) (0,1) (1,0) (1,1)
    valid = torch.ones_like(experts, dtype=torch.bool)
    keep = apply_capacity(experts, valid, 2, 2, seq_shape=(2, 2))
    # position 0 first (its first choices, then its second choices), then position 1:
    # expert 0 keeps (b0,t0,k0) and (b1,t0,k0); expert 1 keeps (b0,t0,k1) and (b1,t0,k1)
    assert keep.tolist() == [[True, True], [False, False], [True, True], [False, False]]
    # GShard order on the same input: all first choices in token order, then the second choices, so
    # row (0,1) keeps its first choice at the expense of row (1,0), an earlier position
    assert apply_capacity(experts, valid, 2, 2).tolist() == [[True, True], [True, False], [False, False],
                                                              [True, False]]


@pytest.mark.parametrize("layer_heads", [1, 2])
def test_causal_capacity_never_depends_on_later_positions(layer_heads):
    torch.manual_seed(0)
    cfg = MoEConfig(n_experts=4, top_k=2, d_expert=8, capacity_factor=0.5, heads=layer_heads,
                    head_layer=layer_heads > 1, init_std=0.3)  # outputs of order 1
    layer = (MHMoELayer(16, cfg) if layer_heads > 1 else MoELayer(16, cfg)).train()
    x = torch.randn(3, 10, 16)
    y = x.clone()
    y[:, 5:] = torch.randn(3, 5, 16)
    a, b = layer(x), layer(y)
    assert int(a.stats.dropped) > 0
    torch.testing.assert_close(a.out[:, :5], b.out[:, :5], rtol=0, atol=1e-6)
    gshard = MoEConfig(**{**cfg.to_dict(), "capacity_priority": "gshard"})
    layer.cfg = gshard
    if layer_heads > 1:
        layer.moe.cfg = gshard
    with torch.no_grad():
        leak = float((layer(x).out[:, :5] - layer(y).out[:, :5]).abs().max())
    assert leak > 1e-4  # GShard's order leaks


def test_head_bias_follows_the_official_code():
    torch.manual_seed(0)
    d = 64
    layer = MHMoELayer(d, MoEConfig(n_experts=4, top_k=2, d_expert=8, heads=2, head_layer=True, merge_layer=True))
    head_b, merge_b = layer.head[0].bias.detach(), layer.merge[0].bias.detach()
    bound = 1 / math.sqrt(d)  # nn.Linear's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    assert float(head_b.abs().max()) <= bound and float(head_b.std()) > 0.4 * bound
    assert torch.equal(merge_b, torch.zeros(d))  # App. E: merge bias 0
    zero = MHMoELayer(d, MoEConfig(n_experts=4, top_k=2, d_expert=8, heads=2, head_layer=True, head_bias_init="zero"))
    assert torch.equal(zero.head[0].bias.detach(), torch.zeros(d))


def test_icml_routing_dimension_is_16_over_h():
    assert [icml_router_dim(h) for h in (1, 2, 4, 6, 8, 12)] == [16, 8, 4, 3, 2, 1]
    assert icml_router_dim(4, token_split=False) == 16
    assert get_preset("tiny-icml-xmoe-8").model.moe.router_dim == 16
    mh = get_preset("tiny-icml-mh4-32").model
    assert mh.moe.router_dim == 4
    layer = MHMoELayer(mh.d_model, mh.moe)
    assert tuple(layer.moe.router.proj.weight.shape) == (4, mh.d_model // 4)
    dims = {row.label: row.build("tiny").model.moe.router_dim for row in reproduce.suite_rows("icml-table5")}
    assert dims == {"X-MoE": 16, "MH-MoE h=2": 8, "MH-MoE h=4": 4, "MH-MoE h=6": 3, "MH-MoE h=8": 2,
                    "MH-MoE h=12": 1}
    no_ts = {row.label: row.build("tiny").model.moe.router_dim for row in reproduce.suite_rows("icml-table6")}
    assert no_ts["X-MoE w/ MLP = MH-MoE w/o TS"] == 16 and no_ts["MH-MoE"] == 4
    assert get_preset("tiny-icml-mh4-8").with_overrides(["model.moe.router_dim=16"]).model.moe.router_dim == 16
