"""The Triton dropless MoE path (mhmoe.moe.dispatch.triton) against the per-expert loop oracle: outputs and all
gradients (x, routing weights, w1, w2, w3).

Without CUDA the kernels run on CPU tensors under the Triton interpreter: ``TRITON_INTERPRET`` is read
by ``@triton.jit`` when the kernels module is imported, so it is set here, at collection, before
anything imports ``mhmoe.moe.dispatch.triton.kernels`` (and left set for the session: triton also consults it
at run time). With CUDA the same tests run compiled on the GPU, plus the ``gpu`` class (realistic
widths, bf16, no host sync, peak memory).
"""

import dataclasses
import importlib
import os
import sys

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from mhmoe.moe.capacity import apply_capacity  # noqa: E402
from mhmoe.moe.dispatch.triton import triton_available, triton_moe, triton_supported  # noqa: E402
from mhmoe.moe.experts import GroupedExperts  # noqa: E402
from mhmoe.moe.reference import loop_moe  # noqa: E402
from mhmoe.moe.routers import RouterOutput  # noqa: E402

kernels = importlib.import_module("mhmoe.moe.dispatch.triton.kernels")
launch = importlib.import_module("mhmoe.moe.dispatch.triton.launch")
if not CUDA and not kernels.INTERPRETED:  # imported compiled before this module set the variable
    kernels = importlib.reload(kernels)
    launch = importlib.reload(launch)

DEV = "cuda" if CUDA else "cpu"


def _route(S, E, K, gen, skew=0.0, capacity=None, pad=0.0, device=DEV) -> RouterOutput:
    """Top-k softmax routing of S tokens. skew > 0 crowds expert 0 (large E: experts without rows);
    capacity: GShard drops (invalid slots); pad: fraction of padding tokens (token_mask False)."""
    logits = torch.randn(S, E, generator=gen)
    logits[:, 0] += skew
    probs = logits.softmax(-1)
    w, idx = probs.topk(K)
    token_mask = torch.rand(S, generator=gen) >= pad
    valid = token_mask[:, None].expand(S, K).clone()
    if capacity is not None:
        valid = apply_capacity(idx, valid, capacity, E)
    w = torch.where(valid, w, 0)
    route = RouterOutput(weights=w, experts=idx, valid=valid, logits=logits, probs=probs,
                         counts=torch.bincount(idx.flatten(), minlength=E), token_mask=token_mask)
    route = RouterOutput(**{f.name: getattr(route, f.name).to(device) for f in dataclasses.fields(route)
                            if getattr(route, f.name) is not None})
    route.weights.requires_grad_()
    return route


def _setup(S, E, K, D, Fh, ffn, seed, dtype=torch.float32, device=DEV, **route_kw):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    experts = GroupedExperts(E, D, Fh, ffn, init_std=0.3).to(device=device, dtype=dtype)
    x = torch.randn(S, D, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    return experts, x, _route(S, E, K, gen, device=device, **route_kw)


def _grads(fn, x, route, experts):
    """Output and gradients of a fixed, position-dependent linear loss."""
    for t in (x, route.weights, *experts.parameters()):
        t.grad = None
    out = fn(x, route, experts)
    (out.float() * torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)).sum().backward()
    return out.detach(), [x.grad, route.weights.grad] + [p.grad for p in experts.parameters()]


def _close(a, ref, tol=1e-5, name=""):
    """fp32: elementwise within tol relative, or tol times the tensor's largest magnitude (sums that
    cancel lose digits relative to their terms, not to the result; measured errors are ~4 ulp of that)."""
    torch.testing.assert_close(a, ref, rtol=tol, atol=tol * ref.abs().max().item(), msg=lambda m: f"{name}: {m}")


def _rel(a, ref):
    return ((a.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


CASES = [  # S, E, K, D, F, ffn, extra routing
    (37, 5, 2, 8, 24, "swiglu", {}),
    (64, 7, 3, 20, 40, "relu", {"skew": 2.0}),
    (50, 16, 1, 12, 36, "swiglu", {"skew": 4.0}),  # k=1, most experts without rows
    (45, 4, 2, 24, 17, "relu", {"capacity": 9}),  # capacity drops: invalid slots
    (29, 6, 2, 40, 70, "swiglu", {"pad": 0.4}),  # padding tokens, D and F past one tile
    (1, 3, 2, 8, 8, "swiglu", {}),  # one token
    (30, 1, 1, 33, 50, "swiglu", {}),  # one expert
    (23, 4, 3, 72, 48, "swiglu", {"capacity": 12, "pad": 0.2}),  # k=3, drops and padding, D past one tile
]


@pytest.fixture(params=[True, False], ids=["act_dx", "act_bwd+dx"])
def fused(request, monkeypatch):
    """Both backward designs in every dtype: the input gradient inside the act_bwd pass (act_dx, the bf16
    default for D <= 256) and the two passes act_bwd + dx (fp32, wider experts)."""
    from mhmoe.moe.dispatch.triton import backward

    monkeypatch.setattr(backward, "fuse_dx", lambda d, dtype, enabled=None: request.param)
    return request.param


@pytest.mark.parametrize("S, E, K, D, Fh, ffn, kw", CASES)
def test_matches_oracle_fp32(S, E, K, D, Fh, ffn, kw, fused):
    experts, x, route = _setup(S, E, K, D, Fh, ffn, seed=S * 100 + E, **kw)
    assert triton_supported(x, experts)
    got, g_got = _grads(triton_moe, x, route, experts)
    want, g_want = _grads(loop_moe, x, route, experts)
    _close(got, want, name="out")
    for name, a, b in zip(["x", "weights", *dict(experts.named_parameters())], g_got, g_want, strict=True):
        _close(a, b, name=f"d{name}")
    # experts without rows: exactly zero weight gradients; invalid slots: exactly zero weight gradient
    empty = torch.bincount(route.experts[route.valid], minlength=E) == 0
    for p in experts.parameters():
        assert torch.equal(p.grad[empty], torch.zeros_like(p.grad[empty]))
    assert torch.equal(route.weights.grad[~route.valid], torch.zeros_like(route.weights.grad[~route.valid]))
    if kw.get("skew", 0) >= 4.0:
        assert empty.any()


def test_widths_are_padded_to_aligned_strides(monkeypatch):
    """Unaligned D and F run padded to multiples of 16 (zero columns/rows): the kernels see aligned widths,
    the results are exact and have the caller's shapes."""
    seen = []
    real = launch.up_forward
    monkeypatch.setattr(launch, "up_forward", lambda x, w1, *a, **k: seen.append((x.shape[1], w1.shape[2]))
                        or real(x, w1, *a, **k))
    experts, x, route = _setup(21, 3, 2, 12, 20, "swiglu", seed=2)
    got, g_got = _grads(triton_moe, x, route, experts)
    want, g_want = _grads(loop_moe, x, route, experts)
    assert seen == [(16, 32)] and got.shape == x.shape
    for a, b in zip([got, *g_got], [want, *g_want], strict=True):
        assert a.shape == b.shape
        _close(a, b)


@pytest.mark.parametrize("ffn", ["swiglu", "relu"])
def test_bf16_within_reference_rounding(ffn, fused):
    """bf16 inputs and weights: the relative error (Frobenius norm) against the fp32 oracle is at most
    twice the bf16 oracle's own error plus a quarter of bf16's unit roundoff (2^-8)."""
    experts, x, route = _setup(41, 5, 2, 24, 40, ffn, seed=7, capacity=20)
    want, g_want = _grads(loop_moe, x, route, experts)
    eb = GroupedExperts(5, 24, 40, ffn).to(device=DEV, dtype=torch.bfloat16)
    eb.load_state_dict(experts.state_dict())
    xb = x.detach().bfloat16().requires_grad_()
    ref, g_ref = _grads(loop_moe, xb, route, eb)
    got, g_got = _grads(triton_moe, xb, route, eb)
    assert got.dtype == torch.bfloat16 and g_got[0].dtype == torch.bfloat16
    for a, r, w in zip([got, *g_got], [ref, *g_ref], [want, *g_want], strict=True):
        assert _rel(a, w) <= 2 * _rel(r, w) + 2**-10, (_rel(a, w), _rel(r, w))


def test_autocast_runs_in_autocast_dtype():
    experts, x, route = _setup(33, 4, 2, 16, 24, "swiglu", seed=3)
    want, g_want = _grads(loop_moe, x, route, experts)
    with torch.autocast(DEV, dtype=torch.bfloat16):
        ref, g_ref = _grads(loop_moe, x, route, experts)
        got, g_got = _grads(triton_moe, x, route, experts)
    assert got.dtype == torch.bfloat16
    assert all(g.dtype == torch.float32 for g in g_got)  # fp32 leaves get fp32 gradients
    for a, r, w in zip([got, *g_got], [ref, *g_ref], [want, *g_want], strict=True):
        assert _rel(a, w) <= 2 * _rel(r, w) + 2**-10, (_rel(a, w), _rel(r, w))


def test_strided_input_and_broadcast_grad():
    """x as a strided view (no copy is made) and an expanded, stride-0 output gradient (``out.sum()``)."""
    experts, x, route = _setup(27, 5, 2, 12, 20, "swiglu", seed=11)
    base = torch.randn(12, 2 * 27, device=DEV, requires_grad=True)
    xv = base.t()[::2]  # [27, 12], strides (2, 54)
    assert not xv.is_contiguous()
    grads = []
    for fn in (triton_moe, loop_moe):
        base.grad = None
        for p in experts.parameters():
            p.grad = None
        route.weights.grad = None
        out = fn(xv, route, experts)
        out.sum().backward()
        grads.append((out.detach(), base.grad, route.weights.grad, *[p.grad for p in experts.parameters()]))
    for a, b in zip(*grads, strict=True):
        _close(a, b)


@pytest.mark.parametrize("frozen", ["experts", "x", "weights"])
def test_partial_gradients(frozen, fused):
    """Only the requested gradients are computed (frozen experts, a frozen input, fixed routing weights)."""
    experts, x, route = _setup(26, 4, 2, 16, 24, "relu", seed=5)
    want, g_want = _grads(loop_moe, x, route, experts)
    if frozen == "experts":
        experts.requires_grad_(False)
    elif frozen == "x":
        x.requires_grad_(False)
    else:
        route.weights.requires_grad_(False)
    got, g_got = _grads(triton_moe, x, route, experts)
    _close(got, want)
    for a, b in zip(g_got, g_want, strict=True):
        if a is not None:
            _close(a, b)
    assert sum(a is None for a in g_got) == (len(g_got) - 2 if frozen == "experts" else 1)


@pytest.mark.parametrize("K, ffn", [(2, "swiglu"), (1, "relu")])
def test_no_grad_matches_and_is_deterministic(K, ffn):
    """Without autograd only the activation is stored (another kernel path); reruns are bitwise equal."""
    experts, x, route = _setup(40, 6, K, 16, 24, ffn, seed=9, skew=1.0, pad=0.2)
    want = loop_moe(x, route, experts).detach()
    with torch.no_grad():
        a, b = triton_moe(x, route, experts), triton_moe(x, route, experts)
    _close(a, want)
    assert torch.equal(a, b)
    o1, g1 = _grads(triton_moe, x, route, experts)
    o2, g2 = _grads(triton_moe, x, route, experts)
    assert torch.equal(o1, o2) and all(torch.equal(p, q) for p, q in zip(g1, g2, strict=True))


def test_route_plan_tiles_cover_every_row_once():
    gen = torch.Generator().manual_seed(0)
    S, K, E, M = 61, 3, 9, 8
    experts = torch.randint(0, E - 2, (S, K), generator=gen)  # experts E-2, E-1 get no rows
    valid = torch.rand(S, K, generator=gen) > 0.25
    plan = launch.route_plan(experts, valid, E, (M, 2 * M))
    key = torch.where(valid, experts, E).reshape(-1)
    counts = torch.bincount(key, minlength=E + 1)[:E]
    assert torch.equal((plan.ends - plan.starts).long(), counts)
    assert torch.equal(key[plan.order.long()].sort().values, key[plan.order.long()])  # grouped by expert
    assert set(plan.tiles) == {M, 2 * M}
    for bm, (tile_expert, tile_row) in plan.tiles.items():
        assert len(tile_expert) == launch.n_tiles(S * K, E, bm) >= int((counts + bm - 1).div(bm).sum())
        seen = torch.zeros(S * K, dtype=torch.long)
        for e, r in zip(tile_expert.tolist(), tile_row.tolist(), strict=True):
            if e < E:
                rows = torch.arange(r, min(r + bm, int(plan.ends[e])))
                assert len(rows) and (key[plan.order[rows].long()] == e).all()
                seen[rows] += 1
        assert torch.equal(seen, (torch.arange(S * K) < int(counts.sum())).long())


def test_unsupported_experts_fall_back():
    x = torch.randn(5, 8, device=DEV)
    route = _route(5, 3, 2, torch.Generator().manual_seed(0))
    for experts in (GroupedExperts(3, 8, 16, bias=True), GroupedExperts(3, 8, 16, quant="bitnet158")):
        experts = experts.to(DEV)
        assert not triton_supported(x, experts)
        with pytest.raises(ValueError, match="grouped_mm | sorted for"):
            triton_moe(x, route, experts)
    assert not triton_supported(x.half(), GroupedExperts(3, 8, 16).to(DEV))  # fp32 / bf16 only
    assert triton_available()


def test_import_without_triton(monkeypatch):
    """``import mhmoe.moe.dispatch.triton`` works when triton cannot be imported; triton_moe then says why."""
    import mhmoe

    monkeypatch.setitem(sys.modules, "triton", None)  # import triton -> ImportError
    for name in ("mhmoe.moe.dispatch.triton", "mhmoe.moe.dispatch.triton.ops"):
        monkeypatch.delitem(sys.modules, name)  # restored (the originals) after the test
    monkeypatch.setattr(mhmoe.moe.dispatch, "triton", mhmoe.moe.dispatch.triton)
    fresh = importlib.import_module("mhmoe.moe.dispatch.triton")
    assert fresh is not mhmoe.moe.dispatch.triton or fresh.triton_moe is not triton_moe
    experts, x = GroupedExperts(2, 4, 8), torch.randn(3, 4)
    assert not fresh.triton_available() and not fresh.triton_supported(x, experts)
    with pytest.raises(ValueError, match="installed triton package"):
        fresh.triton_moe(x, None, experts)


@pytest.mark.gpu
class TestCUDA:
    """Compiled kernels on the GPU at realistic expert widths (autotuned configs)."""

    SHAPES = [  # S, E, K, D, F, ffn, extra routing
        (1024, 8, 2, 256, 512, "swiglu", {}),
        (600, 6, 3, 384, 1024, "relu", {"capacity": 250, "pad": 0.1}),
        (300, 16, 1, 768, 2048, "swiglu", {"skew": 4.0}),
        (257, 5, 2, 100, 300, "swiglu", {"pad": 0.3}),  # widths off every tile size
    ]

    @pytest.mark.parametrize("S, E, K, D, Fh, ffn, kw", SHAPES)
    def test_fp32(self, S, E, K, D, Fh, ffn, kw):
        experts, x, route = _setup(S, E, K, D, Fh, ffn, seed=S, device="cuda", **kw)
        experts.reset_parameters(std=D**-0.5, out_std=Fh**-0.5)
        got, g_got = _grads(triton_moe, x, route, experts)
        want, g_want = _grads(loop_moe, x, route, experts)
        for a, b in zip([got, *g_got], [want, *g_want], strict=True):
            _close(a, b, tol=1e-4)

    @pytest.mark.parametrize("S, E, K, D, Fh, ffn, kw", SHAPES)
    def test_bf16(self, S, E, K, D, Fh, ffn, kw):
        experts, x, route = _setup(S, E, K, D, Fh, ffn, seed=S, device="cuda", **kw)
        experts.reset_parameters(std=D**-0.5, out_std=Fh**-0.5)
        want, g_want = _grads(loop_moe, x, route, experts)
        eb = GroupedExperts(E, D, Fh, ffn).to(device="cuda", dtype=torch.bfloat16)
        eb.load_state_dict(experts.state_dict())
        xb = x.detach().bfloat16().requires_grad_()
        ref, g_ref = _grads(loop_moe, xb, route, eb)
        got, g_got = _grads(triton_moe, xb, route, eb)
        for a, r, w in zip([got, *g_got], [ref, *g_ref], [want, *g_want], strict=True):
            assert _rel(a, w) <= 2 * _rel(r, w) + 2**-10, (_rel(a, w), _rel(r, w))

    def test_no_host_sync(self):
        experts, x, route = _setup(512, 8, 2, 256, 512, "swiglu", seed=0, device="cuda", dtype=torch.bfloat16)
        _grads(triton_moe, x, route, experts)  # compile and autotune first (they synchronise)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = triton_moe(x, route, experts)
            out.backward(torch.ones_like(out))
            with torch.no_grad():
                triton_moe(x, route, experts)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def test_peak_memory_close_to_grouped_mm(self):
        from mhmoe.moe.dispatch.grouped import grouped_moe

        experts, x, route = _setup(8192, 8, 2, 256, 1024, "swiglu", seed=0, device="cuda", dtype=torch.bfloat16)
        peaks = []
        for fn in (grouped_moe, triton_moe, grouped_moe, triton_moe):  # second round: warm caches, tuned
            _grads(fn, x, route, experts)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            _grads(fn, x, route, experts)
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated() - base)
        assert peaks[3] <= 1.1 * peaks[2], peaks


def test_compiles_into_one_graph():
    """Under torch.compile the Triton path is opaque custom ops (mhmoe::triton_moe_*, mhmoe::triton_router): an
    MH-MoE layer's training forward traces into one graph, in fp32 and under bf16 autocast."""
    from mhmoe.config.moe import MoEConfig
    from mhmoe.moe.layers import build_ffn_layer

    torch.manual_seed(0)
    layer = build_ffn_layer(48, MoEConfig(n_experts=4, top_k=2, d_expert=32, heads=3, head_layer=True,
                                          merge_layer=True, impl="triton")).to(DEV).train()
    x = torch.randn(2, 8, 48, device=DEV)
    for bf16 in (False, True):
        torch._dynamo.reset()
        with torch.autocast(DEV, dtype=torch.bfloat16, enabled=bf16):
            ex = torch._dynamo.explain(layer)(x)
        assert (ex.graph_count, ex.graph_break_count) == (1, 0), ex.break_reasons
        ops = {str(n.target) for g in ex.graphs for n in g.graph.nodes}
        assert any("triton_moe_train" in o for o in ops), ops
        assert any("triton_router" in o for o in ops), ops  # the fused router: an opaque custom op too
