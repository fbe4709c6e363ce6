"""benchmarks/expert_gemm.py --autocast: its memory column counts what the backward keeps, and it sees the loop keep
the fp32 expert weights themselves instead of bf16 copies where the own kernel runs (no timing is checked)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import mhmoe.moe.dispatch.fused as fused
from mhmoe.config.moe import MoEConfig
from mhmoe.moe.dispatch import native
from mhmoe.moe.layers import build_ffn_layer

ROOT = Path(__file__).resolve().parents[2]


def _load():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_expert_gemm", ROOT / "benchmarks" / "expert_gemm.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


expert_gemm = _load()
OWN = native.expert_ops(torch.bfloat16) is not None and native.cpu_isa() in native.DOT_GEMM_ISAS


@pytest.mark.skipif(not OWN, reason="needs the C++ loop and a CPU with AVX-512 BF16 or AMX")
def test_autocast_keeps_the_fp32_weights_instead_of_bf16_copies(monkeypatch):
    monkeypatch.setattr(fused, "expert_gemm", lambda *a: native.own_gemm())
    torch.manual_seed(0)
    layer = build_ffn_layer(64, MoEConfig(n_experts=8, top_k=2, d_expert=96, impl="fused"))
    x = torch.randn(1, 128, 64)
    with expert_gemm.cast_first(True):
        cast = expert_gemm.saved_mb(layer, x, autocast=True)
    with expert_gemm.cast_first(False):
        direct = expert_gemm.saved_mb(layer, x, autocast=True)
    copies = sum(w.numel() * 2 for w in (layer.experts.w1, layer.experts.w2, layer.experts.w3)) / 1e6
    assert cast - direct == pytest.approx(copies)


def test_saved_mb_counts_saved_tensors_but_not_parameters():
    torch.manual_seed(0)
    layer = build_ffn_layer(32, MoEConfig(n_experts=4, top_k=1, d_expert=64, impl="sorted"))
    x = torch.randn(1, 16, 32)
    kept = expert_gemm.saved_mb(layer, x, autocast=False)
    params = sum(p.numel() * p.element_size() for p in layer.parameters()) / 1e6
    assert kept > 16 * 32 * 4 / 1e6  # at least the input, which the layer's first op saves
    assert kept < params + 10  # parameters excluded; activations of 16 tokens are small
