"""Every execution path on CUDA against the loop oracle, in fp32 and bf16 (skipped without a GPU), and
``impl="auto"`` free of host synchronisation in every dtype and at aligned and unaligned widths.

fp32: tight tolerances (TF32 off). bf16 (weights and inputs in bf16, and fp32 weights under bf16
autocast): error relative to the tensor's norm, a small multiple of bf16's unit roundoff
(``helpers.BF16_REL``), for outputs, the input gradient and every parameter gradient.
"""

import pytest
import torch
from helpers import BF16_REL, assert_close_in_norm, oracle_pair

from mhmoe.config.moe import MoEConfig
from mhmoe.moe.dispatch import resolve_impl
from mhmoe.moe.dispatch.precision import cuda_matmul_tf32_set

pytestmark = pytest.mark.gpu
IMPLS = ["grouped_mm", "triton", "sorted", "padded", "fused", "auto"]
CONFIGS = {  # small versions of the four parity families, with padding and capacity variants
    "smoe": dict(n_experts=8, top_k=1, d_expert=256),
    "fgmoe": dict(n_experts=16, top_k=2, d_expert=128),
    "mh2": dict(n_experts=20, top_k=2, d_expert=128, heads=2, head_layer=True, merge_layer=True),
    "mh3-capacity": dict(n_experts=24, top_k=3, d_expert=64, heads=3, head_layer=True, merge_layer=True,
                         capacity_factor=1.0),
}


def _run(layer, x, mask):
    torch.manual_seed(0)
    x = x.clone().requires_grad_(True)
    out = layer(x, mask)
    g = torch.randn_like(out.out, dtype=torch.float32).to(out.out.dtype)
    ((out.out * g).float().sum() + out.aux_loss).backward()
    return out.out, x.grad, {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}


def _pair(cfg: dict, impl: str, d: int = 192):
    fast, ref = oracle_pair(d, MoEConfig(**cfg, impl=impl))
    return fast.cuda(), ref.cuda()


@pytest.fixture(autouse=True)
def _no_tf32():
    with cuda_matmul_tf32_set(False):  # through whichever TF32 API is in use (transformers sets the new one)
        yield


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("masked", [False, True])
def test_fp32_paths_match_oracle(name, impl, masked):
    if impl == "triton":
        pytest.importorskip("triton")
    fast, ref = _pair(CONFIGS[name], impl)
    x = torch.randn(4, 64, 192, device="cuda")
    mask = (torch.rand(4, 64, device="cuda") > 0.25) if masked else None
    o1, gx1, g1 = _run(fast, x, mask)
    o2, gx2, g2 = _run(ref, x, mask)
    torch.testing.assert_close(o1, o2, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gx1, gx2, rtol=1e-4, atol=1e-5)
    assert g1.keys() == g2.keys()
    for n in g1:
        torch.testing.assert_close(g1[n], g2[n], rtol=1e-4, atol=1e-5, msg=n)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", ["bf16_weights", "autocast"])
def test_bf16_paths_close_to_fp32_oracle(name, impl, mode):
    if impl == "triton":
        pytest.importorskip("triton")
    fast, ref = _pair(CONFIGS[name], impl)
    x = torch.randn(4, 64, 192, device="cuda")
    o2, gx2, g2 = _run(ref, x, None)
    if mode == "bf16_weights":
        o1, gx1, g1 = _run(fast.to(torch.bfloat16), x.to(torch.bfloat16), None)
    else:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            o1, gx1, g1 = _run(fast, x, None)
    assert o1.dtype == torch.bfloat16
    assert_close_in_norm(o1, o2, BF16_REL, "out")
    assert_close_in_norm(gx1, gx2, BF16_REL, "x.grad")
    for n in g2:
        if "router" in n:  # fp32 routing on bf16-rounded inputs: argmax flips make these gradients noisy
            continue
        assert_close_in_norm(g1[n], g2[n], BF16_REL, n)


@pytest.mark.parametrize("mode", ["float32", "bf16_weights", "autocast"])
@pytest.mark.parametrize("d_expert, d", [(128, 192), (100, 150)], ids=["aligned", "unaligned"])
def test_auto_never_waits_for_the_device(mode, d_expert, d):
    """The path ``auto`` picks (grouped_mm only on its bf16 fast path, else triton) runs a forward and a
    backward without one host synchronisation, in every dtype, at aligned and unaligned widths."""
    cfg = MoEConfig(n_experts=8, top_k=2, d_expert=d_expert, heads=3 if d % 3 == 0 else 2, head_layer=True,
                    merge_layer=True, impl="auto")
    layer = oracle_pair(d, cfg)[0].cuda()
    x = torch.randn(4, 64, d, device="cuda")
    if mode == "bf16_weights":
        layer, x = layer.to(torch.bfloat16), x.to(torch.bfloat16)
    ctx = torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode == "autocast")
    with ctx:
        chosen = resolve_impl("auto", x.reshape(-1, layer.d_sub), layer.moe.experts)
    assert chosen in ("grouped_mm", "triton"), chosen
    for _ in range(2):  # compile / autotune / allocator warm-up first (they may synchronise)
        with ctx:
            out = layer(x)
        (out.out.float().sum() + out.aux_loss).backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with ctx:
            out = layer(x)
        (out.out.float().sum() + out.aux_loss).backward()
        with torch.no_grad(), ctx:
            layer(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
