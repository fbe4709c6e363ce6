"""Exactly resumable random batches for training, and deterministic evaluation windows.

Training: :class:`BatchSampler` returns, for ``(step, micro_step)``, ``B`` windows of ``T + 1``
tokens at uniformly random offsets drawn from a ``torch.Generator`` seeded with a hash of
``(seed, step, micro_step, rank)``.  A batch is a pure function of those numbers and the token
array, so resuming at step ``s`` reproduces the same batches with no sampler state to save.
With ``world_size > 1`` the token stream is cut into ``world_size`` equal contiguous shards and
rank ``r`` only reads shard ``r`` (the last ``len % world_size`` tokens are unused), so ranks see
disjoint data.

Evaluation: :func:`iter_eval_batches` walks a token array in non-overlapping windows of ``T``
inputs (window ``i`` reads tokens ``[i*T, i*T + T]``, its targets are shifted by one), ``B`` windows
per batch, in order; the last batch may have fewer rows unless ``drop_last``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import numpy as np
import torch

from mhmoe.errors import ConfigError, DataError


def _check_int(field: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ConfigError(field, value, f"integer >= {minimum}")
    return int(value)


def batch_seed(seed: int, step: int, micro_step: int, rank: int) -> int:
    """The 63-bit generator seed of one micro-batch: sha256 of ``seed:step:micro_step:rank``."""
    digest = hashlib.sha256(f"mhmoe-batch:{seed}:{step}:{micro_step}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _gather(tokens: np.ndarray, offsets: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = offsets[:, None] + np.arange(seq_len + 1, dtype=np.int64)[None, :]
    buf = torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))
    return buf[:, :-1].contiguous(), buf[:, 1:].contiguous()


class BatchSampler:
    """Random ``[B, T]`` training batches as a pure function of ``(seed, step, micro_step, rank)``."""

    def __init__(
        self,
        tokens: np.ndarray,
        *,
        batch_size: int,
        seq_len: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.batch_size = _check_int("batch_size", batch_size, 1)
        self.seq_len = _check_int("seq_len", seq_len, 1)
        self.seed = _check_int("seed", seed, 0)
        self.world_size = _check_int("world_size", world_size, 1)
        self.rank = _check_int("rank", rank, 0)
        if self.rank >= self.world_size:
            raise ConfigError("rank", rank, f"0..{self.world_size - 1} (world_size={self.world_size})")
        if tokens.ndim != 1:
            raise DataError(f"token array has shape {tokens.shape}: expected 1-D")
        self.tokens = tokens
        shard = len(tokens) // self.world_size
        self.start, self.stop = self.rank * shard, (self.rank + 1) * shard
        if shard < self.seq_len + 1:
            raise DataError(
                f"training tokens: shard {self.rank}/{self.world_size} has {shard} tokens "
                f"(of {len(tokens)}), need at least seq_len+1 = {self.seq_len + 1} for one sequence"
            )

    @property
    def shard(self) -> tuple[int, int]:
        """``[start, stop)`` token range this rank samples from."""
        return self.start, self.stop

    def offsets(self, step: int, micro_step: int = 0) -> np.ndarray:
        """Start offsets (into the full token array) of the ``B`` windows for this micro-batch."""
        _check_int("step", step, 0)
        _check_int("micro_step", micro_step, 0)
        g = torch.Generator(device="cpu")
        g.manual_seed(batch_seed(self.seed, step, micro_step, self.rank))
        high = self.stop - self.seq_len  # exclusive bound: offset + seq_len + 1 <= stop
        return torch.randint(self.start, high, (self.batch_size,), generator=g, dtype=torch.int64).numpy()

    def get_batch(self, step: int, micro_step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)`` int64 tensors of shape ``[B, T]`` with ``y[:, t] == x[:, t + 1]`` in the stream."""
        return _gather(self.tokens, self.offsets(step, micro_step), self.seq_len)

    __call__ = get_batch


def count_eval_batches(
    n_tokens: int, *, batch_size: int, seq_len: int, max_batches: int | None = None, drop_last: bool = False
) -> int:
    """Number of batches :func:`iter_eval_batches` yields for an array of ``n_tokens`` tokens."""
    windows = max(0, (n_tokens - 1) // seq_len)
    n = windows // batch_size if drop_last else -(-windows // batch_size)
    return n if max_batches is None else min(n, max_batches)


def iter_eval_batches(
    tokens: np.ndarray,
    *,
    batch_size: int,
    seq_len: int,
    max_batches: int | None = None,
    drop_last: bool = False,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic ``(x, y)`` batches over non-overlapping windows of ``tokens``, in order."""
    batch_size = _check_int("batch_size", batch_size, 1)
    seq_len = _check_int("seq_len", seq_len, 1)
    if max_batches is not None:
        max_batches = _check_int("max_batches", max_batches, 0)
    windows = max(0, (len(tokens) - 1) // seq_len)
    n = count_eval_batches(len(tokens), batch_size=batch_size, seq_len=seq_len, max_batches=max_batches,
                           drop_last=drop_last)  # fmt: skip
    for b in range(n):
        first = b * batch_size
        rows = min(batch_size, windows - first)
        offsets = (np.arange(rows, dtype=np.int64) + first) * seq_len
        yield _gather(tokens, offsets, seq_len)
