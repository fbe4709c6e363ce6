"""Batch sampler purity, rank sharding, and the deterministic evaluation iterator."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mhmoe.data.sampler import BatchSampler, batch_seed, count_eval_batches, iter_eval_batches
from mhmoe.errors import ConfigError, DataError

TOKENS = np.arange(10_000, dtype=np.uint16)


def test_batch_is_pure_function_of_seed_step_micro() -> None:
    a = BatchSampler(TOKENS, batch_size=4, seq_len=16, seed=7)
    b = BatchSampler(TOKENS.copy(), batch_size=4, seq_len=16, seed=7)
    x1, y1 = a.get_batch(123, 2)
    _ = [a.get_batch(s) for s in range(5)]  # drawing other batches changes nothing
    x2, y2 = b.get_batch(123, 2)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(a.get_batch(123, 3)[0], x1)
    assert not torch.equal(a.get_batch(124, 2)[0], x1)
    assert not torch.equal(BatchSampler(TOKENS, batch_size=4, seq_len=16, seed=8).get_batch(123, 2)[0], x1)


def test_batch_shapes_and_shift() -> None:
    x, y = BatchSampler(TOKENS, batch_size=3, seq_len=5, seed=0)(0)
    assert x.shape == y.shape == (3, 5) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y[:, :-1], x[:, 1:])
    assert torch.equal(y, x + 1)  # tokens are consecutive integers
    assert int(x.min()) >= 0 and int(y.max()) < len(TOKENS)


def test_offsets_cover_shard_uniformly_and_stay_inside() -> None:
    s = BatchSampler(TOKENS[:100], batch_size=64, seq_len=9, seed=1)
    offs = np.concatenate([s.offsets(i) for i in range(200)])
    assert offs.min() == 0 and offs.max() == 100 - 10  # last valid start
    assert len(np.unique(offs)) == 91


def test_ranks_read_disjoint_shards() -> None:
    world = 4
    seen = []
    for r in range(world):
        s = BatchSampler(TOKENS, batch_size=8, seq_len=32, seed=3, rank=r, world_size=world)
        assert s.shard == (r * 2500, (r + 1) * 2500)
        xs = torch.cat([torch.cat(s.get_batch(step, m), 1) for step in range(50) for m in range(2)])
        assert int(xs.min()) >= r * 2500 and int(xs.max()) < (r + 1) * 2500
        seen.append(set(xs.flatten().tolist()))
    for i in range(world):
        for j in range(i + 1, world):
            assert not seen[i] & seen[j]


def test_batch_seed_depends_on_every_field() -> None:
    base = batch_seed(1, 2, 3, 4)
    assert base == batch_seed(1, 2, 3, 4) and 0 <= base < 2**63
    assert (
        len(
            {
                base,
                batch_seed(0, 2, 3, 4),
                batch_seed(1, 0, 3, 4),
                batch_seed(1, 2, 0, 4),
                batch_seed(1, 2, 3, 0),
            }
        )
        == 5
    )


def test_sampler_validation() -> None:
    with pytest.raises(DataError, match=r"shard 1/2 has 10 tokens \(of 20\), need at least seq_len\+1 = 17"):
        BatchSampler(TOKENS[:20], batch_size=1, seq_len=16, seed=0, rank=1, world_size=2)
    with pytest.raises(ConfigError, match="rank"):
        BatchSampler(TOKENS, batch_size=1, seq_len=16, seed=0, rank=2, world_size=2)
    with pytest.raises(ConfigError, match="batch_size"):
        BatchSampler(TOKENS, batch_size=0, seq_len=16, seed=0)
    with pytest.raises(ConfigError, match="step"):
        BatchSampler(TOKENS, batch_size=1, seq_len=16, seed=0).get_batch(-1)


def test_eval_iterator_windows() -> None:
    toks = np.arange(101, dtype=np.uint16)  # 100 targets -> 10 windows of 10
    batches = list(iter_eval_batches(toks, batch_size=4, seq_len=10))
    assert [b[0].shape for b in batches] == [(4, 10), (4, 10), (2, 10)]
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    assert torch.equal(x.flatten(), torch.arange(100)) and torch.equal(y.flatten(), torch.arange(1, 101))
    again = list(iter_eval_batches(toks, batch_size=4, seq_len=10))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again, strict=True))
    assert len(list(iter_eval_batches(toks, batch_size=4, seq_len=10, drop_last=True))) == 2
    assert len(list(iter_eval_batches(toks, batch_size=4, seq_len=10, max_batches=1))) == 1
    assert list(iter_eval_batches(toks[:10], batch_size=4, seq_len=10)) == []
    assert count_eval_batches(101, batch_size=4, seq_len=10) == 3
    assert count_eval_batches(101, batch_size=4, seq_len=10, max_batches=2, drop_last=True) == 2
