"""The language model: shapes, loss, masking, causality, routing statistics, tied embeddings,
measured FLOPs, evaluation and the AdamW parameter groups."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mhmoe.config.model import ModelConfig
from mhmoe.config.moe import MoEConfig
from mhmoe.config.train import TrainConfig
from mhmoe.errors import ConfigError
from mhmoe.model.lm import LM, LMOutput
from mhmoe.train.evaluate import evaluate, forward_flops_per_token
from mhmoe.train.optim import build_optimizer, decay_start, lr_lambda

V = 61
DENSE = MoEConfig(kind="dense", d_expert=64)
SMOE = MoEConfig(n_experts=4, top_k=1, d_expert=64)
MHMOE = MoEConfig(n_experts=6, top_k=3, d_expert=16, heads=3, head_layer=True, merge_layer=True)
ALL = {"dense": DENSE, "smoe": SMOE, "mhmoe": MHMOE}



def cfg(moe: MoEConfig = MHMOE, **kw) -> ModelConfig:
    base = dict(vocab_size=V, d_model=48, n_layers=2, n_heads=4, d_ff=64, max_seq_len=64, moe=moe)
    base.update(kw)
    return ModelConfig(**base)


@pytest.mark.parametrize("name", list(ALL))
def test_forward_shapes_and_loss(name):
    model = LM(cfg(ALL[name]))
    idx, tgt = torch.randint(0, V, (3, 10)), torch.randint(0, V, (3, 10))
    out = model(idx, tgt)
    assert isinstance(out, LMOutput) and out.logits.shape == (3, 10, V)
    ref = F.cross_entropy(out.logits.reshape(-1, V), tgt.reshape(-1))
    torch.testing.assert_close(out.loss, ref)
    assert abs(out.loss.item() - math.log(V)) < 0.3  # small init -> near-uniform predictions
    assert out.aux_loss.dim() == 0 and out.aux_loss.dtype == torch.float32
    torch.testing.assert_close(out.total_loss, out.loss + out.aux_loss)
    n_moe = 0 if name == "dense" else 1  # moe_every=2, 2 layers -> block 1
    assert len(out.routing) == n_moe and (out.aux_loss.item() == 0.0) == (n_moe == 0)
    no_tgt = model(idx)
    assert no_tgt.loss is None
    with pytest.raises(AssertionError):
        _ = no_tgt.total_loss


def test_moe_every_places_the_moe_blocks():
    model = LM(cfg(MHMOE, n_layers=4, moe_every=2))
    assert [b.is_moe for b in model.blocks] == [False, True, False, True]
    model = LM(cfg(MHMOE, n_layers=3, moe_every=1))
    assert all(b.is_moe for b in model.blocks)
    out = model(torch.randint(0, V, (2, 8)))
    assert len(out.routing) == 3
    for s in out.routing:  # every sub-token goes to top_k experts, dropless
        assert s.tokens == 2 * 8 * 3 and int(s.counts.sum()) == 2 * 8 * 3 * 3 and s.dropped == 0


def test_mask_excludes_padding_from_loss_and_routing():
    model = LM(cfg(MHMOE, moe_every=1))
    idx, tgt = torch.randint(0, V, (2, 12)), torch.randint(0, V, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, 7:] = False
    out = model(idx, tgt, mask=mask)
    keep = mask.reshape(-1)
    ref = F.cross_entropy(out.logits.reshape(-1, V)[keep], tgt.reshape(-1)[keep])
    torch.testing.assert_close(out.loss, ref)
    assert all(s.tokens == int(mask.sum()) * 3 for s in out.routing)


@pytest.mark.parametrize("name", list(ALL))
def test_causal(name):
    """Changing a token changes no earlier position's logits (dropless routing is per token)."""
    model = LM(cfg(ALL[name], moe_every=1)).eval()
    idx = torch.randint(0, V, (2, 16))
    changed = idx.clone()
    changed[:, 9] = (changed[:, 9] + 1) % V
    with torch.no_grad():
        a, b = model(idx).logits, model(changed).logits
    torch.testing.assert_close(a[:, :9], b[:, :9], atol=1e-6, rtol=0)
    assert not torch.allclose(a[:, 9:], b[:, 9:])


def test_batch_rows_are_independent():
    model = LM(cfg(MHMOE)).eval()
    idx = torch.randint(0, V, (4, 12))
    with torch.no_grad():
        together = model(idx).logits
        alone = torch.cat([model(idx[i:i + 1]).logits for i in range(4)])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=0)


def test_tied_and_untied_embeddings():
    tied = LM(cfg(MHMOE))
    assert tied.lm_head.weight is tied.embed.weight
    untied = LM(cfg(MHMOE, tie_embeddings=False))
    assert untied.lm_head.weight is not untied.embed.weight
    assert untied.num_params() == tied.num_params() + V * 48
    assert tied.num_params(exclude_embeddings=True) == tied.num_params() - V * 48


def test_invalid_model_inputs():
    with pytest.raises(ConfigError, match="vocab_size"):
        LM(cfg(MHMOE, vocab_size=0))
    with pytest.raises(ConfigError, match="n_heads"):
        cfg(MHMOE, n_heads=5)
    with pytest.raises(ConfigError, match="heads"):
        cfg(MoEConfig(n_experts=4, heads=5, head_layer=True), d_model=48)
    model = LM(cfg(MHMOE, max_seq_len=16))
    with pytest.raises(ValueError, match="idx shape"):
        model(torch.zeros(16, dtype=torch.long))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_init_is_seeded_and_scaled():
    torch.manual_seed(3)
    a = LM(cfg(MHMOE, n_layers=8, init_std=0.02))
    torch.manual_seed(3)
    b = LM(cfg(MHMOE, n_layers=8, init_std=0.02))
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), k
    assert abs(a.embed.weight.std().item() - 0.02) < 0.002
    assert abs(a.blocks[0].attn.proj.weight.std().item() - 0.02 / 4) < 0.001  # 0.02 / sqrt(2 * 8)


def test_backward_reaches_every_parameter():
    model = LM(cfg(MHMOE, moe_every=1))
    out = model(torch.randint(0, V, (4, 32)), torch.randint(0, V, (4, 32)))
    out.total_loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert missing == []
    assert model.blocks[0].ffn.moe.router.weight.grad.abs().sum() > 0  # router trained via weights + aux loss


def test_bfloat16_autocast_on_cpu():
    model = LM(cfg(MHMOE))
    idx, tgt = torch.randint(0, V, (2, 16)), torch.randint(0, V, (2, 16))
    ref = model(idx, tgt).loss.item()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(idx, tgt)
    assert out.loss.dtype == torch.float32 and abs(out.loss.item() - ref) < 0.05


def test_aux_free_bias_balance_step():
    model = LM(cfg(MoEConfig(n_experts=4, top_k=1, d_expert=16, aux_free_bias=True, bias_update_rate=0.1)))
    out = model(torch.randint(0, V, (2, 16)))
    router = model.blocks[1].ffn.router
    counts = out.routing[0].counts.float()
    model.balance_step(out.routing)
    expected = 0.1 * torch.sign(counts.mean() - counts)
    torch.testing.assert_close(router.selection_bias, expected)
    assert "blocks.1.ffn.router.selection_bias" in model.state_dict()  # checkpointed


# ---- FLOPs ----------------------------------------------------------------------------------------------------
def test_measured_flops_follow_the_ffn_width():
    """FlopCounterMode counts 2*m*n*p per product: a SwiGLU FFN costs 6*d*F per token."""
    seq, d = 16, 48
    narrow = forward_flops_per_token(LM(cfg(DENSE, d_ff=32)), seq)
    wide = forward_flops_per_token(LM(cfg(DENSE, d_ff=64)), seq)
    # moe.kind="dense": every block is the dense d_ff FFN (moe.d_expert is not used)
    assert wide - narrow == 6 * d * 32 * 2
    k1 = forward_flops_per_token(LM(cfg(MoEConfig(n_experts=4, top_k=1, d_expert=16))), seq)
    k2 = forward_flops_per_token(LM(cfg(MoEConfig(n_experts=4, top_k=2, d_expert=16))), seq)
    assert k2 - k1 == 6 * d * 16  # one more active expert in the one MoE block
    assert 6 * d * 64 < narrow < 1e6


def test_forward_flops_are_data_independent_and_keep_mode():
    model = LM(cfg(MHMOE)).train()
    a = forward_flops_per_token(model, 32)
    b = forward_flops_per_token(model, 32)
    assert a == b and model.training


# ---- evaluation ---------------------------------------------------------------------------------------------
def test_evaluate_is_token_weighted_mean_loss():
    model = LM(cfg(MHMOE)).train()
    tokens = np.random.default_rng(0).integers(0, V, size=3 * 16 + 5 + 1).astype(np.uint16)
    res = evaluate(model, {"a": tokens}, batch_size=2, seq_len=16, max_batches=None)
    assert model.training  # mode restored
    n_windows = (len(tokens) - 1) // 16
    model.eval()
    total, n = 0.0, 0
    with torch.no_grad():
        for w in range(n_windows):
            x = torch.from_numpy(tokens[w * 16:w * 16 + 16].astype(np.int64))[None]
            y = torch.from_numpy(tokens[w * 16 + 1:w * 16 + 17].astype(np.int64))[None]
            total += model(x, y).loss.item() * 16
            n += 16
    assert res["a"]["tokens"] == n == n_windows * 16
    assert res["a"]["loss"] == pytest.approx(total / n, rel=1e-5)
    assert res["a"]["ppl"] == pytest.approx(math.exp(res["a"]["loss"]))
    capped = evaluate(model, {"a": tokens}, batch_size=2, seq_len=16, max_batches=1)
    assert capped["a"]["tokens"] == 32


# ---- optimizer and schedule -------------------------------------------------------------------------------------
def test_weight_decay_only_on_matrices():
    model = LM(cfg(MHMOE))
    opt = build_optimizer(model, TrainConfig(weight_decay=0.1))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    n = sum(p.numel() for g in opt.param_groups for p in g["params"])
    assert n == model.num_params()  # tied weights counted once


@pytest.mark.parametrize("schedule", ["linear", "cosine", "constant"])
def test_lr_schedule(schedule):
    c = TrainConfig(max_steps=110, warmup_steps=10, schedule=schedule, min_lr_ratio=0.1)
    f = lr_lambda(c)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0) and f(10) == pytest.approx(1.0)
    if schedule == "constant":
        assert f(60) == f(110) == 1.0
    else:
        assert f(60) == pytest.approx(0.55) and f(110) == pytest.approx(0.1)
        assert all(f(s) >= f(s + 1) for s in range(10, 120))


@pytest.mark.parametrize("shape,mid", [("1-sqrt", 1 - 0.5 ** 0.5), ("linear", 0.5), ("cosine", 0.5)])
def test_wsd_holds_the_peak_then_cools_down_over_the_last_fraction(shape, mid):
    c = TrainConfig(max_steps=110, warmup_steps=10, schedule="wsd", cooldown_fraction=0.2, cooldown_shape=shape,
                    min_lr_ratio=0.1)
    f = lr_lambda(c)
    assert decay_start(c) == 88 and f(0) == pytest.approx(0.1)
    assert all(f(s) == 1.0 for s in range(9, 89))  # stable to the cooldown's first step
    assert f(99) == pytest.approx(0.1 + 0.9 * mid) and f(110) == pytest.approx(0.1)
    assert all(f(s) >= f(s + 1) for s in range(10, 120))
    longer = lr_lambda(TrainConfig(max_steps=220, warmup_steps=10, schedule="wsd", cooldown_shape=shape,
                                   min_lr_ratio=0.1))
    assert [longer(s) for s in range(88)] == [f(s) for s in range(88)]  # extend a run from its stable phase
    assert decay_start(TrainConfig(max_steps=20, warmup_steps=19, schedule="wsd")) == 19  # never in the warm-up


def test_cooldown_fraction_is_validated():
    with pytest.raises(ValueError, match="train.cooldown_fraction"):
        TrainConfig(schedule="wsd", cooldown_fraction=0.0)
