"""The LM loss: the chunked LM-head cross-entropy against the reference (logits, then fp32 cross-entropy):
loss and both gradients in fp32 and under bf16 autocast, masks, ignored rows, chunk sizes, no-grad calls,
the loss cap, and the model's ``return_logits=False`` path."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mhmoe.config.model import ModelConfig
from mhmoe.config.moe import MoEConfig
from mhmoe.model.lm import LM
from mhmoe.model.lm_loss import IGNORE, chunk_rows, chunked_token_loss, token_loss
from mhmoe.moe.dispatch import native

B, T, D, V = 3, 7, 24, 53


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, D, generator=g)
    w = torch.randn(V, D, generator=g) * 0.3
    tgt = torch.randint(0, V, (B, T), generator=g)
    keep = torch.rand(B, T, generator=g) > 0.3
    return h, w, tgt, keep


def _run(fn, h0, w0, dtype=torch.float32):
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        loss = fn(h, w)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def _reference(tgt, keep):
    return lambda h, w: token_loss(F.linear(h, w), tgt, keep)


@pytest.mark.parametrize("rows", [1, 5, 16, B * T, 1000])
@pytest.mark.parametrize("masked", [False, True])
def test_chunked_matches_reference_fp32(rows, masked):
    h0, w0, tgt, keep = _inputs()
    keep = keep if masked else None
    ref = _run(_reference(tgt, keep), h0, w0)
    got = _run(lambda h, w: chunked_token_loss(h, w, tgt, keep, rows), h0, w0)
    assert got[0].dtype == torch.float32 and got[0].shape == ()
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_chunked_matches_reference_bf16_autocast():
    h0, w0, tgt, keep = _inputs(1)
    ref = _run(_reference(tgt, keep), h0, w0, torch.bfloat16)
    got = _run(lambda h, w: chunked_token_loss(h, w, tgt, keep, 4), h0, w0, torch.bfloat16)
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == torch.float32
    torch.testing.assert_close(got[0], ref[0], rtol=1e-3, atol=1e-3)
    for a, b in zip(ref[1:], got[1:], strict=True):  # bf16 logit gradients: relative to the largest entry
        assert (a - b).abs().max() <= 0.02 * a.abs().max()


def test_ignored_targets_and_rows_without_gradient():
    h0, w0, tgt, keep = _inputs(2)
    tgt = tgt.masked_fill(~keep, IGNORE)  # ignored through the target value rather than the mask
    ref = _run(_reference(tgt, None), h0, w0)
    got = _run(lambda h, w: chunked_token_loss(h, w, tgt, None, 3), h0, w0)
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert (got[1][~keep] == 0).all()  # an ignored position passes no gradient to its hidden state


def test_no_grad_and_partial_grads():
    h0, w0, tgt, keep = _inputs(3)
    ref = token_loss(F.linear(h0, w0), tgt, keep)
    with torch.no_grad():
        torch.testing.assert_close(chunked_token_loss(h0, w0, tgt, keep, 4), ref)
    w = w0.clone().requires_grad_()  # the head alone (frozen body)
    chunked_token_loss(h0, w, tgt, keep, 4).backward()
    w_ref = w0.clone().requires_grad_()
    token_loss(F.linear(h0, w_ref), tgt, keep).backward()
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-5, atol=1e-6)


def test_all_ignored_is_nan_like_cross_entropy():
    h0, w0, tgt, _ = _inputs(4)
    none = torch.zeros(B, T, dtype=torch.bool)
    assert math.isnan(float(token_loss(F.linear(h0, w0), tgt, none)))
    assert math.isnan(float(chunked_token_loss(h0, w0, tgt, none, 4)))


@pytest.fixture(params=["native", "torch"])
def rows_path(request, monkeypatch):
    """Both ways of a chunk's rows: the C++ op (where built) and the torch ops."""
    if request.param == "torch":
        monkeypatch.setattr("mhmoe.model.lm_loss.token_xent_", lambda *a: None)
    elif native.expert_ops(torch.float32) is None:
        pytest.skip("C++ extension not built here")
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_paths_agree(rows_path, dtype):
    h0, w0, tgt, keep = _inputs(5)
    ref = _run(_reference(tgt, keep), h0, w0, dtype)
    got = _run(lambda h, w: chunked_token_loss(h, w, tgt, keep, 6), h0, w0, dtype)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5 if dtype == torch.float32 else 1e-3, atol=1e-5)
    for a, b in zip(ref[1:], got[1:], strict=True):
        assert (a - b).abs().max() <= (1e-5 if dtype == torch.float32 else 0.02) * a.abs().max()


def test_vanishing_probability_and_bad_targets(rows_path):
    """A target whose probability underflows fp32 still gets its exact loss (here 200 nats, finite);
    out-of-range targets are an error, as in F.cross_entropy."""
    h = torch.zeros(1, 1, 2)
    h[..., 0] = 1.0
    w = torch.tensor([[200.0, 0.0], [0.0, 0.0]])  # logits (200, 0): target 1 has p = e^-200
    assert float(chunked_token_loss(h, w, torch.tensor([[1]]), None)) == pytest.approx(200.0)
    assert float(token_loss(F.linear(h, w), torch.tensor([[1]]))) == pytest.approx(200.0)
    with pytest.raises((RuntimeError, IndexError)):
        chunked_token_loss(h, w, torch.tensor([[2]]), None)


def test_non_finite_logits_of_ignored_rows_do_not_leak(rows_path):
    h0, w0, tgt, keep = _inputs(6)
    h0[0, 0] = float("inf")  # position (0, 0) ignored: its logits are not finite
    keep[0, 0] = False
    ref = _run(_reference(tgt, keep), h0, w0)
    got = _run(lambda h, w: chunked_token_loss(h, w, tgt, keep, 4), h0, w0)
    assert torch.isfinite(ref[0]) and torch.isfinite(got[0])
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6)
    assert (got[1][0, 0] == 0).all()  # no gradient to the ignored position (the logits path gives it NaN)
    torch.testing.assert_close(got[1].flatten(0, 1)[1:], ref[1].flatten(0, 1)[1:], rtol=1e-5, atol=1e-6)


def test_chunk_rows():
    assert chunk_rows(8192, 4096) == 1024 and chunk_rows(8192, 100) == 100
    assert chunk_rows(100_277, 16_384) == 128 and chunk_rows(10, 10**9) == (1 << 23) // 10


@pytest.mark.parametrize("tied", [False, True])
def test_model_loss_only_path_matches_logits_path(tied):
    moe = MoEConfig(n_experts=4, top_k=2, d_expert=16, heads=2, head_layer=True, merge_layer=True)
    cfg = ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, d_ff=48, max_seq_len=16, moe=moe,
                      tie_embeddings=tied)
    torch.manual_seed(0)
    idx, tgt = torch.randint(0, V, (2, 9)), torch.randint(0, V, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 6:] = False
    grads = []
    for logits in (True, False):
        torch.manual_seed(1)
        model = LM(cfg)
        out = model(idx, tgt, mask, return_logits=logits)
        assert (out.logits is None) is (not logits)
        (out.loss + out.aux_loss).backward()
        grads.append((out.loss.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-5, atol=1e-6)
    for a, b in zip(grads[0][1], grads[1][1], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def test_use_chunks_rule():
    """Always on a CPU; elsewhere only for large logits (a meta tensor stands in for a GPU's); never compiled."""
    from mhmoe.model.lm_loss import CHUNKED_OFF_CPU, use_chunks

    assert use_chunks(torch.zeros(2, 3, 8), 10)
    small, big = torch.empty(4, 512, 8, device="meta"), torch.empty(64, 4096, 8, device="meta")
    assert not use_chunks(small, 1000) and 64 * 4096 * 1024 >= CHUNKED_OFF_CPU and use_chunks(big, 1024)
