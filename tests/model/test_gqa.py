"""Grouped-query attention (``model.n_kv_heads``): query head i reads key/value head i // (NH / KV) -- the same
model as multi-head attention whose key and value heads are repeated in that order --, the KV cache holds KV
heads, decoding with it equals the full forward, and the FLOPs and parameters count the narrower projections."""

from __future__ import annotations

import pytest
import torch

from mhmoe.config.flops import model_flops_per_token
from mhmoe.config.model import ModelConfig
from mhmoe.config.moe import MoEConfig
from mhmoe.errors import ConfigError
from mhmoe.model.generate import generate
from mhmoe.model.lm import LM, KVCache

SMOE = MoEConfig(n_experts=4, top_k=2, d_expert=32)


def _cfg(kv: int, **over) -> ModelConfig:
    base = dict(vocab_size=97, d_model=64, n_layers=2, n_heads=8, n_kv_heads=kv, d_ff=96, moe_every=2,
                max_seq_len=64, moe=SMOE)
    return ModelConfig(**{**base, **over})


def test_gqa_is_multi_head_attention_with_repeated_key_value_heads():
    torch.manual_seed(0)
    gqa = LM(_cfg(2)).eval()
    mha = LM(_cfg(0)).eval()
    sd = gqa.state_dict()
    D, HD, group = 64, 8, 4
    for name, w in list(sd.items()):
        if name.endswith("attn.qkv.weight"):  # [D + 2 KV HD, D] -> [3D, D], each KV head repeated group times
            q, k, v = w.split([D, 2 * HD, 2 * HD])
            rep = [t.view(2, HD, D).repeat_interleave(group, 0).reshape(D, D) for t in (k, v)]
            sd[name] = torch.cat([q, *rep])
    mha.load_state_dict(sd)
    x = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(gqa(x).logits, mha(x).logits, rtol=1e-5, atol=1e-5)
    assert gqa.blocks[0].attn.qkv.weight.shape == (D + 2 * 2 * HD, D)


@pytest.mark.parametrize("kv", [1, 2])
def test_decoding_with_the_kv_cache_equals_the_full_forward(kv):
    torch.manual_seed(0)
    lm = LM(_cfg(kv)).eval()
    x = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(2))
    cache = KVCache(lm.cfg.n_layers)
    with torch.no_grad():
        full = lm(x).logits
        steps = [lm(x[:, :5], cache=cache).logits] + [lm(x[:, t:t + 1], cache=cache).logits for t in range(5, 12)]
    assert cache.k[0].shape == (2, kv, 12, 8)  # the cache holds the key/value heads only
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)
    out = generate(lm, x[:1, :4], 6, temperature=0)
    assert out.shape == (1, 10)


def test_flops_and_parameters_count_the_narrower_projections():
    mha, gqa = _cfg(0), _cfg(2)
    saved = 2 * mha.n_layers * 2 * 64 * (64 - 2 * 8)  # 2 FLOPs x layers x (k and v) x D x (D - KV HD)
    assert model_flops_per_token(mha, 32).attention - model_flops_per_token(gqa, 32).attention == saved
    assert model_flops_per_token(mha, 32).scores == model_flops_per_token(gqa, 32).scores  # NH heads score
    assert LM(mha).num_params() - LM(gqa).num_params() == saved // 2


@pytest.mark.parametrize("kv", [3, -1])
def test_kv_heads_must_divide_the_heads(kv):
    with pytest.raises(ConfigError, match="n_kv_heads"):
        _cfg(kv)


def test_the_transformers_wrapper_generates_our_tokens_with_its_cache():
    pytest.importorskip("transformers")
    from mhmoe.integrations.hf import MHMoEForCausalLM

    torch.manual_seed(0)
    lm = LM(_cfg(2)).eval()
    model = MHMoEForCausalLM.from_lm(lm, eos_token_id=0).eval()
    assert model.config.num_key_value_heads == 2
    prompt = torch.randint(1, 97, (1, 5), generator=torch.Generator().manual_seed(3))
    theirs = model.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(theirs, generate(lm, prompt, 8, temperature=0))
