"""The C++ CPU expert loop (mhmoe.moe.dispatch.native) against the per-expert loop oracle and the Python loop.

Where a C++ compiler and ninja exist the extension must build (a broken build fails here instead of silently
running the Python loop); elsewhere the comparisons skip and only the fallback is tested.
"""

import dataclasses
import logging
import shutil

import pytest
import torch
from moe.test_fused import CASES, _grads, _route, check_against_oracle_fp32
from torch.utils.flop_counter import FlopCounterMode

from mhmoe.moe.dispatch import native
from mhmoe.moe.dispatch.fused import fused_moe
from mhmoe.moe.dispatch.native import extension as native_build
from mhmoe.moe.experts import GroupedExperts
from mhmoe.moe.reference import loop_moe

CAN_BUILD = bool(shutil.which("c++") or shutil.which("g++")) and (shutil.which("ninja") or native_build._ninja_dir())
needs_ext = pytest.mark.skipif(native.expert_ops(torch.float32) is None, reason="C++ CPU expert loop not built here")


def test_extension_builds_where_a_compiler_exists():
    if not CAN_BUILD:
        pytest.skip("no C++ compiler or ninja")
    assert native.expert_ops(torch.float32) is not None
    assert native.expert_ops(torch.bfloat16) is not None
    assert native.expert_ops(torch.float16) is None  # the Python loop runs other dtypes


@needs_ext
@pytest.mark.parametrize("S, E, K, D, Fh, ffn, chunk, skew, capacity", CASES)
@pytest.mark.parametrize("workers, align", [(1, 1), (2, 1), (3, 8)])
def test_native_matches_oracle_fp32(S, E, K, D, Fh, ffn, chunk, skew, capacity, workers, align):
    check_against_oracle_fp32(lambda *a: fused_moe(*a, workers=workers, align=align, native=True),
                              S, E, K, D, Fh, ffn, skew, capacity)


@needs_ext
@pytest.mark.parametrize("ffn", ["swiglu", "relu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("workers", [1, 2])
def test_native_is_bit_identical_to_the_python_loop(ffn, dtype, workers):
    """The same GEMMs in the same order and the element-wise formulas of ATen's kernels, rounded to the dtype
    where the Python loop stores an intermediate: every output and gradient equal, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    experts = GroupedExperts(6, 16, 72, ffn, init_std=0.3).to(dtype)  # 72: blocks not a multiple of the vectors
    x32 = torch.randn(90, 16, generator=gen)
    route32 = _route(90, 6, 2, gen, skew=1.0)
    results = {}
    for flag in (True, False):
        x = x32.to(dtype).requires_grad_()
        route = dataclasses.replace(route32, weights=route32.weights.detach().to(dtype).requires_grad_())
        results[flag] = _grads(lambda *a, f=flag: fused_moe(*a, workers=workers, native=f), x, route, experts)
    (got, g_got), (py, g_py) = results[True], results[False]
    assert got.dtype == dtype and torch.equal(got, py)
    for a, b in zip(g_got, g_py, strict=True):
        assert torch.equal(a, b)
    if dtype == torch.bfloat16 and ffn == "swiglu":  # and both within bf16 rounding of the fp32 oracle
        experts32 = GroupedExperts(6, 16, 72, ffn)
        experts32.load_state_dict({k: v.float() for k, v in experts.state_dict().items()})
        want = loop_moe(x32, route32, experts32)
        torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.02)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_lanes_run_every_expert_once_on_any_thread_count(dtype):
    """The lanes take experts from one shared queue (longest first): on 2 and 3 threads, with skewed and empty
    experts, every output and gradient is the one-lane loop's, bit for bit (an expert skipped or run twice into
    the wrong rows would show)."""
    gen = torch.Generator().manual_seed(3)
    torch.manual_seed(3)
    experts = GroupedExperts(23, 32, 64, "swiglu", init_std=0.3).to(dtype)
    x32 = torch.randn(60, 32, generator=gen)
    route32 = _route(60, 23, 2, gen, skew=3.0)
    assert (route32.counts == 0).any() and route32.counts.max() > 3 * route32.counts.float().mean()
    before = torch.get_num_threads()
    results = []
    try:
        for threads, workers in ((1, 1), (2, 2), (3, 3), (3, 2)):
            torch.set_num_threads(threads)
            x = x32.to(dtype).requires_grad_()
            route = dataclasses.replace(route32, weights=route32.weights.detach().to(dtype).requires_grad_())
            results.append(_grads(lambda *a, w=workers: fused_moe(*a, workers=w, native=True), x, route, experts))
    finally:
        torch.set_num_threads(before)
    (want, g_want), *rest = results
    for got, g_got in rest:
        assert torch.equal(got, want)
        for a, b in zip(g_got, g_want, strict=True):
            assert torch.equal(a, b)


@needs_ext
@pytest.mark.parametrize("ffn", ["swiglu", "relu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("workers", [1, 2])
def test_forward_only_keeps_no_hidden_and_matches(ffn, dtype, workers, monkeypatch):
    """Without a gradient (evaluation, generation) the C++ loop runs too, with no [R, F] hidden buffers: the
    training forward's numbers, and the Python loop's, bit for bit."""
    gen = torch.Generator().manual_seed(5)
    torch.manual_seed(5)
    experts = GroupedExperts(6, 16, 72, ffn, init_std=0.3).to(dtype)
    x = torch.randn(90, 16, generator=gen).to(dtype)
    route = _route(90, 6, 2, gen, skew=1.0)
    route = dataclasses.replace(route, weights=route.weights.detach().to(dtype))
    trained = fused_moe(x.requires_grad_(), route, experts, workers=workers, native=True).detach()
    x = x.detach()
    calls = []
    ops = native.expert_ops(dtype)

    class Spy:  # the op as fused_moe calls it, recording whether hidden buffers were passed
        def __getattr__(self, name):
            return getattr(ops, name)

        def expert_forward(self, *args):
            calls.append(args[4] is None and args[5] is None)
            return ops.expert_forward(*args)

    monkeypatch.setattr("mhmoe.moe.dispatch.fused.expert_ops", lambda dtype: Spy())
    with torch.no_grad():
        got = fused_moe(x, route, experts, workers=workers)
        py = fused_moe(x, route, experts, workers=workers, native=False)
    assert calls == [True]  # native=None: the C++ loop, keeping nothing
    assert torch.equal(got, trained) and torch.equal(got, py)


@needs_ext
def test_disabled_runs_the_python_loop(monkeypatch):
    """``native.disabled()``: the Python loop and torch.topk within the block (the export check's reference),
    the C++ loop again after it."""
    experts = GroupedExperts(4, 8, 32, "swiglu")
    x = torch.randn(20, 8)
    route = _route(20, 4, 2, torch.Generator().manual_seed(1))
    used = []
    monkeypatch.setattr("mhmoe.moe.dispatch.fused._FusedMoE.apply",
                        lambda *args: used.append(args[8] is not None) or torch.zeros_like(x))
    with native.disabled():
        assert not native.enabled() and native.expert_ops(torch.float32) is None
        fused_moe(x, route, experts)
    fused_moe(x, route, experts)
    assert native.enabled() and used == [False, True]


@needs_ext
def test_native_extreme_preactivations():
    """silu and its derivative where exp(-h) over- and underflows: finite, and the Python loop's numbers."""
    E, D, Fh, S = 3, 8, 40, 30
    experts = GroupedExperts(E, D, Fh, "swiglu", init_std=30.0)  # pre-activations of several hundred
    x = torch.randn(S, D, generator=torch.Generator().manual_seed(3), requires_grad=True)
    route = _route(S, E, 2, torch.Generator().manual_seed(4))
    got, g_got = _grads(lambda *a: fused_moe(*a, native=True), x, route, experts)
    want, g_want = _grads(lambda *a: fused_moe(*a, native=False), x, route, experts)
    assert torch.isfinite(got).all() and torch.equal(got, want)
    for a, b in zip(g_got, g_want, strict=True):
        assert torch.isfinite(a).all() and torch.equal(a, b)


@needs_ext
def test_native_bf16_every_preactivation():
    """Every finite bf16 value as a SwiGLU pre-activation (identity weights: h1 = h3 = x), forward and backward:
    the C++ loop's numbers (a lookup table of silu and its sigmoid on AVX-512) are the Python loop's, bit for bit."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x0 = torch.where(torch.isfinite(bits), bits, 0).view(256, 256)
    experts = GroupedExperts(2, 256, 256, "swiglu").to(torch.bfloat16)
    with torch.no_grad():
        for w in (experts.w1, experts.w2, experts.w3):
            w.copy_(torch.eye(256).expand(2, 256, 256))
    route32 = _route(256, 2, 1, torch.Generator().manual_seed(5))
    results = []
    for flag in (True, False):
        x = x0.clone().requires_grad_()
        route = dataclasses.replace(route32, weights=route32.weights.detach().bfloat16().requires_grad_())
        results.append(_grads(lambda *a, f=flag: fused_moe(*a, native=f), x, route, experts))
    (got, g_got), (want, g_want) = results
    for a, b in zip([got, *g_got], [want, *g_want], strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@needs_ext
def test_native_without_input_gradient():
    experts = GroupedExperts(4, 8, 32, "swiglu")
    x = torch.randn(20, 8)  # no grad: the rows' input gradients are not computed
    route = _route(20, 4, 2, torch.Generator().manual_seed(1))
    out = fused_moe(x, route, experts, native=True)
    out.sum().backward()
    want = loop_moe(x, route, experts)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    assert experts.w1.grad is not None and route.weights.grad is not None


@needs_ext
def test_flop_counts_see_the_python_loop():
    """Under a TorchDispatchMode the Python loop runs (its GEMMs are counted): the same FLOPs either way."""
    experts = GroupedExperts(4, 8, 32, "swiglu")
    x = torch.randn(20, 8, requires_grad=True)
    route = _route(20, 4, 2, torch.Generator().manual_seed(1))
    with FlopCounterMode(display=False) as fc:  # native=None: the C++ loop wherever no mode is active
        fused_moe(x, route, experts)
    assert fc.get_total_flops() == 3 * 2 * 40 * 8 * 32  # 40 routed rows, three GEMMs of [40, 8] x [8, 32]


def test_turned_off_and_unavailable(monkeypatch, caplog):
    monkeypatch.setenv("MHMOE_NATIVE", "0")
    assert native.expert_ops(torch.float32) is None
    experts = GroupedExperts(3, 8, 16, "swiglu")
    x = torch.randn(10, 8)
    route = _route(10, 3, 2, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="invalid native=True"):
        fused_moe(x, route, experts, native=True)
    torch.testing.assert_close(fused_moe(x, route, experts), loop_moe(x, route, experts), rtol=1e-5, atol=1e-6)
    monkeypatch.delenv("MHMOE_NATIVE")

    def broken(verbose=False):
        raise RuntimeError("Error building extension 'mhmoe_native'\nlong compiler output")

    monkeypatch.setattr(native, "build", broken)
    native._ops.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="mhmoe.moe.dispatch.native"):
            assert native.expert_ops(torch.float32) is None
        assert "not available (Error building extension 'mhmoe_native')" in caplog.text
        torch.testing.assert_close(fused_moe(x, route, experts), loop_moe(x, route, experts), rtol=1e-5, atol=1e-6)
    finally:
        native._ops.cache_clear()


def test_without_sources_quietly_unavailable(monkeypatch, caplog, tmp_path):
    """The exported model code carries this module but no C++ sources: no build is tried, nothing is logged, and
    the router's top-k is torch.topk's."""
    monkeypatch.setattr(native, "SOURCES", [tmp_path / "expert_loop.cpp"])
    monkeypatch.setattr(native, "build", lambda verbose=False: pytest.fail("no build without sources"))
    native._ops.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="mhmoe.moe.dispatch.native"):
            assert native.expert_ops(torch.float32) is None
            scores = torch.rand(50, 16)
            assert torch.equal(native.topk_indices(scores, 2), torch.topk(scores, 2, dim=-1).indices)
        assert caplog.text == ""
    finally:
        native._ops.cache_clear()


@needs_ext
def test_expert_threads_leave_the_callers_thread_count():
    """The Python loop's expert threads (each sets one intra-op thread, which torch applies process-wide) must not
    leave the process on one thread: a C++ expert-parallel call after them left every later op single-threaded."""
    from mhmoe.moe.dispatch import fused

    fused._expert_pool.cache_clear()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        experts = GroupedExperts(8, 8, 16, "swiglu")
        x = torch.randn(64, 8, requires_grad=True)
        route = _route(64, 8, 2, torch.Generator().manual_seed(0))
        fused_moe(x, route, experts, workers=2, native=False).sum().backward()
        fused_moe(x, route, experts, workers=2, native=True).sum().backward()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
        fused._expert_pool.cache_clear()


def test_under_torch_compile():
    """A compiled caller: the graph breaks at the fused path (row counts on the host), which runs as in eager."""
    experts = GroupedExperts(4, 8, 32, "swiglu")
    x = torch.randn(20, 8, requires_grad=True)
    route = _route(20, 4, 2, torch.Generator().manual_seed(1))
    compiled = torch.compile(lambda t: fused_moe(t, route, experts).square().sum())
    got, g_got = _grads(lambda t, *_: compiled(t).reshape(1, 1), x, route, experts)
    want, g_want = _grads(lambda t, *_: fused_moe(t, route, experts).square().sum().reshape(1, 1), x, route, experts)
    torch.testing.assert_close(got, want)
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b)


@needs_ext
def test_ops_refuse_inconsistent_shapes():
    """The ops are reachable as torch.ops.mhmoe_cpu.*: shapes the fused passes would read past are refused."""
    ops = native.expert_ops(torch.float32)
    E, D, Fh, R = 2, 8, 16, 10
    xs, w1, w2, w3 = torch.randn(R, D), torch.randn(E, D, Fh), torch.randn(E, Fh, D), torch.randn(E, D, Fh)
    h1, h3, ys = torch.empty(R, Fh), torch.empty(R, Fh), torch.empty(R, D)
    ops.expert_forward(xs, w1, w2, w3, h1, h3, ys, [0, 4], [4, 6], 1)  # consistent: runs
    kept = ys.clone()
    ops.expert_forward(xs, w1, w2, w3, None, None, ys, [0, 4], [4, 6], 1)  # forward-only: no hidden buffers
    assert torch.equal(ys, kept)
    bad = [
        (xs, w1, w2, torch.randn(E, D, 2 * Fh), h1, h3, ys, [0, 4], [4, 6]),  # w3 wider than w1
        (xs, w1, w2, w3, h1, torch.empty(R, 2 * Fh), ys, [0, 4], [4, 6]),  # h3 wider than h1
        (xs, w1, w2, w3, h1, h3, ys, [0, 4], [4, 7]),  # a block past the rows
        (xs, w1, w2, w3, h1, None, ys, [0, 4], [4, 6]),  # SwiGLU without h3
        (xs, w1, w2, w3, h1, h3, torch.empty(R - 1, D), [0, 4], [4, 6]),  # ys too short
        (xs, w1, w2, w3, None, h3, ys, [0, 4], [4, 6]),  # h3 kept without h1
    ]
    for args in bad:
        with pytest.raises(RuntimeError):
            ops.expert_forward(*args, 1)
    with pytest.raises(RuntimeError, match="dy"):
        ops.expert_backward(xs, h1, h3, torch.randn(R - 1, D), w1, w2, w3, None, [0, 4], [4, 6], 1)


DOT_CPU = native.expert_ops(torch.bfloat16) is not None and native.cpu_isa() in ("avx512_bf16", "amx")
needs_dot_gemm = pytest.mark.skipif(
    native.expert_ops(torch.bfloat16) is None or native.capability() != "AVX512"
    or native.cpu_isa() not in native.DOT_GEMM_ISAS, reason="the loop's bf16 GEMM kernel is not used on this CPU")


def test_expert_gemm_rule(monkeypatch):
    """bf16, weight matrices of at most DOT_GEMM_WEIGHTS elements (on AMX: AMX_GEMM_WEIGHTS), not thin and wide, an
    AVX-512 build, a measured ISA: the dot-product kernel on AVX-512 BF16, the tiles on AMX, at::mm elsewhere."""
    dot, amx, aten = native.GEMM_DOT, native.GEMM_AMX, native.GEMM_ATEN
    rule = native.expert_gemm
    monkeypatch.setattr(native, "capability", lambda: "AVX512")
    monkeypatch.setattr(native, "cpu_isa", lambda: "avx512_bf16")
    assert rule(torch.bfloat16, 64, 128) == dot and rule(torch.bfloat16, 256, 512) == dot
    assert rule(torch.bfloat16, 768, 2048) == dot and rule(torch.bfloat16, 192, 512) == dot
    assert rule(torch.bfloat16, 1024, 4096) == aten  # larger: not measured, at::mm
    assert rule(torch.bfloat16, 192, 768) == dot and rule(torch.bfloat16, 96, 1488) == aten  # thin, wide
    assert rule(torch.bfloat16, 48, 96) == aten  # too few input features
    assert rule(torch.float32, 64, 128) == aten
    monkeypatch.setattr(native, "cpu_isa", lambda: "amx")  # the tiles
    assert rule(torch.bfloat16, 64, 128) == amx and rule(torch.bfloat16, 256, 512) == amx
    assert rule(torch.bfloat16, 384, 768) == amx and rule(torch.bfloat16, 192, 512) == amx
    assert rule(torch.bfloat16, 768, 1024) == amx  # the fine-grained layer's experts
    assert rule(torch.bfloat16, 768, 2048) == aten  # SMoE's: oneDNN's AMX kernels as fast
    assert rule(torch.bfloat16, 96, 1488) == aten and rule(torch.float32, 64, 128) == aten
    for isa in ("avx512", "avx2", "other"):
        monkeypatch.setattr(native, "cpu_isa", lambda isa=isa: isa)
        assert rule(torch.bfloat16, 64, 128) == aten
    monkeypatch.setattr(native, "cpu_isa", lambda: "avx512_bf16")
    monkeypatch.setattr(native, "capability", lambda: "AVX2")  # an AVX2 build
    assert rule(torch.bfloat16, 64, 128) == aten


def _bf16(*shape, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)


def _operand(kind, rows, cols, gen):
    """A [rows, cols] bf16 operand laid out as the loop passes them: row-major, the transpose of a row-major
    matrix (X^T, W^T), or a row-major view with a wider row stride."""
    if kind == "rows":
        return _bf16(rows, cols, gen=gen)
    if kind == "transposed":
        return _bf16(cols, rows, gen=gen).t()
    return _bf16(rows, cols + 6, gen=gen)[:, 2:cols + 2]  # row stride cols + 6, offset 2 elements (4 bytes)


@pytest.mark.skipif(native.expert_ops(torch.bfloat16) is None, reason="C++ CPU expert loop not built here")
@pytest.mark.parametrize("M, K, N", [(1, 2, 32), (7, 64, 32), (8, 64, 64), (9, 130, 96), (33, 5, 64), (200, 37, 32),
                                     (17, 256, 512), (3, 1, 32), (12, 64, 40), (16, 34, 48),
                                     (20, 1030, 160), (9, 2049, 96),  # B in several column panels (L2_B)
                                     (16, 96, 32), (48, 64, 64), (112, 2048, 96)])  # AMX: 16-row blocks in place
@pytest.mark.parametrize("a_kind, b_kind", [("rows", "rows"), ("rows", "transposed"), ("transposed", "rows"),
                                            ("strided", "rows"), ("strided", "transposed"),
                                            ("transposed", "transposed")])
@pytest.mark.parametrize("add, stream", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("gemm", [native.GEMM_DOT, native.GEMM_AMX])
def test_dot_gemm_kernel_against_fp64(M, K, N, a_kind, b_kind, add, stream, gemm):
    """The loop's GEMM on its own kernels (gemm=1: the AVX-512 BF16 dot product, 2: AMX tiles; where the shape, the
    layout or the CPU does not fit one, at::mm) is the bf16 rounding of the exact product (plus the old output with
    ``add``, rounded once), every layout the loop passes: odd K (padded with a zero pair; for AMX, K not a multiple
    of 32, zero-padded), M and N tails, transposed and strided operands, non-temporal stores, a right operand too
    large for one packed panel (packed and used in column panels, the last one narrower)."""
    gen = torch.Generator().manual_seed(M * 1000 + K * 10 + N)
    a, b = _operand(a_kind, M, K, gen), _operand(b_kind, K, N, gen)
    old = _bf16(M, N, gen=gen)
    exact = a.double() @ b.double() + (old.double() if add else 0)
    out = old.clone()
    native.expert_ops(torch.bfloat16).expert_matmul(a, b, out, add, gemm, stream)
    ref = old.clone()
    native.expert_ops(torch.bfloat16).expert_matmul(a, b, ref, add, 0, False)  # at::mm
    ulp = exact.abs().clamp_min(1e-3) * 2**-7  # one bf16 step at the exact value (fp32 sums: far below it)
    assert ((out.double() - exact).abs() <= ulp).all()
    assert ((out.double() - ref.double()).abs() <= 2 * ulp).all()


@pytest.mark.skipif(not DOT_CPU, reason="needs a CPU with native bf16 and the C++ loop")
@pytest.mark.parametrize("gemm", [native.GEMM_DOT, native.GEMM_AMX])
@pytest.mark.parametrize("K", [64, 40])  # AMX: A read in place (its last rows copied), or all of it zero-padded
def test_dot_gemm_kernel_non_finite_and_zero_rows(gemm, K):
    """A NaN or inf in a row of the left operand reaches that row's outputs only (the zero padding of K and of the
    last rows never meets it); all-zero rows give zeros."""
    gen = torch.Generator().manual_seed(3)
    a, b = _bf16(37, K, gen=gen), _bf16(K, 64, gen=gen)
    a[2, 5], a[11, K - 1], a[7], a[36, 0] = float("nan"), float("inf"), 0, float("nan")
    out = torch.empty(37, 64, dtype=torch.bfloat16)
    native.expert_ops(torch.bfloat16).expert_matmul(a, b, out, False, gemm, False)
    assert out[2].isnan().all() and not out[11].isfinite().any() and out[36].isnan().all()
    assert (out[7] == 0).all()
    rest = [i for i in range(37) if i not in (2, 11, 36)]
    assert out[rest].isfinite().all()


@needs_dot_gemm
@pytest.mark.parametrize("ffn", ["swiglu", "relu"])
@pytest.mark.parametrize("workers, align", [(1, 32), (2, 32), (2, 1)])
def test_dot_gemm_loop_matches_aten_gemms(monkeypatch, ffn, workers, align):  # on this CPU's own kernel (own_gemm)
    """The whole loop on its GEMM kernel against the same loop on at::mm: the output and every gradient within bf16
    rounding of each other (the two sum in the same K order at these sizes, but nothing promises it). Experts of
    64 x 96 (N a multiple of 32: the kernel) and 64 x 72 / 40-wide fallbacks to at::mm inside the same call (align
    1: odd row counts, odd K in the weight gradients)."""
    for D, Fh in ((64, 96), (64, 72), (40, 64)):
        gen = torch.Generator().manual_seed(D + Fh)
        torch.manual_seed(0)
        experts = GroupedExperts(12, D, Fh, ffn, init_std=0.2).to(torch.bfloat16)
        x32 = torch.randn(300, D, generator=gen)
        route32 = _route(300, 12, 2, gen, skew=1.0)
        results = {}
        for flag in (True, False):
            kernel = native.own_gemm() if flag else native.GEMM_ATEN
            monkeypatch.setattr("mhmoe.moe.dispatch.fused.expert_gemm", lambda *a, k=kernel: k)
            x = x32.to(torch.bfloat16).requires_grad_()
            route = dataclasses.replace(route32, weights=route32.weights.detach().to(torch.bfloat16).requires_grad_())
            results[flag] = _grads(lambda *a: fused_moe(*a, workers=workers, align=align, native=True), x, route,
                                   experts)
        (got, g_got), (ref, g_ref) = results[True], results[False]
        names = ["out", "x", "weights"] + [n for n, _ in experts.named_parameters()]
        for name, a, b in zip(names, [got, *g_got], [ref, *g_ref], strict=True):
            scale = b.float().abs().max().clamp_min(1e-30)
            assert (a.float() - b.float()).abs().max() <= scale * 2**-6, name


@pytest.mark.skipif(not DOT_CPU, reason="needs a CPU with native bf16 and the C++ loop")
def test_dot_gemm_kernel_runs_where_the_cpu_has_it():
    """On a CPU with AVX-512 BF16 the loop's GEMM runs on its own kernel (its profiler label), not a fallback."""
    from torch.profiler import ProfilerActivity, profile

    a, b = torch.randn(16, 64).to(torch.bfloat16), torch.randn(64, 32).to(torch.bfloat16)
    out = torch.empty(16, 32, dtype=torch.bfloat16)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        native.expert_ops(torch.bfloat16).expert_matmul(a, b, out, False, native.GEMM_DOT, False)
        native.expert_ops(torch.bfloat16).expert_matmul(a, b, out, False, native.GEMM_ATEN, False)
    names = [ev.name for ev in prof.events()]
    assert names.count("mhmoe::dot_gemm") == 1 and "aten::mm" in names


@pytest.mark.skipif(native.expert_ops(torch.bfloat16) is None or native.cpu_isa() != "amx",
                    reason="needs a CPU with AMX and the C++ loop")
def test_amx_gemm_kernel_runs_where_the_cpu_has_it():
    """On a CPU with AMX, gemm=2 runs on the tiles (its profiler label), a SwiGLU up-projection in one call, and
    `own_gemm` names that kernel."""
    from torch.profiler import ProfilerActivity, profile

    a, b = torch.randn(16, 64).to(torch.bfloat16), torch.randn(64, 32).to(torch.bfloat16)
    out = torch.empty(16, 32, dtype=torch.bfloat16)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        native.expert_ops(torch.bfloat16).expert_matmul(a, b, out, False, native.GEMM_AMX, False)
    assert [ev.name for ev in prof.events()].count("mhmoe::amx_gemm") == 1
    assert native.own_gemm() == native.GEMM_AMX
    with profile(activities=[ProfilerActivity.CPU]) as prof:  # a SwiGLU up-projection: one fused pass
        native.expert_ops(torch.bfloat16).expert_glu_up(a, b, b, None, None, out, native.GEMM_AMX)
    names = [ev.name for ev in prof.events()]
    assert names.count("mhmoe::amx_gemm") == 1 and "mhmoe::swiglu_forward" not in names


@pytest.mark.skipif(not DOT_CPU, reason="needs a CPU with native bf16 and the C++ loop")
@pytest.mark.parametrize("b_kind", ["rows", "transposed"])
@pytest.mark.parametrize("gemm", [native.GEMM_DOT, native.GEMM_AMX])
def test_dot_gemm_spreads_its_panels_over_threads_outside_the_lanes(b_kind, gemm):
    """Called outside a parallel region (the loop with one lane, or the op itself), the kernel splits its column
    panels over the intra-op threads: the same bits on 1, 2 and 3 threads (each column is one thread's sum)."""
    gen = torch.Generator().manual_seed(7)
    a, b = _operand("rows", 300, 768, gen), _operand(b_kind, 768, 2048, gen)
    outs = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            out = torch.empty(300, 2048, dtype=torch.bfloat16)
            native.expert_ops(torch.bfloat16).expert_matmul(a, b, out, False, gemm, False)
            outs.append(out)
    finally:
        torch.set_num_threads(before)
    exact = a.double() @ b.double()
    assert ((outs[0].double() - exact).abs() <= exact.abs().clamp_min(1e-3) * 2**-7).all()
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.skipif(native.expert_ops(torch.bfloat16) is None, reason="C++ CPU expert loop not built here")
@pytest.mark.parametrize("M, K, N", [(1, 64, 32), (16, 96, 64), (37, 256, 512), (48, 40, 96), (200, 768, 1024)])
@pytest.mark.parametrize("gemm", [native.GEMM_ATEN, native.GEMM_DOT, native.GEMM_AMX])
@pytest.mark.parametrize("keep", [True, False])
def test_glu_up_projection_matches_its_gemms_and_activation(M, K, N, gemm, keep):
    """A SwiGLU expert's up-projection as the loop runs it (on AMX: both GEMMs and the activation in one pass over
    the output blocks) gives the bits of its two GEMMs on the same kernel (expert_matmul) and of silu(h1) * h3 over
    them (the Python loop's bf16 ops), with the pre-activations kept or not; M not a multiple of 16, K not of 32."""
    gen = torch.Generator().manual_seed(M + K + N)
    ops = native.expert_ops(torch.bfloat16)
    x, w1, w3 = _bf16(M, K, gen=gen), _bf16(K, N, gen=gen, scale=K**-0.5), _bf16(K, N, gen=gen, scale=K**-0.5)
    h1, h3 = torch.empty(M, N, dtype=torch.bfloat16), torch.empty(M, N, dtype=torch.bfloat16)
    act = torch.empty(M, N, dtype=torch.bfloat16)
    ops.expert_glu_up(x, w1, w3, h1 if keep else None, h3 if keep else None, act, gemm)
    r1, r3 = torch.empty_like(h1), torch.empty_like(h3)
    ops.expert_matmul(x, w1, r1, False, gemm, False)
    ops.expert_matmul(x, w3, r3, False, gemm, False)
    if keep:
        assert torch.equal(h1, r1) and torch.equal(h3, r3)
    assert torch.equal(act, torch.nn.functional.silu(r1).mul_(r3))


@needs_dot_gemm
@pytest.mark.parametrize("keep", [True, False])
def test_outputs_past_the_cache_are_the_same_bits(keep):
    """A forward whose rows' outputs outgrow the cache (8,192 rows of 256: 4 MiB, written past the cache by the own
    kernels) gives, expert by expert, the bits of the loop's own GEMMs called one at a time (written through it)."""
    gen = torch.Generator().manual_seed(7)
    ops = native.expert_ops(torch.bfloat16)
    E, D, Fh, R = 4, 256, 64, 8192
    gemm = native.own_gemm()
    xs = _bf16(R, D, gen=gen)
    w1, w3 = _bf16(E, D, Fh, gen=gen, scale=D**-0.5), _bf16(E, D, Fh, gen=gen, scale=D**-0.5)
    w2 = _bf16(E, Fh, D, gen=gen, scale=Fh**-0.5)
    sizes = [1000, 3000, 96, 4096]
    starts = [0, 1000, 4000, 4096]
    h1, h3 = (torch.empty(R, Fh, dtype=torch.bfloat16) for _ in range(2))
    ys = torch.full((R, D), float("nan"), dtype=torch.bfloat16)
    ops.expert_forward(xs, w1, w2, w3, h1 if keep else None, h3 if keep else None, ys, starts, sizes, 2, gemm)
    for e, (r0, c) in enumerate(zip(starts, sizes, strict=True)):
        act = torch.empty(c, Fh, dtype=torch.bfloat16)
        ops.expert_glu_up(xs[r0:r0 + c], w1[e], w3[e], None, None, act, gemm)
        y = torch.empty(c, D, dtype=torch.bfloat16)
        ops.expert_matmul(act, w2[e], y, False, gemm, False)
        assert torch.equal(ys[r0:r0 + c], y), e
