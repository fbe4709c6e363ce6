"""Masking for masked-prediction pre-training (BEiT / BEiT-3): the mask ratios (:class:`MaskingConfig`), how many
positions a ratio masks (:func:`n_masked`), uniform masks (:func:`random_mask`) and BEiT's block-wise masks on an
image's patch grid (:func:`block_mask`). Pure functions of their arguments and a ``torch.Generator``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mhmoe.errors import ConfigError


@dataclass(frozen=True)
class MaskingConfig:
    """Mask ratios and the image masking mode (``block`` as in BEiT, or ``random``)."""

    image_ratio: float = 0.4
    image_mode: str = "block"
    text_ratio: float = 0.15  # text-only windows
    pair_text_ratio: float = 0.5  # captions of image-text pairs
    min_block: int = 4  # smallest block in patches (BEiT: 16 on its 14x14 grid)

    def __post_init__(self) -> None:
        for name in ("image_ratio", "text_ratio", "pair_text_ratio"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0.0 < value < 1.0:
                raise ConfigError(f"masking.{name}", value, "a number in (0, 1)")
        if self.image_mode not in ("block", "random"):
            raise ConfigError("masking.image_mode", self.image_mode, "block | random")
        if not isinstance(self.min_block, int) or self.min_block < 1:
            raise ConfigError("masking.min_block", self.min_block, "integer >= 1")


def n_masked(n: int, ratio: float) -> int:
    """Number of positions masked out of ``n``: ``round(ratio * n)``, at least 1 (0 if n == 0)."""
    return 0 if n <= 0 else min(n, max(1, int(round(ratio * n))))


def random_mask(n: int, count: int, gen: torch.Generator) -> torch.Tensor:
    """Bool ``[n]`` with exactly ``count`` True positions chosen uniformly."""
    mask = torch.zeros(n, dtype=torch.bool)
    if count > 0:
        mask[torch.randperm(n, generator=gen)[:count]] = True
    return mask


def block_mask(rows: int, cols: int, count: int, gen: torch.Generator, min_block: int = 4) -> torch.Tensor:
    """BEiT's block-wise masking on a ``rows x cols`` grid, with exactly ``count`` masked patches.

    Rectangles with area in ``[min_block, count - masked]`` and aspect ratio in ``[0.3, 1/0.3]``
    (log-uniform) are added while each adds at least one new patch (up to 10 tries each, as BEiT);
    if blocks cannot reach ``count`` exactly, the rest is filled with random patches.  Returns bool
    ``[rows * cols]`` in row-major order.
    """
    grid = torch.zeros(rows, cols, dtype=torch.bool)
    total = rows * cols
    count = min(count, total)
    min_block = max(1, min(min_block, count))
    log_lo, log_hi = math.log(0.3), math.log(1 / 0.3)

    def rand() -> float:
        return float(torch.rand((), generator=gen))

    while int(grid.sum()) < count:
        room = count - int(grid.sum())
        added = 0
        for _ in range(10):
            area = min_block + rand() * (room - min_block) if room > min_block else float(room)
            aspect = math.exp(log_lo + rand() * (log_hi - log_lo))
            h = int(round(math.sqrt(area * aspect)))
            w = int(round(math.sqrt(area / aspect)))
            if not (1 <= h <= rows and 1 <= w <= cols):
                continue
            top = int(rand() * (rows - h + 1))
            left = int(rand() * (cols - w + 1))
            new = int((~grid[top : top + h, left : left + w]).sum())
            if 0 < new <= room:
                grid[top : top + h, left : left + w] = True
                added = new
                break
        if added == 0:
            break
    flat = grid.reshape(-1)
    rest = count - int(flat.sum())
    if rest > 0:
        free = torch.nonzero(~flat).squeeze(1)
        flat[free[torch.randperm(len(free), generator=gen)[:rest]]] = True
    return flat
