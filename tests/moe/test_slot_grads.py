"""The head of the fused path's backward in C++ (mhmoe.moe.dispatch.native.slot_grads) against its torch-ops fallback
and an fp64 reference."""

import pytest
import torch

from mhmoe.moe.dispatch import fused, native
from mhmoe.moe.dispatch.layout import row_layout

needs_ext = pytest.mark.skipif(native.expert_ops(torch.float32) is None, reason="C++ CPU expert loop not built here")


def _case(S: int, K: int, E: int, D: int, align: int, dtype: torch.dtype, drop: float = 0.2, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(S)]) if S else torch.zeros(0, K).long()
    valid = torch.rand(S, K, generator=gen) >= drop
    layout = row_layout(experts, valid, E, align)
    R = layout.rows
    dout = torch.randn(S, D, generator=gen).to(dtype)
    ys = torch.randn(R + 1, D, generator=gen).to(dtype)
    ys[R] = 0
    weights = (torch.rand(S, K, generator=gen) * valid).to(dtype)
    return layout, dout, ys, weights, valid


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("S, K, E, D, align", [(300, 3, 12, 72, 1), (300, 3, 12, 72, 16), (50, 2, 4, 5, 8),
                                               (257, 1, 3, 256, 32), (0, 2, 4, 64, 1)])
def test_slot_grads_match_torch_ops_and_fp64(dtype, S, K, E, D, align):
    layout, dout, ys, weights, valid = _case(S, K, E, D, align, dtype)
    g, dweights = native.slot_grads(dout, ys, weights, layout.tok, layout.slot, layout.inv)
    with native.disabled():
        g_ref, dw_ref = fused._slot_grads(dout, ys, weights, layout)
    assert g.dtype == dweights.dtype == dtype and dweights.shape == (S, K)
    assert torch.equal(g, g_ref)  # one product, rounded once: ATen's numbers
    if layout.pad.numel():
        assert (g[layout.pad] == 0).all()
    assert (dweights[~valid] == 0).all()
    # d w = <y_row, dout[s]>: exact products summed in fp32 and rounded once, so within half a unit of the last
    # place of the fp64 value (plus the fp32 sum's error); in bf16 closer to it than the torch ops' numbers, which
    # round every product to bf16
    rows = layout.inv.view(S, K)[valid]
    want = (ys.double()[rows] * dout.double()[valid.nonzero()[:, 0]]).sum(1)
    got, ref = dweights[valid].double(), dw_ref[valid].double()
    ulp = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -23
    assert ((got - want).abs() <= want.abs() * ulp + 1e-5).all()
    if dtype == torch.bfloat16 and S:
        assert (got - want).abs().sum() < (ref - want).abs().sum()


@needs_ext
def test_slot_grads_runs_in_the_fused_backward(monkeypatch):
    calls = []
    real = torch.ops.mhmoe_cpu.slot_grads

    class Ops:
        def __getattr__(self, name):
            return getattr(torch.ops.mhmoe_cpu, name)

        def slot_grads(self, *args):
            calls.append(args[0].shape)
            return real(*args)

    monkeypatch.setattr(native, "_ops", lambda: Ops())
    layout, dout, ys, weights, _ = _case(64, 2, 4, 32, 1, torch.float32)
    fused._slot_grads(dout, ys, weights, layout)
    assert calls == [dout.shape]
    with native.disabled():  # the export check's reference: torch ops only
        fused._slot_grads(dout, ys, weights, layout)
    assert len(calls) == 1


@needs_ext
def test_slot_grads_refuse_bad_indices_and_dtypes():
    layout, dout, ys, weights, _ = _case(40, 2, 4, 16, 1, torch.float32, drop=0.0)
    ops = torch.ops.mhmoe_cpu
    with pytest.raises(RuntimeError, match="out of range"):
        ops.slot_grads(dout, ys, weights, layout.tok + 1000, layout.slot, layout.inv)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.slot_grads(dout, ys, weights, layout.tok, -layout.slot - 1, layout.inv)
    with pytest.raises(RuntimeError, match="one dtype"):
        ops.slot_grads(dout, ys.double(), weights, layout.tok, layout.slot, layout.inv)
    with pytest.raises(RuntimeError, match="shapes"):
        ops.slot_grads(dout, ys[:3], weights, layout.tok, layout.slot, layout.inv)
    # mixed dtypes never reach the op: the torch ops run
    assert native.slot_grads(dout, ys.bfloat16(), weights, layout.tok, layout.slot, layout.inv) is None
