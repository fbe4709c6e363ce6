"""``model.qk_norm``: an RMSNorm over every query and key head before RoPE; decoding with the KV cache equals
the full forward, the norms' weights train (undecayed) and change the model."""

from __future__ import annotations

import torch

from mhmoe.config.model import ModelConfig
from mhmoe.config.moe import MoEConfig
from mhmoe.config.train import TrainConfig
from mhmoe.model.lm import LM, KVCache
from mhmoe.train.optim import build_optimizer


def _lm(qk_norm: bool, kv: int = 0) -> LM:
    torch.manual_seed(0)
    return LM(ModelConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=kv, qk_norm=qk_norm, d_ff=96,
                          moe_every=2, max_seq_len=64, moe=MoEConfig(n_experts=4, top_k=2, d_expert=32))).eval()


def test_the_norms_act_on_every_head_before_rope_and_decode_like_the_full_forward():
    lm = _lm(True, kv=2)
    attn = lm.blocks[0].attn
    assert attn.q_norm.weight.shape == attn.k_norm.weight.shape == (16,)
    x = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        attn.k_norm.weight.mul_(3.0)  # scaled keys: sharper attention, other logits
        full = lm(x).logits
        cache = KVCache(2)
        steps = [lm(x[:, :4], cache=cache).logits] + [lm(x[:, t:t + 1], cache=cache).logits for t in range(4, 12)]
        torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)
        attn.k_norm.weight.fill_(1.0)
        assert not torch.allclose(lm(x).logits, full)
    plain = _lm(False, kv=2)
    assert sum(p.numel() for p in lm.parameters()) - sum(p.numel() for p in plain.parameters()) == 2 * 2 * 16


def test_the_norm_weights_train_without_weight_decay():
    lm = _lm(True).train()
    decay, no_decay = build_optimizer(lm, TrainConfig(weight_decay=0.1)).param_groups
    q = lm.blocks[1].attn.q_norm.weight
    assert any(p is q for p in no_decay["params"]) and not any(p is q for p in decay["params"])
    x = torch.randint(0, 97, (2, 12))
    lm(x[:, :-1], x[:, 1:]).total_loss.backward()
    assert q.grad is not None and q.grad.abs().sum() > 0
