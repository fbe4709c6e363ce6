"""The traffic model of the Triton kernels (mhmoe.research.traffic): its FLOPs agree with the analytic count,
its bytes follow the tiling, and `mhmoe bench moe` prints its predictions beside the measured times."""

import pytest
import torch

from mhmoe.config.flops import moe_layer_flops
from mhmoe.moe.dispatch.triton.tiles import Tile
from mhmoe.research.bench import CONFIGS, D_MODEL, format_rows, predictions
from mhmoe.research.traffic import (
    H100_GEMM_TFLOPS,
    H100_SXM,
    L2_SXM_TBS,
    Device,
    Shape,
    dense_gemm,
    dense_prediction,
    device_for,
    expert_kernels,
    kernel_traffic,
    layer_prediction,
    router_kernels,
    router_prediction,
    without_l2,
)

TOKENS = 16384


def _shape(name: str) -> Shape:
    c = CONFIGS[name]
    return Shape(TOKENS * c.heads, c.top_k, c.experts, D_MODEL // c.heads, c.d_expert)


@pytest.mark.parametrize("name", ["smoe", "mh3"])
@pytest.mark.parametrize("fused", [False, True])
def test_kernel_flops_add_up_to_the_analytic_count(name, fused):
    """At shapes the tiles divide (mh3: 1,536 rows per expert), the MMA FLOPs of the kernels are exactly the
    experts' analytic FLOPs: once forward, three times forward + backward."""
    experts = moe_layer_flops(CONFIGS[name].moe_config("auto"), D_MODEL)["experts"] * TOKENS
    sh = _shape(name)
    assert sum(c.flops for c in expert_kernels(sh, pass_="fwd")) == pytest.approx(experts)
    assert sum(c.flops for c in expert_kernels(sh, fused=fused)) == pytest.approx(3 * experts)


def test_bytes_follow_the_tiling():
    """128-row tiles load each expert's weight panel half as often as 64-row tiles; compulsory DRAM traffic
    never exceeds what the programs load; without the L2 bound a kernel is never slower."""
    sh = _shape("mh3")
    b = sh.item
    t64, t128 = Tile(64, 128, 64, 8, 3), Tile(128, 128, 64, 8, 3)
    _, l2_64, hbm_64 = kernel_traffic("up_fwd", sh, t64)
    _, l2_128, hbm_128 = kernel_traffic("up_fwd", sh, t128)
    weight_loads = lambda t: sh.tiles(t.bm) * 2 * sh.d * sh.f * b  # noqa: E731 -- W1 and W3 panels, per row tile
    assert l2_64 - l2_128 == pytest.approx(weight_loads(t64) - weight_loads(t128))
    assert weight_loads(t64) == pytest.approx(2 * weight_loads(t128))
    assert hbm_64 == hbm_128  # compulsory traffic does not depend on the tiling
    for fused in (False, True):
        for c, c0 in zip(expert_kernels(sh, fused=fused), expert_kernels(sh, dev=without_l2(H100_SXM), fused=fused),
                         strict=True):
            assert c.hbm <= c.l2 and c0.us <= c.us, c
    assert [c.kernel for c in expert_kernels(sh, fused=True)].count("act_dx") == 1
    assert "dx" in [c.kernel for c in expert_kernels(sh, fused=False)]


def test_layer_and_dense_predictions_are_consistent():
    mh3 = CONFIGS["mh3"]
    args = (TOKENS, D_MODEL, mh3.experts, mh3.d_expert, mh3.top_k, mh3.heads)
    new, old = layer_prediction(*args), layer_prediction(*args, legacy=True)
    assert new["layer_ms"] == pytest.approx(new["experts_ms"] + new["proj_ms"] + new["router_ms"] + new["losses_ms"])
    assert new["layer_ms"] < old["layer_ms"]  # the rework's point, by the model
    fwd = layer_prediction(*args, pass_="fwd")
    assert fwd["layer_ms"] < new["layer_ms"]
    assert dense_prediction(TOKENS, D_MODEL, 2048, pass_="fwd") < dense_prediction(TOKENS, D_MODEL, 2048)
    assert device_for("NVIDIA H100 80GB HBM3") is H100_SXM and device_for("NVIDIA A10G") is None


def test_bench_prints_predictions_beside_measured_times():
    assert predictions(CONFIGS["mh3"], 64, torch.bfloat16, "fwd_bwd", 2048, torch.device("cpu")) == {}
    row = {"config": "mh3", "dtype": "bfloat16", "pass": "fwd_bwd", "tokens": TOKENS, "ms_triton": 2.0,
           "ms_ours": 2.0, "ms_loop": None, "ms_dense": 1.0, "ratio_dense": 0.5, "ms_floor": 1.0, "ratio_floor": 0.5,
           "ratio_loop": None, "ratio_vs_smoe": 1.0, "pred_device": "H100 SXM", "pred_ms_triton": 2.08,
           "pred_ms_triton_no_l2": 1.48, "pred_ms_dense": 1.63, "pred_ms_dense_no_l2": 0.99}
    text = format_rows({"machine": {"cpu": "x", "threads": 1, "torch": "t", "device": "cuda", "gpu": "H100"},
                        "rows": [row]})
    assert "triton ms predicted" in text and "| 1.48-2.08 | 0.99-1.63 |" in text and "traffic model" in text


def test_a_large_bf16_gemm_is_compute_bound_near_the_measured_rate():
    """The calibration: an 8192^3 bf16 GEMM, measured at 798 TFLOP/s on the lent H100, is predicted compute-bound
    within 2% of that; the L2 traffic the model counts for it fits in the measured time at the model's L2
    bandwidth (the measurement bounds the bandwidth from below). The uncalibrated model (L2 5.5 TB/s derated by
    0.85, no cluster multicast, 75% of the MMA peak) capped it at half the measurement, L2-bound."""
    n = 8192
    c = dense_gemm(n, n, n, H100_SXM)
    tflops = c.flops / c.us / 1e6
    assert c.bound == "mma" and tflops == pytest.approx(H100_GEMM_TFLOPS, rel=0.02)
    measured_s = c.flops / (H100_GEMM_TFLOPS * 1e12)
    assert c.l2 / measured_s <= L2_SXM_TBS * 1e12
    old = Device("old", 989.4, 494.7, 66.9, 3.35, 5.5 * 0.85, mma_eff=0.75, mem_eff=0.85, cluster=1)
    o = dense_gemm(n, n, n, old)
    assert o.bound == "l2" and o.flops / o.us / 1e6 < 0.5 * H100_GEMM_TFLOPS


def test_fused_router_is_predicted_cheaper_and_counts_its_flops():
    """The fused router's kernels: split-bf16 MMAs over the padded experts (3 products for bf16 inputs); the model
    predicts it cheaper than the fp32 reference router for mh3, and its losses cheaper (the kernel's own reductions
    in place of eager passes over the scores)."""
    c = CONFIGS["mh3"]
    s, d = TOKENS * c.heads, D_MODEL // c.heads
    fwd = router_kernels(s, d, c.experts, c.top_k, pass_="fwd")
    assert [k.kernel for k in fwd] == ["router_fwd"] and fwd[0].flops == 2 * s * d * 128 * 3
    assert [k.kernel for k in router_kernels(s, d, c.experts, c.top_k)] == ["router_fwd", "router_bwd", "router_wgrad"]
    new, ref = router_prediction(s, d, c.experts, c.top_k), router_prediction(s, d, c.experts, c.top_k, fused=False)
    assert new["router_ms"] < 0.5 * ref["router_ms"] and 0 < new["losses_ms"] < 0.2 * ref["losses_ms"]


def test_traffic_model_json_keeps_layer_names(tmp_path):
    """benchmarks/traffic_model.py --json: every kernel row names its layer config and its tile separately."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "traffic_model.py"
    spec = importlib.util.spec_from_file_location("traffic_model_script", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "t.json"
    assert mod.main(["--tokens", "1024", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {r["config"] for r in data["kernels"]} == set(CONFIGS) == {r["config"] for r in data["layers"]}
    assert all("x" in r["tile"] or "tokens" in r["tile"] for r in data["kernels"])
    assert data["gemm"]["now"]["bound"] == "mma"


def test_bench_rows_carry_the_predicted_parts(monkeypatch):
    """On an H100 a bench row gets the Triton path's predicted ms, its parts (which add up to it) and the dense
    prediction, with and without the L2 bound (no GPU needed: the device name is all the model reads)."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    out = predictions(CONFIGS["mh3"], TOKENS, torch.bfloat16, "fwd_bwd", 2048, torch.device("cuda"))
    assert out["pred_device"] == H100_SXM.name
    for suffix in ("", "_no_l2"):
        parts = out[f"pred_parts_triton{suffix}"]
        assert set(parts) == {"experts_ms", "proj_ms", "router_ms", "losses_ms"}
        assert sum(parts.values()) == pytest.approx(out[f"pred_ms_triton{suffix}"])
        assert out[f"pred_ms_dense{suffix}"] > 0
    assert out["pred_ms_triton_no_l2"] <= out["pred_ms_triton"]
