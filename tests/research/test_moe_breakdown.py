"""benchmarks/moe_breakdown.py: the paired shares, ratio and ceilings follow their formulas round by round, the
expert FLOPs are the layer's routed SwiGLU GEMMs, and a tiny run times every part and tabulates it."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import load_script

from mhmoe.research.bench import CONFIGS, BenchConfig, layer_flops

moe_breakdown = load_script("benchmarks/moe_breakdown.py")


def test_derive_pairs_every_round_with_its_own_dense_time():
    # two rounds, the second twice as slow for everything: paired values equal the first round's
    samples = {"dense": [5.0, 10.0], "layer": [20.0, 40.0], "outside": [4.0, 8.0], "experts": [12.0, 24.0],
               "loop": [10.0, 20.0], "loop_hot": [6.0, 12.0]}
    facts = {"dense_scale": 2.0, "flops_fwd": 1000, "expert_flops_fwd": 700}
    out = moe_breakdown.derive(samples, facts, target=0.85)
    assert out["ratio"] == pytest.approx(10 / 20)  # dense scaled by 2 over the layer
    assert out["share_outside"] == pytest.approx(0.4) and out["share_experts"] == pytest.approx(1.2)
    assert out["share_loop_hot"] == pytest.approx(0.6) and "share_head_merge" not in out
    assert out["ceiling_dense_rate"] == pytest.approx(1 / (0.4 + 0.7))
    assert out["speedup_needed"] == pytest.approx(12 / (10 / 0.85 - 4))
    assert out["ceiling_hot"] == pytest.approx(10 / (20 - 10 + 6))
    assert out["dense_tflops"] == pytest.approx(3 * 1000 / 1e9 / 15.0)  # median of the scaled 10 and 20 ms
    assert out["experts_tflops"] == pytest.approx(3 * 700 / 1e9 / 18.0)


def test_derive_needs_infinite_speedup_when_the_rest_takes_the_budget():
    samples = {"dense": [10.0], "layer": [30.0], "outside": [12.0], "experts": [15.0]}
    out = moe_breakdown.derive(samples, {"dense_scale": 1.0, "flops_fwd": 10, "expert_flops_fwd": 7}, target=0.85)
    assert math.isinf(out["speedup_needed"]) and "ceiling_hot" not in out


def test_expert_flops_are_the_routed_swiglu_gemms():
    assert moe_breakdown.expert_flops(CONFIGS["smoe"], 2048) == 6 * 2048 * 768 * 2048  # top-1, 768 -> 2048
    assert moe_breakdown.expert_flops(CONFIGS["mh3"], 2048) == 6 * 2048 * 3 * 3 * 256 * 512
    for cfg in CONFIGS.values():  # the rest of the layer's FLOPs: router (and head/merge projections)
        assert 0 < moe_breakdown.expert_flops(cfg, 64) < layer_flops(cfg, 64)


def test_a_tiny_run_times_every_part_and_tabulates_it():
    cfg = BenchConfig("tiny-test", 4, 64, 2, 2, overrides=(("router_dtype", "model"),))
    row = moe_breakdown.breakdown(cfg, torch.float32, tokens=32, repeats=1, target=0.85)
    assert row["overrides"] == {"router_dtype": "model"}
    for part in ("dense", "layer", "outside", "head_merge", "experts", "floor"):
        assert row[f"ms_{part}"] > 0
    assert ("ms_loop" in row) == (row["auto_impl"] == "fused" and "ms_loop_hot" in row)
    assert row["expert_flops_fwd"] == 6 * 32 * 2 * 2 * (768 // 2) * 64
    text = moe_breakdown.markdown([row], 0.85)
    assert "speed-up needed for 0.85" in text
    cells = f"{row['ms_dense']:.1f} | {row['ratio']:.2f} | {row['share_outside']:.2f} |"
    assert f"| tiny-test | `router_dtype=model` | float32 | `32` | {cells}" in text


def test_a_bad_override_exits_2_naming_the_field(capsys):
    assert moe_breakdown.main(["--set", "router_dtype=bogus", "--configs", "smoe"]) == 2
    assert "router_dtype" in capsys.readouterr().err


def test_relu_experts_time_the_loop_without_w3():
    cfg = BenchConfig("tiny-relu", 4, 64, 2, 1, overrides=(("ffn", "relu"),))
    row = moe_breakdown.breakdown(cfg, torch.float32, tokens=32, repeats=1, target=0.85)
    assert row["ms_experts"] > 0 and ("ms_loop_hot" in row) == (row["auto_impl"] == "fused")
    assert row["expert_flops_fwd"] == 4 * 32 * 2 * 768 * 64  # two GEMMs per row, top-2, no heads
