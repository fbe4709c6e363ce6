"""The slots' grouping by expert in C++ (mhmoe.moe.dispatch.native.group_rows, used by common.group_keys): the
order of torch.argsort(key, stable=True) and the counts of a bincount, and torch's own wherever the op does not
run."""

import pytest
import torch

from mhmoe.moe.dispatch import native
from mhmoe.moe.dispatch.common import group_keys, sort_slots
from mhmoe.moe.dispatch.layout import row_layout

needs_ext = pytest.mark.skipif(native.expert_ops(torch.float32) is None, reason="C++ extension not built here")


def _keys():
    gen = torch.Generator().manual_seed(0)
    skewed = torch.where(torch.rand(5000, generator=gen) < 0.9, 3, torch.randint(0, 97, (5000,), generator=gen))
    return [(torch.randint(0, 97, (18432,), generator=gen), 97), (skewed, 97), (torch.zeros(40, dtype=torch.long), 1),
            (torch.full((33,), 8), 9), (torch.empty(0, dtype=torch.long), 5), (torch.arange(10).flip(0), 10),
            (torch.randint(0, 9, (40000,), generator=gen), 9)]  # past ATen's radix-sort threshold


@needs_ext
@pytest.mark.parametrize("case", range(7))
def test_group_rows_is_a_stable_argsort_and_a_bincount(case):
    key, n = _keys()[case]
    order, counts = torch.ops.mhmoe_cpu.group_rows(key, n)
    assert torch.equal(order, torch.argsort(key, stable=True))
    assert torch.equal(counts, torch.bincount(key, minlength=n))
    assert order.dtype == counts.dtype == torch.long


@needs_ext
def test_group_rows_refuses_keys_out_of_range_and_bad_shapes():
    for key, n in [(torch.tensor([0, 3]), 3), (torch.tensor([-1, 0]), 2), (torch.tensor([0]), 0)]:
        with pytest.raises(RuntimeError, match="group_rows"):
            torch.ops.mhmoe_cpu.group_rows(key, n)
    with pytest.raises(RuntimeError, match="1-d int64"):
        torch.ops.mhmoe_cpu.group_rows(torch.zeros(2, 2, dtype=torch.long), 3)
    with pytest.raises(RuntimeError, match="1-d int64"):
        torch.ops.mhmoe_cpu.group_rows(torch.zeros(4, dtype=torch.int32), 3)


@needs_ext
def test_group_keys_reads_non_contiguous_keys():
    key = torch.randint(0, 7, (300, 2))[:, 1]
    order, counts = group_keys(key, 7)
    assert torch.equal(order, torch.argsort(key, stable=True)) and torch.equal(counts, torch.bincount(key, minlength=7))


@pytest.mark.parametrize("off", [False, True])
def test_layouts_are_the_same_with_and_without_the_op(off):
    gen = torch.Generator().manual_seed(1)
    experts = torch.randint(0, 12, (257, 3), generator=gen)
    valid = torch.rand(257, 3, generator=gen) < 0.8
    with native.disabled() if off else torch.no_grad():
        layout = row_layout(experts, valid, 12, align=8)
        order, counts, counts_list = sort_slots(experts, valid, 12)
    key = torch.where(valid, experts, 12).reshape(-1)
    want = torch.argsort(key, stable=True)
    assert torch.equal(order, want[: int(valid.sum())]) and counts_list == counts.tolist()
    assert counts_list == torch.bincount(experts[valid], minlength=12).tolist() == layout.counts
    assert torch.equal(layout.slot[layout.inv[valid.reshape(-1)]], torch.arange(257 * 3)[valid.reshape(-1)])


def test_group_keys_off_the_op_is_torch():
    key = torch.randint(0, 5, (100,))
    with native.disabled():
        assert native.group_rows(key, 5) is None
        order, counts = group_keys(key, 5)
    assert torch.equal(order, torch.argsort(key, stable=True)) and torch.equal(counts, torch.bincount(key, minlength=5))
    assert native.group_rows(key.to(torch.int32), 5) is None  # other dtypes: torch
