"""``impl="auto"``: the path chosen for every (device, compute dtype, alignment, GPU generation, Triton, expert
kind), and PyTorch's two TF32 APIs read and set without mixing them."""

import itertools

import pytest
import torch

from mhmoe.moe.dispatch import (
    IMPL_FNS,
    THIN_WIDTH,
    WIDE_HIDDEN,
    auto_impl,
    choose_impl,
    gemm_aligned,
    resolve_impl,
)
from mhmoe.moe.dispatch.cpu_table import TABLE, cpu_choice, dtype_key
from mhmoe.moe.dispatch.precision import compute_dtype, cuda_matmul_tf32, cuda_matmul_tf32_set
from mhmoe.moe.experts import GroupedExperts
from mhmoe.runtime.cpu import cpu_isa

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CAPS = [None, (8, 0), (8, 9), (9, 0), (10, 0), (12, 0)]
SYNC_FREE_ON_CUDA = {"grouped_mm", "triton"}  # grouped_mm only on its fast path (asserted below)


def _expected(device, dtype, aligned, cap, triton, fused_ok, thin):
    """The dispatch table, written out: what each case must give and why."""
    if device == "cuda":
        # torch._grouped_mm's CUTLASS path: bf16, sm90/sm100, 16-byte strides; anything else falls back
        # to a host loop over the experts (offsets copied to the host)
        if dtype == torch.bfloat16 and aligned and cap is not None and cap[0] in (9, 10):
            return "grouped_mm"
        return "triton" if triton else "padded"
    if not fused_ok:  # biased or quantized experts: the hand-written backwards do not cover them
        return "sorted"
    return TABLE[(cpu_isa(), dtype_key(dtype), "thin_wide" if thin else "few")].impl  # this CPU's measured entry


@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("aligned", [True, False])
def test_auto_table_every_combination(device, dtype, aligned):
    for cap, triton, fused_ok, thin in itertools.product(CAPS, [True, False], [True, False], [True, False]):
        got = auto_impl(device, dtype, aligned, capability=cap, triton=triton, fused_ok=fused_ok, thin=thin)
        assert got == _expected(device, dtype, aligned, cap, triton, fused_ok, thin), (cap, triton, fused_ok, thin)
        assert got in IMPL_FNS
        if device == "cuda":
            fast_grouped = dtype == torch.bfloat16 and aligned and cap is not None and cap[0] in (9, 10)
            assert (got == "grouped_mm") == fast_grouped  # never the syncing fallback of _grouped_mm
            if triton:  # with Triton, every CUDA case is sync-free
                assert got in SYNC_FREE_ON_CUDA


def test_fp32_on_hopper_is_never_grouped_mm():
    """The fp32 case that motivated the table: _grouped_mm would copy its offsets to the host."""
    for aligned in (True, False):
        assert auto_impl("cuda", torch.float32, aligned, capability=(9, 0), triton=True) == "triton"
        assert auto_impl("cuda", torch.float32, aligned, capability=(9, 0), triton=False) == "padded"


@pytest.mark.parametrize("d_in, d_hidden, dtype, want", [
    (256, 512, torch.bfloat16, True), (256, 512, torch.float32, True), (8, 24, torch.bfloat16, True),
    (4, 24, torch.bfloat16, False), (4, 24, torch.float32, True), (100, 300, torch.bfloat16, False),
    (96, 300, torch.float32, True), (96, 301, torch.float32, False), (16, 8, torch.float16, True),
])
def test_gemm_alignment(d_in, d_hidden, dtype, want):
    assert gemm_aligned(dtype, GroupedExperts(2, d_in, d_hidden)) is want


def test_resolve_on_cpu_follows_the_table():
    x = torch.randn(3, 24)
    plain, biased, wide = GroupedExperts(4, 24, 64), GroupedExperts(4, 24, 64, bias=True), \
        GroupedExperts(4, 24, WIDE_HIDDEN)
    assert resolve_impl("auto", x, plain) == "fused"
    assert resolve_impl("auto", x, biased) == "sorted"
    assert resolve_impl("auto", x, wide) == cpu_choice(torch.float32, wide).impl  # this CPU's entry (ISA-dependent)
    assert resolve_impl("auto", torch.randn(3, THIN_WIDTH), GroupedExperts(2, THIN_WIDTH, WIDE_HIDDEN)) == "fused"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert compute_dtype(x) == torch.bfloat16
        assert resolve_impl("auto", x, plain) == "fused"
    assert compute_dtype(x) == torch.float32
    for impl in ("triton", "fused", "chunked"):  # hand-written backwards without biases: sorted
        assert resolve_impl(impl, x, biased) == "sorted"
        assert resolve_impl(impl, x, plain) == impl
    for impl in ("grouped_mm", "padded", "sorted", "loop"):
        assert choose_impl(impl, x, biased) is IMPL_FNS[impl]


def test_tf32_read_and_set_with_either_api():
    """Reading never raises, whichever API was used last; the setter never leaves the two APIs disagreeing."""
    m = torch.backends.cuda.matmul
    if not hasattr(m, "fp32_precision"):
        pytest.skip("torch < 2.9 has only the legacy API")
    old = m.fp32_precision
    try:
        m.allow_tf32 = False  # legacy API, both agree
        assert cuda_matmul_tf32() is False
        with cuda_matmul_tf32_set(True):
            assert cuda_matmul_tf32() is True and m.allow_tf32 is True
        assert cuda_matmul_tf32() is False and m.allow_tf32 is False
        m.allow_tf32 = True  # legacy then the new API alone: a legacy read raises now ...
        m.fp32_precision = "ieee"
        with pytest.raises(RuntimeError, match="mix of the legacy and new"):
            _ = m.allow_tf32
        assert cuda_matmul_tf32() is False  # ... ours does not
        with cuda_matmul_tf32_set(True):
            assert cuda_matmul_tf32() is True and m.fp32_precision == "tf32"
        assert m.fp32_precision == "ieee"
        torch.backends.fp32_precision = "tf32"  # what transformers' enable_tf32 sets: inherited by matmul
        m.fp32_precision = "none"
        assert cuda_matmul_tf32() is True
    finally:
        torch.backends.fp32_precision = "none"
        m.allow_tf32 = False
        m.fp32_precision = old
