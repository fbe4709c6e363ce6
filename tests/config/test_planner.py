"""The parity planner against the papers' numbers and against measured FLOPs."""

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mhmoe.cli import main
from mhmoe.config.moe import MoEConfig
from mhmoe.config.planner import count_layer, format_plan, plan
from mhmoe.errors import ConfigError
from mhmoe.moe.layers import build_ffn_layer

D = 768


def test_v2_worked_example_relu_h3():
    for E in (4, 8, 16):
        p = plan(D, 4 * D, E, 1, "relu", heads=3, mh_top_k=1)
        assert p.mhmoe.d_ff == 3 * D
        assert p.mhmoe.experts == 4 * E - 1 and p.experts_exact == pytest.approx(4 * E - 1)
        assert p.params_ratio == pytest.approx(1.0)


def test_v2_experiments_swiglu():
    h2 = plan(D, 2048, 8, 1, "swiglu", heads=2)
    assert (h2.mhmoe.d_ff, h2.mhmoe.top_k) == (768, 2)
    assert h2.experts_exact == pytest.approx(41 + 1 / 3)
    h3 = plan(D, 2048, 8, 1, "swiglu", heads=3)
    assert (h3.mhmoe.d_ff, h3.mhmoe.top_k, h3.mhmoe.experts) == (512, 3, 93)
    fg = plan(D, 2048, 8, 1, "swiglu", heads=1, head_layer=False, merge_layer=False, mh_top_k=2)
    assert (fg.mhmoe.d_ff, fg.mhmoe.experts, fg.mhmoe.top_k) == (1024, 16, 2)
    for p in (h2, h3, fg):
        assert p.mhmoe.leading_flops == p.baseline.leading_flops == 16 * D * D
        assert abs(p.flops_ratio - 1) < 1e-3
    # the paper's chosen expert counts are ~3% off parameter parity
    assert plan(D, 2048, 8, 1, "swiglu", heads=2, mh_experts=40).params_ratio == pytest.approx(0.96875)
    assert plan(D, 2048, 8, 1, "swiglu", heads=3, mh_experts=96).params_ratio == pytest.approx(1.03125)


def test_exact_linear_terms_differ_from_the_papers_printed_ones():
    # v2 §2.2: h=2, F=3d, top-1 ReLU -- paper prints 16Bd^2 - 6Bd; the exact count is 16d^2 - 9d
    p = plan(D, 4 * D, 8, 1, "relu", heads=2, mh_top_k=1)
    assert p.mhmoe.d_ff == 3 * D
    assert (p.mhmoe.flops_per_token - 16 * D * D) / D == pytest.approx(-9)
    assert (p.baseline.flops_per_token - 16 * D * D) / D == pytest.approx(-5)  # paper: 16Bd^2 - 5Bd
    # ICML setting (h=4, beta=63/64 at E=16): paper prints 67Bd^2 - 75/4 Bd; exact is 67d^2 - 66d
    icml = plan(D, 4 * D, 16, 1, "relu", heads=4, parity="params")
    assert icml.beta == pytest.approx(63 / 64) and icml.params_ratio == pytest.approx(1.0)
    assert icml.mhmoe.leading_flops == 67 * D * D
    assert (icml.mhmoe.flops_per_token - 67 * D * D) / D == pytest.approx(-66)


def test_exact_match_mode_solves_exact_flops():
    p = plan(D, 2048, 8, 1, "swiglu", heads=2, match="exact")
    assert p.d_ff_exact == pytest.approx(768.47, abs=0.01)
    at_exact = count_layer(D, p.d_ff_exact, p.mhmoe.experts, 2, "swiglu", heads=2, head_merge_mats=2)
    assert at_exact.flops_per_token == pytest.approx(p.baseline.flops_per_token, rel=1e-12)


def test_router_included_joint_solve():
    p = plan(D, 2048, 8, 1, "swiglu", heads=3, include_router=True, match="exact")
    assert p.mhmoe.router_params > 0 and p.baseline.router_flops > 0
    assert abs(p.flops_ratio - 1) < 1e-3 and abs(p.params_ratio - 1) < 5e-3


@pytest.mark.parametrize("kwargs, field", [
    (dict(heads=5), "heads"), (dict(top_k=9), "top_k"), (dict(top_k=0), "top_k"), (dict(experts=0), "experts"),
    (dict(ffn="gelu"), "ffn"), (dict(parity="both"), "parity"), (dict(mlp_layers=5), "mlp_layers"),
])
def test_bad_plan_input(kwargs, field):
    args = dict(d_model=D, d_ff=2048, experts=8, top_k=1, ffn="swiglu", heads=2) | kwargs
    with pytest.raises(ConfigError) as info:
        plan(**args)
    assert info.value.field == field


@pytest.mark.parametrize("ffn, heads", [("swiglu", 3), ("relu", 2), ("swiglu", 1)])
def test_flop_counter_agrees_with_leading_terms(ffn, heads):
    """Build the planned layer, count matmul FLOPs with FlopCounterMode (2mnp per product, i.e. the
    papers' 2n-1 convention without the -1) and compare with the planner's leading terms."""
    d, n_tok = 96, 37
    hm = heads > 1
    p = plan(d, 256, 4, 1, ffn, heads=heads, head_layer=hm, merge_layer=hm, mh_top_k=max(heads, 2))
    cfg = MoEConfig(n_experts=p.mhmoe.experts, top_k=p.mhmoe.top_k, d_expert=p.mhmoe.d_ff, ffn=ffn,
                    heads=heads, head_layer=hm, merge_layer=hm, proj_bias=False)
    layer = build_ffn_layer(d, cfg)
    x = torch.randn(n_tok, d)
    with FlopCounterMode(display=False) as counter:
        layer(x)
    router = 2 * n_tok * heads * (d // heads) * p.mhmoe.experts  # the router's own matmul
    assert counter.get_total_flops() == n_tok * p.mhmoe.leading_flops + router


def test_cli_plan_json_and_errors(capsys):
    assert main(["plan", "--heads", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("flops_ratio", "params_ratio"):
        assert key in out
    assert out["baseline"]["flops_per_token"] == 9432320 and out["baseline"]["expert_params"] == 37748736
    assert (out["mhmoe"]["d_ff"], out["mhmoe"]["experts"], out["mhmoe"]["top_k"]) == (512, 93, 3)
    assert out["mhmoe"]["experts_exact"] == pytest.approx(93.0)
    assert "flops_per_token" in out["mhmoe"] and "params" in out["mhmoe"]
    assert main(["plan", "--heads", "5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "heads" in err
    assert main(["plan"]) == 0 and "FLOPs ratio" in capsys.readouterr().out


def test_plan_reports_the_ratios_with_and_without_the_router():
    p = plan(768, 2048, 8, 1, "swiglu", heads=3)
    assert p.flops_ratio == p.flops_ratio_without_router and p.params_ratio == p.params_ratio_without_router
    # h=3 routes 3 sub-tokens of width 256 over 93 experts: 3 * 93 * (2 * 256 - 1) router FLOPs per token
    # against the baseline's 8 * (2 * 768 - 1), on ~9.4M expert FLOPs
    router_mh, router_base = 3 * 93 * (2 * 256 - 1), 8 * (2 * 768 - 1)
    expect = (p.mhmoe.flops_per_token + router_mh) / (p.baseline.flops_per_token + router_base)
    assert p.flops_ratio_with_router == pytest.approx(expect) and p.flops_ratio_with_router > 1.012
    assert p.params_ratio_with_router == pytest.approx((p.mhmoe.params + 256 * 93) / (p.baseline.params + 768 * 8))
    text = format_plan(p)
    assert "router included: FLOPs ratio 1.01293" in text
    q = plan(768, 2048, 8, 1, "swiglu", heads=3, include_router=True)
    assert q.flops_ratio == q.flops_ratio_with_router and "router left out" in format_plan(q)
