"""Shared test helpers (importable from test modules: tests/ is on sys.path under pytest)."""

import copy

from mhmoe.config.moe import MoEConfig
from mhmoe.moe.layers import build_ffn_layer


def oracle_pair(d_model: int, cfg: MoEConfig):
    """Two identical layers: one running ``cfg.impl`` and one the per-expert loop oracle."""
    fast = build_ffn_layer(d_model, cfg)
    ref = copy.deepcopy(fast)
    ref_cfg = MoEConfig(**{**cfg.to_dict(), "impl": "loop"})
    for m in ref.modules():
        if hasattr(m, "cfg"):
            m.cfg = ref_cfg
    return fast, ref
