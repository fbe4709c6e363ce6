"""The router's score GEMM dtype (``MoEConfig.router_dtype``): fp32 copies (default) or the model's compute dtype."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mhmoe.config.moe import MoEConfig
from mhmoe.config.presets import get_preset
from mhmoe.errors import ConfigError
from mhmoe.moe.layers import MoELayer
from mhmoe.moe.routers import build_router
from mhmoe.research.store import identity, run_key

ROUTERS = {
    "softmax": dict(router="softmax", top_k=2),
    "sigmoid": dict(router="sigmoid", top_k=2),
    "noisy": dict(router="noisy", top_k=2),
    "xmoe": dict(router="xmoe", top_k=2),
    "xmoe-code": dict(router="xmoe", top_k=2, xmoe_reading="code"),
    "expert_choice": dict(router="expert_choice", top_k=2),
}


def _router(name: str, dtype: str, seed: int = 0):
    torch.manual_seed(seed)
    r = build_router(32, MoEConfig(n_experts=8, d_expert=16, router_dtype=dtype, **ROUTERS[name]))
    return r.eval()  # no noise, no coin flips: the same decisions from the same scores


def _gemm(router, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The router's first score GEMM in ``dtype`` (fp32 result), computed here from its weight."""
    w = router.proj.weight if hasattr(router, "proj") else router.weight
    return (x.to(dtype) @ w.to(dtype).t()).float()


@pytest.mark.parametrize("name", list(ROUTERS))
def test_float32_and_model_agree_in_an_fp32_model(name):
    x = torch.randn(40, 32)
    a, b = _router(name, "float32")(x), _router(name, "model")(x)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.experts, b.experts) and torch.equal(a.weights, b.weights)


@pytest.mark.parametrize("name", ["softmax", "sigmoid", "noisy", "expert_choice"])
def test_model_dtype_scores_are_the_bf16_linear_layers(name):
    """Under bf16 autocast ``model`` scores are x W^T in bf16 (rounded to bf16, as a bf16 linear layer's output);
    ``float32`` scores are the fp32 product of the same bf16 input, whatever the autocast."""
    x = torch.randn(64, 32).to(torch.bfloat16)
    for dtype, want in (("model", torch.bfloat16), ("float32", torch.float32)):
        r = _router(name, dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = r(x)
        assert out.logits.dtype == torch.float32 and out.weights.dtype == torch.float32
        torch.testing.assert_close(out.logits, _gemm(r, x, want), rtol=0, atol=0)
    fp32 = _router(name, "float32")(x).logits  # the default is the same with autocast and without
    torch.testing.assert_close(fp32, _gemm(_router(name, "float32"), x, torch.float32), rtol=0, atol=0)


def test_model_dtype_follows_bf16_weights_without_autocast():
    r = _router("softmax", "model").to(torch.bfloat16)
    x = torch.randn(16, 32).to(torch.bfloat16)
    torch.testing.assert_close(r(x).logits, (x @ r.weight.t()).float(), rtol=0, atol=0)
    r32 = _router("softmax", "float32").to(torch.bfloat16)
    torch.testing.assert_close(r32(x).logits, x.float() @ r32.weight.float().t(), rtol=0, atol=0)


def test_xmoe_projection_runs_in_the_model_dtype():
    """X-MoE: the projection GEMM in bf16 under autocast (as torchscale's ``wg_reduction``), the low-dimensional
    cosine scores in fp32."""
    r = _router("xmoe-code", "model")
    x = torch.randn(24, 32).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = r(x).logits
    z = _gemm(r, x, torch.bfloat16)
    want = z @ F.normalize(r.expert_embed.float(), dim=-1, eps=1e-4).t()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_model_dtype_gradients_reach_the_fp32_router_weight():
    cfg = MoEConfig(n_experts=8, top_k=2, d_expert=16, router_dtype="model", impl="loop")
    torch.manual_seed(0)
    layer = MoELayer(32, cfg)
    x = torch.randn(2, 10, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
        (out.out.float().square().mean() + out.aux_loss).backward()
    g = layer.router.weight.grad
    assert g is not None and g.dtype == torch.float32 and g.abs().sum() > 0 and x.grad is not None


def test_the_fused_gpu_router_is_left_to_the_float32_reading(monkeypatch):
    """The fused kernel computes exact fp32 scores: the float32 router reaches it, the model-dtype one does not."""
    pytest.importorskip("triton")
    from mhmoe.moe.dispatch.triton import router as fused

    calls = []
    monkeypatch.setattr(fused, "supported", lambda *a: True)
    monkeypatch.setattr(fused, "fused_route", lambda *a: calls.append(a) or (None,) * 8)
    x, mask = torch.randn(4, 32), torch.ones(4, dtype=torch.bool)
    for dtype in ("float32", "model"):
        r = _router("softmax", dtype)
        r.impl = "triton"  # on CPU tensors: the fused path where it applies (the Triton interpreter in tests)
        out = r._fused(x, mask)
        assert (out is not None) == (dtype == "float32")
    assert len(calls) == 1


def test_router_dtype_is_validated():
    with pytest.raises(ConfigError, match="router_dtype"):
        MoEConfig(router_dtype="bfloat16")


def test_run_keys_of_float32_runs_are_those_before_the_field():
    """A run at the default keeps its store key (records written before the field existed stay valid); the other
    reading is another run."""
    run = get_preset("tiny-mh2")
    assert "model.moe.router_dtype" not in identity(run)
    run.model.moe.router_dtype = "model"
    assert identity(run)["model.moe.router_dtype"] == "model"
    assert run_key(run) != run_key(get_preset("tiny-mh2"))


def test_committed_run_records_keep_their_keys():
    """Every run record in docs/results was written before ``router_dtype`` existed: its config, read now, has the
    same key as then."""
    import json
    from pathlib import Path

    from mhmoe.config.run import RunConfig

    records = [r for p in sorted((Path(__file__).parents[2] / "docs" / "results").rglob("*.json"))
               if isinstance(r := json.loads(p.read_text(encoding="utf-8")), dict) and "key" in r and "config" in r]
    assert len(records) >= 40
    for rec in records:
        assert run_key(RunConfig.from_dict(rec["config"])) == rec["key"], rec["key"]
