"""The decoder LM never lets the future leak: for every router and capacity setting, changing tokens
T/2..T-1 leaves the logits at 0..T/2-1 unchanged up to floating-point noise; the settings that would
leak (expert-choice routing, GShard capacity priority) are refused by the config, and the same check
catches their leak when the refusal is bypassed."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mhmoe.cli import main
from mhmoe.config.model import ModelConfig
from mhmoe.config.moe import ROUTERS, MoEConfig
from mhmoe.config.presets import get_preset
from mhmoe.errors import ConfigError
from mhmoe.model.lm import LM

V, B, T = 61, 3, 24
# Causal settings differ by summation-order noise (< 1e-6 here, usually exactly 0); the leaks of
# non-causal routing measure 7e-4..1e-2 on this model (the audit saw ~3e-4 on a trained one).
LEAK = 1e-5
CAPACITY = {  # name -> (MoEConfig changes, model.train() mode)
    "dropless-eval": ({}, False),
    "dropless-train": ({}, True),
    "train-capacity": (dict(capacity_factor=0.5), True),
    "eval-capacity": (dict(eval_capacity_factor=0.5), False),
}
CAUSAL_ROUTERS = [r for r in ROUTERS if r != "expert_choice"]


def _model(moe: MoEConfig, bypass: MoEConfig | None = None, quant: str = "none") -> LM:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=V, d_model=48, n_layers=2, n_heads=4, d_ff=64, max_seq_len=64, moe_every=1,
                      moe=moe, quant=quant)
    if bypass is not None:  # a layer config the decoder refuses, set after validation
        cfg.moe = bypass
    return LM(cfg)


def past_and_future_change(model: LM, train: bool) -> tuple[float, float]:
    """max |logit change| at positions < T/2 and >= T/2 when tokens T/2.. are replaced."""
    model.train(train)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, V, (B, T), generator=gen)
    changed = idx.clone()
    changed[:, T // 2:] = torch.randint(0, V, (B, T - T // 2), generator=gen)
    with torch.no_grad():
        torch.manual_seed(2)  # the noisy router draws the same noise in both forwards
        a = model(idx).logits
        torch.manual_seed(2)
        b = model(changed).logits
    diff = (a - b).abs()
    return float(diff[:, :T // 2].max()), float(diff[:, T // 2:].max())


@pytest.mark.parametrize("capacity", list(CAPACITY))
@pytest.mark.parametrize("heads", [1, 3])
@pytest.mark.parametrize("router", CAUSAL_ROUTERS)
def test_no_router_or_capacity_setting_leaks_the_future(router, heads, capacity):
    changes, train = CAPACITY[capacity]
    moe = MoEConfig(n_experts=6, top_k=2, d_expert=16, router=router, heads=heads, head_layer=heads > 1,
                    merge_layer=heads > 1, **changes)
    past, future = past_and_future_change(_model(moe), train)
    assert past < LEAK, f"logits before the change moved by {past:.2e}"
    assert future > 1e-3  # the change itself is visible


@pytest.mark.parametrize("capacity", ["train-capacity", "eval-capacity"])
def test_bitnet_with_capacity_is_causal(capacity):
    changes, train = CAPACITY[capacity]
    moe = MoEConfig(n_experts=6, top_k=2, d_expert=16, heads=3, head_layer=True, merge_layer=True, **changes)
    past, _ = past_and_future_change(_model(moe, quant="bitnet158"), train)
    assert past < LEAK


@pytest.mark.parametrize("heads", [1, 3])
@pytest.mark.parametrize("capacity", ["train-capacity", "eval-capacity"])
def test_the_check_catches_the_gshard_capacity_leak(capacity, heads):
    changes, train = CAPACITY[capacity]
    moe = MoEConfig(n_experts=6, top_k=2, d_expert=16, heads=heads, head_layer=heads > 1, merge_layer=heads > 1,
                    **changes)
    past, _ = past_and_future_change(_model(moe, bypass=replace(moe, capacity_priority="gshard")), train)
    assert past > 10 * LEAK


@pytest.mark.parametrize("train", [False, True])
def test_the_check_catches_the_expert_choice_leak(train):
    moe = MoEConfig(n_experts=6, top_k=2, d_expert=16)
    past, _ = past_and_future_change(_model(moe, bypass=replace(moe, router="expert_choice")), train)
    assert past > 10 * LEAK


@pytest.mark.parametrize("changes, field", [
    (dict(router="expert_choice"), "model.moe.router"),
    (dict(capacity_factor=1.25, capacity_priority="gshard"), "model.moe.capacity_priority"),
    (dict(eval_capacity_factor=2.0, capacity_priority="gshard"), "model.moe.capacity_priority"),
])
def test_decoder_refuses_noncausal_routing(changes, field):
    moe = MoEConfig(n_experts=4, top_k=2, d_expert=16, **changes)
    with pytest.raises(ConfigError) as info:
        ModelConfig(vocab_size=V, d_model=48, n_layers=2, n_heads=4, moe=moe)
    assert info.value.field == field and "\n" not in str(info.value)
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_dict(dict(vocab_size=V, d_model=48, n_layers=2, n_heads=4, moe=moe.to_dict()))
    assert info.value.field == field
    # the layer on its own (e.g. a bidirectional encoder) accepts them; dense ignores routing fields
    assert MoEConfig(**{**moe.to_dict(), "kind": "dense"}).noncausal_fields() == []
    # gshard priority without any capacity drops nothing, so it is allowed
    ModelConfig(vocab_size=V, d_model=48, n_layers=2, n_heads=4, moe=MoEConfig(capacity_priority="gshard"))


def test_cli_refuses_noncausal_routing_in_one_line(tmp_path, capsys):
    with pytest.raises(ConfigError, match="model.moe.capacity_priority"):
        get_preset("tiny-smoe").with_overrides(["model.moe.capacity_factor=1.0", "model.moe.capacity_priority=gshard"])
    code = main(["train", "--preset", "tiny-smoe", "--out", str(tmp_path / "run"), "--set",
                 "model.moe.router=expert_choice"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "model.moe.router" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "run").exists()
