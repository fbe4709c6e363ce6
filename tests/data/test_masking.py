"""Masks for masked-prediction pre-training (mhmoe.data.masking)."""

import pytest
import torch

from mhmoe.data.masking import MaskingConfig, block_mask, n_masked, random_mask
from mhmoe.errors import ConfigError


def test_block_and_random_masks() -> None:
    for count in (1, 6, 26, 40, 64):
        g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
        m = block_mask(8, 8, count, g1)
        assert m.shape == (64,) and int(m.sum()) == count
        assert torch.equal(m, block_mask(8, 8, count, g2))
    r = random_mask(50, 8, torch.Generator().manual_seed(1))
    assert int(r.sum()) == 8
    assert n_masked(64, 0.4) == 26 and n_masked(16, 0.4) == 6 and n_masked(3, 0.15) == 1 and n_masked(0, 0.5) == 0
    blocks = block_mask(14, 14, 78, torch.Generator().manual_seed(0), 16).reshape(14, 14)
    rows_hit = blocks.any(1).sum()  # block-wise: contiguous regions, not salt-and-pepper
    assert int(blocks.sum()) == 78 and int(rows_hit) < 14
    with pytest.raises(ConfigError, match="masking.image_ratio"):
        MaskingConfig(image_ratio=1.5)
    with pytest.raises(ConfigError, match="masking.image_mode"):
        MaskingConfig(image_mode="grid")
