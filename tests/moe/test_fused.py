"""The fused and chunked (recompute) paths against the per-expert loop oracle, at the Function level.

Tiny shapes with chunks of a few rows, so every expert's block is cut into several chunks (the
layer-level tests in test_moe.py only ever see one chunk per expert).
"""

import dataclasses

import pytest
import torch

from mhmoe.moe.capacity import apply_capacity
from mhmoe.moe.dispatch import IMPL_FNS, THIN_WIDTH, WIDE_HIDDEN, choose_impl
from mhmoe.moe.dispatch.cpu_table import cpu_choice
from mhmoe.moe.dispatch.fused import MIN_EXPERTS_PER_WORKER, _blocks, chunk_rows, chunked_moe, expert_workers, fused_moe
from mhmoe.moe.dispatch.sorted import sorted_moe
from mhmoe.moe.experts import GroupedExperts
from mhmoe.moe.reference import loop_moe
from mhmoe.moe.routers import RouterOutput


def _route(S: int, E: int, K: int, gen: torch.Generator, skew: float = 0.0, capacity: int | None = None,
           dtype: torch.dtype = torch.float32) -> RouterOutput:
    logits = torch.randn(S, E, generator=gen)
    logits[:, 0] += skew  # skew > 0 crowds expert 0; with large E some experts get no rows
    probs = logits.softmax(-1)
    w, idx = probs.topk(K)
    valid = torch.ones_like(idx, dtype=torch.bool)
    if capacity is not None:
        valid = apply_capacity(idx, valid, capacity, E)
    w = torch.where(valid, w, 0).to(dtype).requires_grad_()
    return RouterOutput(weights=w, experts=idx, valid=valid, logits=logits, probs=probs,
                        counts=torch.bincount(idx.flatten(), minlength=E), token_mask=torch.ones(S, dtype=torch.bool))


def _grads(fn, x, route, experts):
    for t in (x, route.weights, *experts.parameters()):
        t.grad = None
    out = fn(x, route, experts)
    (out.float() * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), [x.grad, route.weights.grad] + [p.grad for p in experts.parameters()]


CASES = [  # S, E, K, D, F, ffn, chunk, skew, capacity
    (37, 5, 2, 8, 24, "swiglu", 3, 0.0, None),
    (64, 7, 3, 4, 40, "relu", 5, 2.0, None),
    (50, 16, 1, 6, 12, "swiglu", 2, 4.0, None),  # most experts empty
    (45, 4, 2, 8, 16, "relu", 4, 0.0, 9),  # capacity drops: invalid slots
    (1, 3, 2, 8, 8, "swiglu", 1, 0.0, None),
]


def check_against_oracle_fp32(fn, S, E, K, D, Fh, ffn, skew, capacity):
    """``fn(x, route, experts)`` on one of :data:`CASES` against the loop oracle: outputs and every gradient."""
    gen = torch.Generator().manual_seed(S * 100 + E)
    torch.manual_seed(S)
    experts = GroupedExperts(E, D, Fh, ffn, init_std=0.3)
    x = torch.randn(S, D, generator=gen, requires_grad=True)
    route = _route(S, E, K, gen, skew, capacity)
    got, g_got = _grads(fn, x, route, experts)
    want, g_want = _grads(loop_moe, x, route, experts)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    if skew >= 4.0:  # empty experts get exactly zero weight gradients
        empty = torch.bincount(route.experts[route.valid], minlength=E) == 0
        assert empty.any() and torch.equal(experts.w1.grad[empty], torch.zeros_like(experts.w1.grad[empty]))


@pytest.mark.parametrize("S, E, K, D, Fh, ffn, chunk, skew, capacity", CASES)
@pytest.mark.parametrize("variant", ["fused", "chunked"])
def test_fused_paths_match_oracle_fp32(S, E, K, D, Fh, ffn, chunk, skew, capacity, variant):
    c = chunk if variant == "chunked" else 0
    check_against_oracle_fp32(lambda *a: fused_moe(*a, chunk=c), S, E, K, D, Fh, ffn, skew, capacity)


def test_chunked_bf16_close_to_fp32_oracle():
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    experts = GroupedExperts(6, 16, 48, "swiglu", init_std=0.2)
    x = torch.randn(80, 16, generator=gen, requires_grad=True)
    route = _route(80, 6, 2, gen)
    want, g_want = _grads(loop_moe, x, route, experts)
    xb = x.detach().bfloat16().requires_grad_()
    rb = dataclasses.replace(route, weights=route.weights.detach().bfloat16().requires_grad_())
    eb = GroupedExperts(6, 16, 48, "swiglu").to(torch.bfloat16)
    eb.load_state_dict(experts.state_dict())
    got, g_got = _grads(lambda *a: fused_moe(*a, chunk=7), xb, rb, eb)
    assert got.dtype == torch.bfloat16
    # bf16 has an 8-bit mantissa: outputs and gradients within a few percent of the fp32 oracle
    torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.02)
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a.float(), b, rtol=0.05, atol=0.05 * float(b.abs().max()))


def test_chunked_under_autocast_runs_in_bf16():
    experts = GroupedExperts(4, 8, 32, "swiglu")
    x = torch.randn(20, 8, requires_grad=True)
    route = _route(20, 4, 2, torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = chunked_moe(x, route, experts)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert experts.w1.grad.dtype == torch.float32 and torch.isfinite(experts.w1.grad).all()
    torch.testing.assert_close(out.float(), loop_moe(x, route, experts), rtol=0.05, atol=0.02)


def test_blocks_cover_every_row_once():
    counts = [5, 0, 3, 8]
    blocks = _blocks(counts, 3)
    rows = [i for _, r in blocks for i in range(r.start, r.stop)]
    assert rows == list(range(16))
    assert [e for e, _ in blocks] == [0, 0, 2, 3, 3, 3]
    assert all(r.stop - r.start <= 3 for _, r in blocks)
    assert _blocks(counts, 0) == [(0, slice(0, 5)), (2, slice(5, 8)), (3, slice(8, 16))]


def test_chunk_rows_budget():
    assert chunk_rows(5952, 4) == 64  # 2 MiB / (5952 * 4 B) = 88 -> multiple of 32
    assert chunk_rows(512, 2) == 1024  # capped
    assert chunk_rows(10**6, 4) == 32  # floor
    assert chunk_rows(2048, 4, budget=1 << 20) == 128


def test_chunked_is_explicit_and_not_for_quantized_experts():
    x = torch.randn(2, 24)
    assert choose_impl("chunked", x, GroupedExperts(8, 24, 64)) is chunked_moe
    # CPU default (docs/PERFORMANCE.md): fused; experts fused does not cover (biases) run sorted; thin, wide
    # experts what this CPU's table entry says
    assert choose_impl("auto", x, GroupedExperts(8, 24, 64)) is fused_moe
    assert choose_impl("auto", x, GroupedExperts(8, 24, 64, bias=True)) is sorted_moe
    wide = GroupedExperts(8, 24, WIDE_HIDDEN)
    assert choose_impl("auto", x, wide) is IMPL_FNS[cpu_choice(torch.float32, wide).impl]
    wide_in = torch.randn(2, THIN_WIDTH)
    assert choose_impl("auto", wide_in, GroupedExperts(2, THIN_WIDTH, WIDE_HIDDEN)) is fused_moe
    assert choose_impl("chunked", x, GroupedExperts(8, 24, 64, quant="bitnet158")) is sorted_moe


@pytest.mark.parametrize("variant", ["fused", "chunked"])
def test_expert_parallel_threads_match_oracle(variant):
    gen = torch.Generator().manual_seed(3)
    torch.manual_seed(3)
    experts = GroupedExperts(12, 8, 24, "swiglu", init_std=0.3)
    x = torch.randn(90, 8, generator=gen, requires_grad=True)
    route = _route(90, 12, 2, gen, skew=1.0)
    chunk = 4 if variant == "chunked" else 0
    want, g_want = _grads(loop_moe, x, route, experts)
    for workers in (2, 3, 5):  # more threads than cores, uneven expert loads: same numbers
        got, g_got = _grads(lambda *a, w=workers: fused_moe(*a, chunk=chunk, workers=w), x, route, experts)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for a, b in zip(g_got, g_want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert torch.get_num_threads() >= 1  # the worker threads' set_num_threads(1) stays in the workers


def test_expert_workers_rule():
    cpu = torch.device("cpu")
    torch.set_num_threads(2)  # conftest restores the thread count
    enough, few = [5] * (MIN_EXPERTS_PER_WORKER * 2), [5, 0, 0, 5]
    assert MIN_EXPERTS_PER_WORKER * 2 > 2  # `few` has 2 non-empty experts: fewer than the rule asks for 2 threads
    assert expert_workers(few, cpu) == 1
    assert expert_workers(enough, cpu) == 2
    assert expert_workers(enough[1:], cpu) == 1
    assert expert_workers(enough, torch.device("meta")) == 1
    torch.set_num_threads(1)
    assert expert_workers(enough, cpu) == 1


def test_worker_errors_propagate():
    from mhmoe.moe.dispatch.fused import _run_blocks

    def boom(e, r):
        if e == 1:
            raise RuntimeError("expert 1 failed")

    with pytest.raises(RuntimeError, match="expert 1 failed"):
        _run_blocks([(0, slice(0, 2)), (1, slice(2, 4))], boom, 2)


def test_flop_counter_sees_expert_threads_work():
    from torch.utils.flop_counter import FlopCounterMode

    torch.set_num_threads(2)  # 40 experts on 2 threads: expert_workers would use threads (conftest restores)
    experts = GroupedExperts(40, 8, 16)
    x = torch.randn(64, 8)
    route = _route(64, 40, 2, torch.Generator().manual_seed(4))
    counts = {}
    for name, fn in (("sorted", sorted_moe), ("fused", lambda *a: fused_moe(*a, workers=None))):
        with torch.no_grad(), FlopCounterMode(display=False) as fc:
            fn(x, route, experts)
        counts[name] = fc.get_total_flops()
    # all expert GEMMs counted: 3 GEMMs of 2*D*F per routed row (fused adds only the K-slot combine bmm)
    assert counts["fused"] >= 64 * 2 * 3 * 2 * 8 * 16
    assert counts["fused"] >= counts["sorted"] * 0.9


@pytest.mark.parametrize("chunk", [0, 3])
def test_input_without_grad_skips_dx_and_keeps_weight_grads(chunk):
    gen = torch.Generator().manual_seed(7)
    experts = GroupedExperts(5, 8, 24, "swiglu", init_std=0.3)
    x = torch.randn(30, 8, generator=gen)  # no requires_grad: the backward skips the input-side GEMMs
    route = _route(30, 5, 2, gen)
    got, g_got = _grads(lambda *a: fused_moe(*a, chunk=chunk), x, route, experts)
    want, g_want = _grads(loop_moe, x, route, experts)
    assert g_got[0] is None and g_want[0] is None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(g_got[1:], g_want[1:], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
