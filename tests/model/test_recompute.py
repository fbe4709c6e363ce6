"""Activation checkpointing (mhmoe.model.recompute): the chosen part runs again in the backward (counted), the loss,
aux loss, gradients, updated weights and RNG states equal the run without it bit for bit (every router, capacity,
the encoder, bf16 autocast), evaluation and generation do not recompute, the memory held between the forward and the
backward shrinks (glibc's own count: mhmoe.runtime.cpu_malloc.held_bytes), and the config refuses what cannot apply."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from helpers import MHMOE, SMOE

from mhmoe.config.model import ModelConfig
from mhmoe.config.moe import MoEConfig
from mhmoe.config.run import RunConfig
from mhmoe.errors import ConfigError
from mhmoe.model import Encoder
from mhmoe.model.lm import LM, Block
from mhmoe.model.recompute import set_activation_checkpointing
from mhmoe.moe.routers import XMoERouter
from mhmoe.runtime.cpu_malloc import held_bytes

V = 61
MODES = ("none", "moe", "blocks")
MOES = {
    "mhmoe-capacity": MoEConfig(n_experts=6, top_k=3, d_expert=16, heads=3, head_layer=True, merge_layer=True,
                                capacity_factor=1.0),
    "smoe": SMOE,
    "noisy": MoEConfig(n_experts=4, top_k=2, d_expert=32, router="noisy"),
    "xmoe-code": MoEConfig(n_experts=4, top_k=2, d_expert=32, router="xmoe", xmoe_reading="code"),
    "sigmoid-aux-free-shared": MoEConfig(n_experts=4, top_k=2, d_expert=32, router="sigmoid", aux_free_bias=True,
                                         n_shared=1),
}


def lm(moe: MoEConfig, **kw) -> LM:
    torch.manual_seed(0)
    base = dict(vocab_size=V, d_model=48, n_layers=2, n_heads=4, d_ff=64, max_seq_len=64, moe_every=1, moe=moe)
    return LM(ModelConfig(**{**base, **kw}))


def count_calls(model: torch.nn.Module) -> dict[str, int]:
    """Calls of every block's attention and FFN, counted when they start (a recomputation may stop early)."""
    calls = {"attn": 0, "ffn": 0}
    for block in model.modules():
        if isinstance(block, Block):
            for part in calls:
                getattr(block, part).register_forward_pre_hook(lambda *_, p=part: calls.__setitem__(p, calls[p] + 1))
    return calls


def train_step(model: torch.nn.Module, mode: str, batch: dict, **autocast) -> dict:
    """One forward + backward + SGD step of a copy of ``model`` recomputing ``mode``: what it produced."""
    model = copy.deepcopy(model)
    set_activation_checkpointing(model, mode)
    gens = [m.generator for m in model.modules() if isinstance(m, XMoERouter) and m.generator is not None]
    calls = count_calls(model)
    torch.manual_seed(5)
    with torch.autocast("cpu", **autocast) if autocast else torch.autocast("cpu", enabled=False):
        out = model(**batch)
    (out.loss + out.aux_loss).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.1 * p.grad
    return {"loss": out.loss.detach(), "aux": out.aux_loss.detach(), "grads": grads, "calls": calls,
            "state": {k: v.clone() for k, v in model.state_dict().items()}, "rng": torch.get_rng_state(),
            "gens": [g.get_state() for g in gens]}


def assert_same_step(a: dict, b: dict) -> None:
    assert torch.equal(a["loss"], b["loss"]) and torch.equal(a["aux"], b["aux"])
    assert a["grads"].keys() == b["grads"].keys()
    for k in a["grads"]:
        assert torch.equal(a["grads"][k], b["grads"][k]), k
    for k in a["state"]:
        assert torch.equal(a["state"][k], b["state"][k]), k
    assert torch.equal(a["rng"], b["rng"])
    assert all(torch.equal(x, y) for x, y in zip(a["gens"], b["gens"], strict=True))


def lm_batch(b: int = 3, t: int = 10) -> dict:
    g = torch.Generator().manual_seed(1)
    return {"idx": torch.randint(0, V, (b, t), generator=g), "targets": torch.randint(0, V, (b, t), generator=g)}


@pytest.mark.parametrize("name", list(MOES))
def test_recomputation_trains_the_same_step_bit_for_bit(name):
    """moe and blocks: the loss, aux loss, every gradient, the updated weights (the X-MoE code reading's rescaled
    expert embeddings included) and the RNG states equal the step without recomputation; the chosen part ran
    again in the backward (attention too under blocks; each block's FFN once more under moe)."""
    model = lm(MOES[name]).train()
    if name == "xmoe-code":  # coin flips from the routers' own generators: restored for the recomputation
        for i, r in enumerate(m for m in model.modules() if isinstance(m, XMoERouter)):
            r.generator = torch.Generator().manual_seed(10 + i)
    steps = {mode: train_step(model, mode, lm_batch()) for mode in MODES}
    for mode in ("moe", "blocks"):
        assert_same_step(steps[mode], steps["none"])
    n = len(model.blocks)
    assert steps["none"]["calls"] == {"attn": n, "ffn": n}
    assert steps["moe"]["calls"] == {"attn": n, "ffn": 2 * n}
    assert steps["blocks"]["calls"] == {"attn": 2 * n, "ffn": 2 * n}


@pytest.mark.parametrize("impl", ["sorted", "chunked", "padded", "loop"])
def test_every_dispatch_path_recomputes_the_same_step(impl):
    model = lm(MoEConfig(n_experts=4, top_k=2, d_expert=32, heads=2, head_layer=True, merge_layer=True,
                         impl=impl)).train()
    steps = {mode: train_step(model, mode, lm_batch()) for mode in ("none", "moe")}
    assert_same_step(steps["moe"], steps["none"])


def test_bitnet_recomputes_the_same_step():
    moe = MoEConfig(n_experts=4, top_k=2, d_expert=32, heads=2, head_layer=True, merge_layer=True, quant="bitnet158")
    model = lm(moe, quant="bitnet158").train()
    steps = {mode: train_step(model, mode, lm_batch()) for mode in MODES}
    assert_same_step(steps["moe"], steps["none"])
    assert_same_step(steps["blocks"], steps["none"])


def test_the_x_moe_code_reading_rescales_its_embeddings_once_per_step():
    """The stored expert embeddings are rescaled in the training forward only, not again when it is recomputed
    (which would move them by rounding): checked directly on the flag the recomputation sets."""
    model = lm(MOES["xmoe-code"]).train()
    router = next(m for m in model.modules() if isinstance(m, XMoERouter))
    with torch.no_grad():
        router.expert_embed.mul_(3.0)  # far from norm 1.5: a second rescale would change it
    before = router.expert_embed.detach().clone()
    router.recomputing = True
    router.scores(torch.randn(5, router.d_in))
    assert torch.equal(router.expert_embed.detach(), before)
    router.recomputing = False
    router.scores(torch.randn(5, router.d_in))
    assert torch.allclose(router.expert_embed.detach().norm(dim=1), torch.full((4,), 1.5))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_recomputation_under_autocast_is_the_same_step(dtype):
    model = lm(MOES["mhmoe-capacity"]).train()
    steps = {mode: train_step(model, mode, lm_batch(), dtype=dtype) for mode in MODES}
    for mode in ("moe", "blocks"):
        assert_same_step(steps[mode], steps["none"])
    assert steps["moe"]["calls"]["ffn"] == 2 * len(model.blocks)


def test_only_the_moe_blocks_recompute_under_moe():
    """moe_every=2: the dense blocks keep their activations under moe, every block recomputes under blocks."""
    model = lm(MHMOE, n_layers=4, moe_every=2).train()
    assert set_activation_checkpointing(copy.deepcopy(model), "moe") == 2
    assert set_activation_checkpointing(copy.deepcopy(model), "blocks") == 4
    steps = {mode: train_step(model, mode, lm_batch()) for mode in MODES}
    assert steps["moe"]["calls"] == {"attn": 4, "ffn": 6}
    assert_same_step(steps["moe"], steps["none"])
    assert_same_step(steps["blocks"], steps["none"])


def test_the_encoder_recomputes_the_same_step():
    """The masked encoder's blocks (expert choice: every expert's picks depend on the whole batch)."""
    moe = MoEConfig(n_experts=4, top_k=2, d_expert=16, heads=2, head_layer=True, merge_layer=True,
                    router="expert_choice", capacity_factor=1.0)
    torch.manual_seed(0)
    model = Encoder(ModelConfig(arch="encoder", vocab_size=40, d_model=48, n_layers=2, n_heads=4, d_ff=64,
                                max_seq_len=32, moe_every=1, moe=moe)).train()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 40, (3, 12), generator=g)
    batch = {"input_ids": ids, "targets": ids, "loss_mask": torch.rand(3, 12, generator=g) < 0.5,
             "attention_mask": torch.ones(3, 12, dtype=torch.bool)}
    steps = {mode: train_step(model, mode, batch) for mode in MODES}
    assert_same_step(steps["moe"], steps["none"])
    assert_same_step(steps["blocks"], steps["none"])
    assert steps["blocks"]["calls"] == {"attn": 4, "ffn": 4}


def test_evaluation_and_generation_do_not_recompute():
    model = lm(MHMOE)
    set_activation_checkpointing(model, "blocks")
    calls = count_calls(model)
    idx = lm_batch()["idx"]
    model.eval()
    model(idx, idx)  # eval mode with gradients: no graph to save memory for in training's sense, still plain
    model.train()
    with torch.no_grad():
        model(idx, idx)
    assert calls == {"attn": 4, "ffn": 4}


def test_recomputation_holds_less_memory_between_forward_and_backward():
    """Bytes allocated by the forward and still held when the backward starts, by glibc's count: an MH-MoE LM
    keeps most of them in its MoE layers (moe frees those) and the rest in attention (blocks frees those too)."""
    if held_bytes() is None:
        pytest.skip("needs glibc's mallinfo2")
    moe = MoEConfig(n_experts=8, top_k=3, d_expert=64, heads=3, head_layer=True, merge_layer=True)
    model = lm(moe, d_model=96, n_heads=4, max_seq_len=128).train()
    idx = torch.randint(0, V, (8, 128))
    held = {}
    for mode in MODES * 2:  # the second round counts (the first warms the allocator up)
        set_activation_checkpointing(model, mode)
        model.zero_grad(set_to_none=True)
        gc.collect()
        before = held_bytes()
        out = model(idx, idx, return_logits=False)
        held[mode] = held_bytes() - before
        (out.loss + out.aux_loss).backward()
        del out
    assert held["moe"] < 0.6 * held["none"], held
    assert held["blocks"] < 0.5 * held["moe"], held


def test_the_config_refuses_what_does_not_apply():
    run = RunConfig()
    assert run.train.activation_checkpointing == "none"
    assert run.with_overrides(["train.activation_checkpointing=moe"]).train.activation_checkpointing == "moe"
    with pytest.raises(ConfigError, match="train.activation_checkpointing"):
        run.with_overrides(["train.activation_checkpointing=full"])
    dense = run.with_overrides(["model.moe.kind=dense"])
    with pytest.raises(ConfigError, match="train.activation_checkpointing.*dense model"):
        dense.with_overrides(["train.activation_checkpointing=moe"])
    assert dense.with_overrides(["train.activation_checkpointing=blocks"]).train.activation_checkpointing == "blocks"
    code = run.with_overrides(["model.moe.router=xmoe", "model.moe.xmoe_reading=code", "model.moe.top_k=2",
                               "model.moe.capacity_factor=null", "train.activation_checkpointing=moe"])
    with pytest.raises(ConfigError, match="train.activation_checkpointing.*train.compile"):
        code.with_overrides(["train.compile=true"])
    with pytest.raises(ValueError, match="allowed none | moe | blocks"):
        set_activation_checkpointing(lm(SMOE), "full")
