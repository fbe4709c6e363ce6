"""The router's C++ top-k (mhmoe.moe.dispatch.native.topk_indices): torch.topk's experts on every row, ties and
NaNs included, and torch.topk itself wherever the C++ op does not apply."""

import pytest
import torch

from mhmoe.config.moe import MoEConfig
from mhmoe.moe.dispatch import native
from mhmoe.moe.routers import SoftmaxRouter

needs_ext = pytest.mark.skipif(native.expert_ops(torch.float32) is None, reason="C++ extension not built here")


def _reference(scores, k):
    return torch.topk(scores, k, dim=-1).indices


@needs_ext
@pytest.mark.parametrize("S, E, k", [(1, 2, 1), (7, 8, 2), (300, 96, 3), (64, 17, 8), (20, 12, 7), (129, 33, 4),
                                     (50, 64, 6), (40, 5, 4), (3000, 24, 2)])  # the last one: rows split over threads
def test_random_scores_equal_torch_topk(S, E, k):
    gen = torch.Generator().manual_seed(S * E + k)
    scores = torch.randn(S, E, generator=gen).softmax(-1)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ids, tied = torch.ops.mhmoe_cpu.topk_rows(scores, k)
    finally:
        torch.set_num_threads(threads)
    assert not tied.any()  # distinct random scores: every row decided by the C++ pass alone
    assert torch.equal(ids, _reference(scores, k))
    assert torch.equal(native.topk_indices(scores, k), _reference(scores, k))


def _degenerate_rows(E):
    rows = [torch.zeros(E), torch.full((E,), 0.5), torch.arange(E, dtype=torch.float32),
            torch.arange(E, 0, -1, dtype=torch.float32)]
    for pos in (0, 2, E // 2, E - 1):  # a NaN at the start, among the first k + 1, in a vector, in the tail
        r = torch.rand(E)
        r[pos] = float("nan")
        rows.append(r)
    r = torch.rand(E)
    r[[1, E - 2]] = 2.0  # a tie for the best score
    rows.append(r)
    r = torch.rand(E) * 0.5
    r[[0, E - 1, E // 2]] = torch.tensor([3.0, 2.0, 2.0])  # the 2nd and 3rd best tie (the boundary for k=2)
    rows.append(r)
    r = torch.rand(E)
    r[[3, 5]] = torch.tensor([0.0, -0.0]) + 5.0  # +0/-0 would not differ; large equal values do
    rows.append(r)
    r = torch.rand(E)
    r[[4, E - 3]] = float("inf")
    r[7] = float("-inf")
    rows.append(r)
    r = torch.zeros(E)
    r[[2, 6]] = torch.tensor([0.0, -0.0])  # +0 and -0 compare equal
    r[E - 1] = 1.0
    rows.append(r)
    r = torch.full((E,), float("-inf"))
    r[E // 2] = -3.0  # one finite score: the rest of the k best are -inf ties
    rows.append(r)
    r = -torch.rand(E) - 1.0  # all negative: the -inf that fills the lanes must not win
    rows.append(r)
    return torch.stack(rows)


@needs_ext
@pytest.mark.parametrize("E, k", [(8, 1), (8, 2), (40, 2), (40, 3), (96, 3), (9, 8), (17, 5), (33, 8)])
def test_ties_and_nans_are_torch_topks_own(E, k):
    """Rows whose result depends on how torch.topk breaks ties are flagged and left to torch.topk: the same
    experts with or without the extension (torch.topk does not pick the lowest ids on an all-zero row)."""
    scores = torch.cat([_degenerate_rows(E), torch.rand(5, E)])
    assert torch.equal(native.topk_indices(scores, k), _reference(scores, k))
    _, tied = torch.ops.mhmoe_cpu.topk_rows(scores, k)
    assert tied[[0, 1, 4, 5, 6, 7]].all()  # the constant rows and the NaN rows are flagged
    assert not tied[[2, 3]].any()  # distinct scores in order are not
    assert not tied[-5:].any()  # random rows are not
    assert tied[-7] or k == 1  # -inf ties among the k + 1 best
    assert not tied[-6]  # distinct negative scores


def test_other_inputs_run_torch_topk(monkeypatch):
    """bf16 scores, k >= E, k > native.MAX_TOPK, MHMOE_NATIVE=0: torch.topk, without touching the extension."""
    def no_extension():
        raise AssertionError("the C++ op must not be used here")

    monkeypatch.setattr(native, "_ops", no_extension)
    scores = torch.rand(10, 20)
    for s, k in [(scores.bfloat16(), 2), (scores, 20), (torch.rand(4, 40), native.MAX_TOPK + 1)]:
        assert torch.equal(native.topk_indices(s, k), _reference(s, k))
    monkeypatch.setenv("MHMOE_NATIVE", "0")
    assert torch.equal(native.topk_indices(scores, 3), _reference(scores, 3))


@needs_ext
def test_op_refuses_bad_arguments():
    for scores, k in [(torch.rand(4, 8), 8), (torch.rand(4, 8), 0), (torch.rand(4, 40), native.MAX_TOPK + 1),
                      (torch.rand(4, 8).double(), 2), (torch.rand(8, 4).t(), 2)]:
        with pytest.raises(RuntimeError, match="topk_rows"):
            torch.ops.mhmoe_cpu.topk_rows(scores, k)


def test_router_routes_alike_with_and_without_the_extension(monkeypatch):
    cfg = MoEConfig(n_experts=24, top_k=3)
    router = SoftmaxRouter(16, cfg)
    x = torch.randn(200, 16, requires_grad=True)
    got = router(x)
    got.weights.sum().backward()
    monkeypatch.setenv("MHMOE_NATIVE", "0")
    want = router(x)
    assert torch.equal(got.experts, want.experts) and torch.equal(got.weights, want.weights)
    assert x.grad is not None


def test_router_under_torch_compile():
    cfg = MoEConfig(n_experts=16, top_k=2)
    router = SoftmaxRouter(8, cfg)
    x = torch.randn(32, 8)
    compiled = torch.compile(lambda t: router(t).experts)
    assert torch.equal(compiled(x), router(x).experts)
