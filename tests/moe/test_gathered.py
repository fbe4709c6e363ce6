"""Generation's gathered-weights path (mhmoe.moe.dispatch.gathered) against the loop oracle, when ``auto`` takes it,
and the generation calls that skip the router losses and statistics."""

import pytest
import torch
from moe.test_fused import _route

from mhmoe.config.presets import get_preset
from mhmoe.model.generate import generate
from mhmoe.model.lm import LM, KVCache
from mhmoe.moe import layers
from mhmoe.moe.dispatch import gathered
from mhmoe.moe.experts import GroupedExperts
from mhmoe.moe.layers import MoELayer
from mhmoe.moe.reference import loop_moe


@pytest.mark.parametrize("S, E, K, ffn, bias, quant, capacity", [
    (1, 8, 1, "swiglu", False, "none", None),
    (3, 6, 2, "relu", False, "none", None),
    (9, 93, 3, "swiglu", True, "none", None),
    (5, 4, 2, "swiglu", False, "bitnet158", None),
    (12, 4, 2, "swiglu", False, "none", 2),  # capacity drops: invalid slots weigh nothing
])
def test_matches_the_oracle(S, E, K, ffn, bias, quant, capacity):
    gen = torch.Generator().manual_seed(S * E + K)
    torch.manual_seed(S + E)
    experts = GroupedExperts(E, 16, 24, ffn, bias, init_std=0.3, quant=quant)
    if bias:
        for b in (experts.b1, experts.b2, experts.b3):
            torch.nn.init.normal_(b, std=0.1)
    x = torch.randn(S, 16, generator=gen)
    route = _route(S, E, K, gen, capacity=capacity)
    with torch.no_grad():
        got, want = gathered.gathered_moe(x, route, experts), loop_moe(x, route, experts)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_invalid_slots_contribute_nothing_even_from_non_finite_rows():
    experts = GroupedExperts(4, 8, 16)
    x = torch.randn(3, 8)
    x[1] = float("inf")
    route = _route(3, 4, 2, torch.Generator().manual_seed(0))
    route.valid[1] = False
    with torch.no_grad():
        route.weights[1] = 0
        got = gathered.gathered_moe(x, route, experts)
    assert torch.equal(got[1], torch.zeros(8)) and torch.isfinite(got).all()
    torch.testing.assert_close(got, loop_moe(x, route, experts))


def test_bf16():
    torch.manual_seed(0)
    experts = GroupedExperts(8, 32, 64, init_std=0.2).to(torch.bfloat16)
    x = torch.randn(4, 32).to(torch.bfloat16)
    route = _route(4, 8, 2, torch.Generator().manual_seed(1), dtype=torch.bfloat16)
    with torch.no_grad():
        got, want = gathered.gathered_moe(x, route, experts), loop_moe(x, route, experts)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=0.02, atol=0.02)


def test_fits_only_forward_only_calls_with_few_gathered_weights(monkeypatch):
    experts = GroupedExperts(8, 16, 32)  # 3 * 16 * 32 = 1,536 weights per expert
    route = _route(4, 8, 2, torch.Generator().manual_seed(0))
    assert not gathered.fits(route, experts)  # gradients wanted: the training paths
    with torch.no_grad():
        assert gathered.fits(route, experts)
        monkeypatch.setattr(gathered, "MAX_GATHERED", 8 * 1536 - 1)  # 8 pairs would gather one element too many
        assert not gathered.fits(route, experts)


def test_auto_takes_it_for_generation_rows_only(monkeypatch):
    cfg = get_preset("tiny-smoe").model.moe
    layer = MoELayer(32, cfg).eval()
    calls = []
    real = layers.gathered_moe
    monkeypatch.setattr(layers, "gathered_moe", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    x = torch.randn(3, 32)
    with torch.no_grad():
        fast = layer(x).out
    slow = layer(x).out  # with gradients: the table's path
    assert calls == [3]
    torch.testing.assert_close(fast, slow.detach(), rtol=1e-5, atol=1e-6)
    big = torch.randn(4096, 32)
    with torch.no_grad():
        layer(big)
    assert calls == [3]  # 4,096 rows gather too many weights


@pytest.mark.parametrize("preset", ["tiny-smoe", "tiny-mh3"])
def test_generation_skips_router_losses_and_statistics(preset):
    run = get_preset(preset).with_overrides(["model.vocab_size=64", "model.n_layers=2", "model.max_seq_len=32",
                                           "train.seq_len=32"])
    torch.manual_seed(0)
    model = LM(run.model).eval()
    idx = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        full = model(idx)
        assert float(full.aux_loss) > 0 and full.routing  # no cache: losses and statistics as in training
        cached = model(idx, cache=KVCache(run.model.n_layers))
        assert float(cached.aux_loss) == 0 and cached.routing == []
        with_targets = model(idx, targets=idx, cache=KVCache(run.model.n_layers))
        assert float(with_targets.aux_loss) == float(full.aux_loss) and with_targets.routing
    torch.testing.assert_close(cached.logits, full.logits, rtol=1e-5, atol=1e-5)
    out = generate(model, idx[:1, :4], 6, temperature=0)
    assert out.shape == (1, 10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ffn", ["swiglu", "relu"])
@pytest.mark.parametrize("D, Fh", [(64, 128), (24, 40), (5, 3)])  # vector widths and their remainders
def test_native_pairs_match_the_gathered_weights(monkeypatch, dtype, ffn, D, Fh):
    """The C++ op (weights read in place) against the same pairs on gathered weights (batched GEMMs): fp32 to
    rounding, bf16 within bf16 steps (both round the pre-activations, silu and the product to bf16)."""
    from mhmoe.moe.dispatch import native

    if native.expert_ops(torch.float32) is None:
        pytest.skip("C++ extension not built here")
    gen = torch.Generator().manual_seed(D + Fh)
    torch.manual_seed(D)
    experts = GroupedExperts(7, D, Fh, ffn, init_std=0.3).to(dtype)
    x = torch.randn(10, D, generator=gen).to(dtype)
    route = _route(10, 7, 3, gen)
    with torch.no_grad():
        ids = route.experts.reshape(-1)
        rows = x[:, None, :].expand(10, 3, D).reshape(30, 1, D)
        got = native.gathered_ffn(rows.reshape(30, D), ids, experts.w1, experts.w2, experts.w3)
        want = experts.forward_gathered(rows, ids).reshape(30, D)
        calls = []
        monkeypatch.setattr(gathered, "gathered_ffn", lambda *a: calls.append(1) or native.gathered_ffn(*a))
        gathered.gathered_moe(x, route, experts)
    assert got is not None and got.dtype == dtype and calls == [1]  # gathered_moe runs the op here
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0.03, atol=0.03 * want.abs().max())
    torch.testing.assert_close(got, want, **tol)
    with torch.no_grad(), pytest.raises(RuntimeError, match="out of range"):
        native.gathered_ffn(rows.reshape(30, D), ids + 7, experts.w1, experts.w2, experts.w3)
    with torch.enable_grad():  # a gradient wanted: never the op
        assert native.gathered_ffn(rows.reshape(30, D), ids, experts.w1, experts.w2, experts.w3) is None
