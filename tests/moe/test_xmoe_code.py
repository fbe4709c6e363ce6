"""X-MoE in the authors' code reading (``MoEConfig.xmoe_reading="code"``): each difference from the paper's
text against a small transcription of torchscale ``xmoe/routing.py`` (``Top2Gate`` with ``use_xmoe``)."""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close_in_norm, oracle_pair

from mhmoe.config.moe import MoEConfig
from mhmoe.config.presets import get_preset, icml_moe_config
from mhmoe.errors import ConfigError
from mhmoe.model import build_model
from mhmoe.moe.layers import MoELayer, build_ffn_layer
from mhmoe.moe.losses import load_balancing_loss
from mhmoe.moe.routers import XMoERouter

CODE = MoEConfig(router="xmoe", top_k=2, n_experts=4, d_expert=24, ffn="relu", xmoe_reading="code")


def _authors_logits(x, proj, wg):
    """routing.py Top2Gate.forward + _cosine: the token is projected, not normalised; wg is normalised."""
    return (x @ proj.t()) @ F.normalize(wg, p=2.0, dim=1, eps=1e-4).t()


def test_code_router_scores_follow_the_authors_formula():
    torch.manual_seed(0)
    r = XMoERouter(12, CODE)
    x = torch.randn(30, 12) * 3
    logits, gate, probs = r.scores(x)
    torch.testing.assert_close(logits, _authors_logits(x, r.proj.weight, r.expert_embed))
    torch.testing.assert_close(gate, logits.softmax(-1))
    assert r.temperature is None and "temperature" not in dict(r.named_parameters())
    # the paper reading normalises the token and divides by a temperature: other scores
    paper = XMoERouter(12, MoEConfig(router="xmoe", top_k=2, n_experts=4))
    paper.load_state_dict({**r.state_dict(), "temperature": torch.tensor(1.0)})
    assert not torch.allclose(paper.scores(x)[0], logits)


def test_code_router_keeps_expert_embeddings_at_norm_1p5_in_training_only():
    torch.manual_seed(0)
    r = XMoERouter(12, CODE)
    with torch.no_grad():
        r.expert_embed.mul_(3.0)
    before = r.expert_embed.detach().clone()
    r.eval()
    r(torch.randn(5, 12))
    torch.testing.assert_close(r.expert_embed.detach(), before)  # eval: no mutation
    r.train()
    r(torch.randn(5, 12))
    torch.testing.assert_close(r.expert_embed.detach().norm(dim=1), torch.full((4,), 1.5))


def test_second_expert_kept_with_probability_2_g2_and_gates_normalised_before_dropping():
    torch.manual_seed(0)
    r = XMoERouter(8, CODE).train()
    base = torch.randn(6, 8) * 2
    n = 4000
    x = base.repeat(n, 1)  # token i at rows i, i+6, ...
    r.generator = torch.Generator().manual_seed(1)
    out = r(x)
    top = out.probs.topk(2, dim=-1).values
    g = top / top.sum(-1, keepdim=True)  # normalised before any drop
    p_keep = (2 * g[:6, 1]).clamp_max(1)
    freq = out.valid[:, 1].reshape(n, 6).float().mean(0)
    assert (freq - p_keep).abs().max() < 4 * math.sqrt(0.25 / n), (freq, p_keep)
    # first slot always kept with weight g1 (< 1): no renormalisation after the second is dropped
    torch.testing.assert_close(out.weights[:, 0], g[:, 0])
    dropped = ~out.valid[:, 1]
    assert dropped.any() and (out.weights[dropped, 1] == 0).all() and (out.weights[dropped].sum(-1) < 1).all()
    # same generator seed -> same coin flips
    r.generator = torch.Generator().manual_seed(1)
    assert torch.equal(r(x).valid, out.valid)


def test_eval_is_deterministic_with_the_expected_second_weight():
    torch.manual_seed(0)
    r = XMoERouter(8, CODE).eval()
    x = torch.randn(50, 8)
    a, b = r(x), r(x)
    assert torch.equal(a.weights, b.weights) and a.valid.all()
    top = a.probs.topk(2, dim=-1).values
    g = top / top.sum(-1, keepdim=True)
    torch.testing.assert_close(a.weights, torch.stack([g[:, 0], g[:, 1] * (2 * g[:, 1]).clamp_max(1)], -1))


def test_training_capacity_is_two_ceil_s_over_e_and_drops_exactly_the_overflow():
    torch.manual_seed(0)
    layer = MoELayer(12, CODE).train()
    layer.router.generator = torch.Generator().manual_seed(0)
    S = 22
    assert int(layer.capacity(torch.tensor(S))) == 2 * math.ceil(S / 4)  # 12; GShard's ceil(2S/E) is 11
    with torch.no_grad():  # skew the router so that expert 0 overflows
        layer.router.expert_embed[0] = layer.router.proj.weight.sum(1)
    out = layer(torch.randn(1, S, 12).abs())
    cap = 2 * math.ceil(S / 4)
    kept = torch.zeros(4, dtype=torch.long).scatter_add_(0, out.route.experts[out.route.valid], torch.ones(
        int(out.route.valid.sum()), dtype=torch.long))
    assert int(out.stats.dropped) > 0
    torch.testing.assert_close(kept, out.route.counts.clamp_max(cap))
    assert int(out.stats.dropped) == int((out.route.counts - cap).clamp_min(0).sum())
    layer.eval()
    assert layer.capacity(torch.tensor(S)) is None  # eval: eval_capacity_factor (None = dropless)


def test_capacity_drops_are_causal_in_the_decoder_priority():
    torch.manual_seed(0)
    layer = build_ffn_layer(16, MoEConfig(**{**CODE.to_dict(), "heads": 2, "head_layer": True,
                                             "merge_layer": True, "n_experts": 4})).train()
    x = torch.randn(2, 12, 16)
    x2 = x.clone()
    x2[:, -1] += 5 * torch.randn(2, 16)
    outs = []
    for inp in (x, x2):
        layer.moe.router.generator = torch.Generator().manual_seed(3)
        outs.append(layer(inp))
    assert int(outs[0].stats.dropped) > 0
    torch.testing.assert_close(outs[0].out[:, :-1], outs[1].out[:, :-1])
    bad = MoEConfig(**{**CODE.to_dict(), "capacity_priority": "gshard"}).noncausal_fields()
    assert [f for f, *_ in bad] == ["capacity_priority"]


def test_balance_loss_counts_first_choices_only():
    torch.manual_seed(0)
    layer = MoELayer(12, CODE).train()
    out = layer(torch.randn(40, 12))
    r = out.route
    me = r.probs.mean(0)
    ce = F.one_hot(r.experts[:, 0], 4).float().mean(0)
    authors = torch.mean(me * ce) * 4 * 4  # routing.py top2gating l_aux
    torch.testing.assert_close(out.losses["balance"], authors)
    both = load_balancing_loss(r.probs, r.experts, torch.ones_like(r.valid), r.token_mask)
    assert not torch.allclose(both, authors)


@pytest.mark.parametrize("train", [False, True])
def test_code_reading_default_impl_matches_the_loop_oracle(train):
    torch.manual_seed(0)
    cfg = MoEConfig(**{**CODE.to_dict(), "heads": 2, "head_layer": True, "merge_layer": True, "expert_bias": True,
                       "n_experts": 6})
    fast, ref = oracle_pair(16, cfg)
    x = torch.randn(3, 10, 16)
    res = []
    for layer in (fast, ref):
        layer.train(train)
        layer.moe.router.generator = torch.Generator().manual_seed(5)
        xi = x.clone().requires_grad_(True)
        out = layer(xi)
        (out.out.square().sum() + out.aux_loss).backward()
        res.append((out, xi.grad, {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}))
    assert torch.equal(res[0][0].route.valid, res[1][0].route.valid)
    assert_close_in_norm(res[0][0].out, res[1][0].out, 1e-5)
    assert_close_in_norm(res[0][1], res[1][1], 1e-5)
    for n, g in res[1][2].items():
        assert_close_in_norm(res[0][2][n], g, 1e-5)


def test_validation_names_the_field():
    for kw, field in ((dict(router="softmax"), "xmoe_reading"), (dict(top_k=1), "top_k"),
                      (dict(xmoe_gate="sigmoid"), "xmoe_gate"), (dict(capacity_factor=1.0), "capacity_factor"),
                      (dict(renormalize=True), "renormalize"), (dict(xmoe_reading="authors"), "xmoe_reading")):
        with pytest.raises(ConfigError, match=field) as e:
            MoEConfig(**{**CODE.to_dict(), **kw})
        assert "\n" not in str(e.value)
    assert MoEConfig().xmoe_reading == "paper" and not MoEConfig(router="xmoe").xmoe_code


def test_icml_code_presets_route_in_16_dims_with_biased_experts():
    for heads in (1, 4):
        cfg = icml_moe_config("tiny", heads, 8, "code")
        assert (cfg.xmoe_reading, cfg.router_dim, cfg.expert_bias, cfg.top_k) == ("code", 16, True, 2)
    assert icml_moe_config("tiny", 4, 8).router_dim == 4  # the paper reading: 16/h
    layer = build_ffn_layer(192, icml_moe_config("tiny", 4, 8, "code"))
    assert layer.moe.experts.b1 is not None and layer.moe.experts.b2 is not None
    assert layer.moe.router.proj.weight.shape == (16, 48)
    with pytest.raises(ConfigError, match="reading"):
        icml_moe_config("tiny", 1, 8, "authors")


def test_one_training_step_of_the_code_preset():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    run = get_preset("tiny-icml-mh4-8-code")
    model = build_model(run.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, run.model.vocab_size, (2, 32))
    out = model(idx, idx)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    opt.step()
    emb = [b.ffn.moe.router.expert_embed for b in model.blocks if b.is_moe]
    assert emb and all(e.grad is not None for e in emb)
