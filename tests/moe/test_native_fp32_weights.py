"""The C++ expert loop with fp32 weights and bf16 rows (bf16 autocast): the weights rounded to bf16 while packed, their
gradients widened as written, must give the numbers of casting the weights first -- bit for bit, on every GEMM kernel
(at::mm, the AVX-512 BF16 dot product, AMX tiles; the own kernels only where the CPU has them) and in the layer."""

import dataclasses

import pytest
import torch
from helpers import load_script
from moe.test_fused import _grads, _route

import mhmoe.moe.dispatch.fused as fused
from mhmoe.config.moe import MoEConfig
from mhmoe.moe.dispatch import native
from mhmoe.moe.experts import GroupedExperts
from mhmoe.moe.layers import build_ffn_layer

BF16 = torch.bfloat16
needs_ext = pytest.mark.skipif(native.expert_ops(BF16) is None, reason="C++ CPU expert loop not built here")
KERNELS = [native.GEMM_ATEN, native.GEMM_DOT, native.GEMM_AMX]  # the own kernels fall back to at::mm where absent


def _awkward_weights(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """fp32 weights with values the rounding must treat as ATen does: denormals (kept, not flushed), halfway
    cases (to even), values that round up across a power of two."""
    w = torch.randn(*shape, generator=gen) * 0.05
    flat = w.view(-1)
    flat[::97] = 1e-40  # denormal
    flat[5::89] = 1.0 + 2.0**-8  # halfway between two bf16 values: to the even one
    flat[7::101] = 1.0 + 3 * 2.0**-9  # halfway, rounds up
    flat[11::103] = -(2.0 - 2.0**-9)  # rounds up to -2
    return w


def _run(ops, xs, dy, ws, starts, sizes, gemm):
    E, D, F = ws[0].shape
    R = xs.shape[0]
    glu = ws[2] is not None
    h1, ys, dxs = torch.empty(R, F, dtype=BF16), torch.empty(R, D, dtype=BF16), torch.empty(R, D, dtype=BF16)
    h3 = torch.empty(R, F, dtype=BF16) if glu else None
    ops.expert_forward(xs, ws[0], ws[1], ws[2], h1, h3, ys, starts, sizes, 2, gemm)
    grads = ops.expert_backward(xs, h1, h3, dy, ws[0], ws[1], ws[2], dxs, starts, sizes, 2, gemm)
    return [h1, ys, dxs] + ([h3] if glu else []), grads


@needs_ext
@pytest.mark.parametrize("gemm", KERNELS)
@pytest.mark.parametrize("glu", [True, False])
@pytest.mark.parametrize("D, F, sizes", [(64, 96, [32, 0, 45, 17]),  # tails, an empty expert
                                         (48, 64, [40, 33, 16]),  # AMX: K not a multiple of 32 (zero-padded)
                                         (64, 75, [24, 19])])  # N not a multiple of 32, odd K: at::mm fallback
def test_fp32_weights_give_the_numbers_of_the_cast(gemm, glu, D, F, sizes):
    gen = torch.Generator().manual_seed(D * 100 + F + len(sizes))
    E, R = len(sizes), sum(sizes)
    starts = [sum(sizes[:e]) for e in range(E)]
    xs, dy = torch.randn(R, D, generator=gen).to(BF16), torch.randn(R, D, generator=gen).to(BF16)
    ws = [_awkward_weights((E, D, F), gen), _awkward_weights((E, F, D), gen),
          _awkward_weights((E, D, F), gen) if glu else None]
    ops = native.expert_ops(BF16)
    acts, grads = _run(ops, xs, dy, ws, starts, sizes, gemm)
    ref_acts, ref_grads = _run(ops, xs, dy, [None if w is None else w.to(BF16) for w in ws], starts, sizes, gemm)
    for got, ref in zip(acts, ref_acts, strict=True):
        assert torch.equal(got, ref)
    for got, ref in zip(grads, ref_grads, strict=True):
        assert got.dtype == torch.float32 and torch.equal(got, ref.float())


@needs_ext
@pytest.mark.parametrize("gemm", KERNELS)
@pytest.mark.parametrize("transposed", [False, True])
def test_fp32_right_operand_is_rounded_as_tensor_to_rounds(gemm, transposed):
    """An fp32 right operand gives the product with that operand cast by ``Tensor.to`` (the instruction's rounding
    where it agrees with ATen's, ATen's for the blocks it would flush or quiet), and the identity times it is that
    cast wherever the GEMM itself keeps the value (bf16 GEMMs on AMX / AVX-512 BF16 treat denormal inputs as zero)."""
    gen = torch.Generator().manual_seed(int(transposed))
    b = _awkward_weights((64, 64), gen)
    b[3, :40] = 1e-39  # a whole block of denormals
    b = b.t().contiguous().t() if transposed else b
    ops, eye = native.expert_ops(BF16), torch.eye(64, dtype=BF16)
    out, ref = torch.empty(64, 64, dtype=BF16), torch.empty(64, 64, dtype=BF16)
    ops.expert_matmul(eye, b, out, False, gemm, False)
    ops.expert_matmul(eye, b.to(BF16), ref, False, gemm, False)
    assert torch.equal(out, ref)
    cast = b.to(BF16)
    normal = cast.float().abs() >= torch.finfo(BF16).tiny
    assert torch.equal(out[normal], cast[normal])
    wide = torch.empty(64, 64)  # an fp32 output: the bf16 product widened
    ops.expert_matmul(eye, b, wide, False, gemm, True)
    assert torch.equal(wide, ref.float())


@needs_ext
def test_matmul_refuses_mixed_dtypes_it_does_not_define():
    ops = native.expert_ops(BF16)
    a, b = torch.randn(8, 32), torch.randn(32, 32).to(BF16)
    with pytest.raises(RuntimeError, match="dtype"):
        ops.expert_matmul(a, b, torch.empty(8, 32), False, 0, False)  # fp32 rows, bf16 weight
    with pytest.raises(RuntimeError, match="dtype"):  # an fp32 output with add
        ops.expert_matmul(a.to(BF16), b, torch.empty(8, 32), True, 0, False)


@needs_ext
@pytest.mark.parametrize("own", [True, False])
@pytest.mark.parametrize("ffn", ["swiglu", "relu"])
def test_autocast_layer_bit_identical_to_casting_the_weights(monkeypatch, ffn, own):
    """``fused_moe`` under bf16 autocast with fp32 experts in the C++ loop (its own kernel, or ATen's GEMMs): the
    output and every gradient (the experts' in fp32) equal those of the same loop on weights cast to bf16 first."""
    monkeypatch.setattr(fused, "expert_gemm", lambda *a: native.own_gemm() if own else native.GEMM_ATEN)
    gen = torch.Generator().manual_seed(7)
    torch.manual_seed(0)
    experts = GroupedExperts(12, 64, 96, ffn, init_std=0.2)
    x32 = torch.randn(300, 64, generator=gen)
    route32 = _route(300, 12, 2, gen, skew=1.0)
    results = {}
    for direct in (True, False):
        if not direct:
            monkeypatch.setattr(fused, "_loop_weight", lambda w, dtype, in_loop: None if w is None else w.to(dtype))
        x = x32.clone().requires_grad_()
        route = dataclasses.replace(route32, weights=route32.weights.detach().clone().requires_grad_())
        with torch.autocast("cpu", dtype=BF16):
            results[direct] = _grads(lambda *a: fused.fused_moe(*a, native=True), x, route, experts)
    (out, grads), (ref, ref_grads) = results[True], results[False]
    assert out.dtype == BF16 and torch.equal(out, ref)
    for got, want in zip(grads, ref_grads, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert all(p.grad.dtype == torch.float32 for p in experts.parameters())


def test_loop_weight_keeps_fp32_weights_only_for_the_cpp_loop():
    w = torch.randn(2, 4, 8)
    assert fused._loop_weight(w, BF16, in_loop=True) is w
    assert fused._loop_weight(w, BF16, in_loop=False).dtype == BF16
    assert fused._loop_weight(w.to(BF16), BF16, in_loop=True).dtype == BF16
    assert fused._loop_weight(None, BF16, in_loop=True) is None


@needs_ext
@pytest.mark.parametrize("own", [True, False])
def test_autocast_backward_keeps_the_fp32_weights_not_bf16_copies(monkeypatch, own):
    """What autograd keeps for the backward (the saved tensors but the parameters) shrinks by exactly the experts'
    bf16 copies, on the own kernels (where the CPU has them) and on ATen's GEMMs."""
    saved_bytes = load_script("benchmarks/thin_experts.py").saved_bytes
    monkeypatch.setattr(fused, "expert_gemm", lambda *a: native.own_gemm() if own else native.GEMM_ATEN)
    torch.manual_seed(0)
    layer = build_ffn_layer(64, MoEConfig(n_experts=8, top_k=2, d_expert=96, impl="fused"))
    x = torch.randn(1, 128, 64)
    direct = saved_bytes(layer, x, BF16)
    monkeypatch.setattr(fused, "_loop_weight", lambda w, dtype, in_loop: None if w is None else w.to(dtype))
    cast = saved_bytes(layer, x, BF16)
    assert cast - direct == sum(w.numel() * 2 for w in (layer.experts.w1, layer.experts.w2, layer.experts.w3))
