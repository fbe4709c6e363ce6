"""The masked-data encoder: bidirectional attention (the future changes the past, unlike the decoder),
padding never reaches a real position (attention, routing, capacity), the loss is the masked positions'
cross-entropy, the embeddings it adds are used, it trains, and build_model picks the architecture."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import DENSE, MHMOE, SMOE

from mhmoe.config.model import ModelConfig
from mhmoe.config.moe import MoEConfig
from mhmoe.config.train import TrainConfig
from mhmoe.errors import ConfigError
from mhmoe.model import LM, Encoder, build_model
from mhmoe.moe.layers import MHMoELayer
from mhmoe.train.optim import build_optimizer

V, T = 40, 12
EXPERT_CHOICE = MoEConfig(n_experts=4, top_k=2, d_expert=16, heads=2, head_layer=True, merge_layer=True,
                          router="expert_choice", capacity_factor=1.0)
CAPACITY = MoEConfig(n_experts=4, top_k=2, d_expert=16, heads=2, head_layer=True, merge_layer=True, router="xmoe",
                     capacity_factor=1.0, eval_capacity_factor=1.0)


def encoder(moe: MoEConfig = MHMOE, **kw) -> Encoder:
    torch.manual_seed(0)
    cfg = ModelConfig(arch="encoder", vocab_size=V, d_model=48, n_layers=2, n_heads=4, d_ff=64, max_seq_len=32,
                      moe_every=1, moe=moe, **kw)
    return Encoder(cfg).eval()


def inputs(b: int = 3, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    pos = torch.full((b, T, 2), -1)
    pos[:, 1:9, 0], pos[:, 1:9, 1] = torch.arange(8) // 4, torch.arange(8) % 4  # a 2x4 image in positions 1..8
    modality = torch.zeros(b, T, dtype=torch.long)
    modality[:, :10] = 1
    return {"input_ids": torch.randint(0, V, (b, T), generator=g), "modality": modality, "patch_pos": pos,
            "attention_mask": torch.ones(b, T, dtype=torch.bool)}


@pytest.mark.parametrize("moe", [DENSE, SMOE, MHMOE, EXPERT_CHOICE, CAPACITY],
                         ids=["dense", "smoe", "mhmoe", "expert-choice", "capacity"])
def test_every_position_sees_the_whole_sequence(moe):
    """Changing the last tokens changes the logits of the first ones (bidirectional), far above float noise;
    the decoder with the same weights leaves its past unchanged (causal)."""
    model = encoder(moe)
    a = inputs()
    b = {**a, "input_ids": a["input_ids"].clone()}
    b["input_ids"][:, 8:] = (b["input_ids"][:, 8:] + 1) % V
    with torch.no_grad():
        la, lb = model(**a).logits, model(**b).logits
    assert float((la[:, :8] - lb[:, :8]).abs().max()) > 1e-3

    if moe.router != "expert_choice" and moe.capacity_factor is None:  # the causal settings of the decoder
        lm = LM(ModelConfig(**{**model.cfg.to_dict(), "arch": "decoder", "moe": moe})).eval()
        with torch.no_grad():
            da, db = lm(a["input_ids"]).logits, lm(b["input_ids"]).logits
        assert float((da[:, :8] - db[:, :8]).abs().max()) < 1e-5


@pytest.mark.parametrize("moe", [SMOE, MHMOE, EXPERT_CHOICE, CAPACITY], ids=["smoe", "mhmoe", "expert-choice",
                                                                          "capacity"])
def test_padding_never_reaches_real_positions(moe):
    """Whatever sits at padded positions (attention_mask False), the real positions' logits are the same:
    padding is not attended to, not routed, and takes no expert capacity."""
    model = encoder(moe)
    a = inputs()
    a["attention_mask"][:, 10:] = False
    b = {**a, "input_ids": a["input_ids"].clone(), "modality": a["modality"].clone()}
    b["input_ids"][:, 10:] = torch.randint(0, V, (3, 2), generator=torch.Generator().manual_seed(5))
    b["modality"][:, 10:] = 1
    with torch.no_grad():
        oa, ob = model(**a, return_routing=True), model(**b)
    torch.testing.assert_close(oa.logits[:, :10], ob.logits[:, :10], rtol=0, atol=1e-6)
    for f in oa.layer_outputs:  # padded (sub-)tokens are outside the routing
        assert not bool(f.route.token_mask.view(3, T, -1)[:, 10:].any())


def test_loss_is_the_masked_positions_cross_entropy():
    model = encoder()
    a = inputs()
    targets = torch.randint(0, V, (3, T), generator=torch.Generator().manual_seed(1))
    loss_mask = torch.zeros(3, T, dtype=torch.bool)
    loss_mask[:, [2, 5, 9]] = True
    out = model(**a, targets=targets, loss_mask=loss_mask)
    want = F.cross_entropy(out.logits[loss_mask].float(), targets[loss_mask])
    torch.testing.assert_close(out.loss, want)
    assert out.total_loss == out.loss + out.aux_loss
    assert model(**a).loss is None
    only = model(**a, targets=targets, loss_mask=loss_mask, return_logits=False)  # the head in row chunks
    assert only.logits is None
    torch.testing.assert_close(only.loss, want)


def test_modality_and_patch_embeddings_are_used():
    model = encoder()
    a = inputs()
    with torch.no_grad():
        base = model(**a).logits
        swapped = model(**{**a, "modality": 1 - a["modality"]}).logits
        moved = model(**{**a, "patch_pos": a["patch_pos"].flip(1)}).logits
    assert float((base - swapped).abs().max()) > 1e-3
    assert float((base - moved).abs().max()) > 1e-3
    # non-patch positions (-1) get no patch embedding: the default is "no patches, all text"
    with torch.no_grad():
        plain = model(a["input_ids"]).logits
        explicit = model(a["input_ids"], torch.zeros_like(a["input_ids"]), torch.full((3, T, 2), -1)).logits
    torch.testing.assert_close(plain, explicit)


def test_encoder_uses_the_decoders_layers_and_init():
    model = encoder()
    assert all(isinstance(b.ffn, MHMoELayer) for b in model.blocks)
    assert model.lm_head.weight is model.embed.weight  # tied
    assert abs(float(model.embed.weight.detach().std()) - 0.02) < 0.003
    assert model.num_params() - model.num_params(exclude_embeddings=True) == V * 48


def test_encoder_learns_a_fixed_masked_batch():
    """AdamW on one masked batch: the masked cross-entropy falls from ~log(V) to well below it."""
    model = encoder(MHMOE).train()
    opt = build_optimizer(model, TrainConfig(lr=3e-3, weight_decay=0.0))
    a = inputs(4)
    loss_mask = torch.rand(4, T, generator=torch.Generator().manual_seed(2)) < 0.4
    masked = {**a, "input_ids": a["input_ids"].masked_fill(loss_mask, V - 1)}
    first = last = None
    for _ in range(150):
        out = model(**masked, targets=a["input_ids"], loss_mask=loss_mask)
        out.total_loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        last = float(out.loss.detach())
        first = last if first is None else first
    assert first > 3.0 and last < 0.5, (first, last)


def test_build_model_and_arch_checks():
    enc_cfg = ModelConfig(arch="encoder", vocab_size=V, d_model=48, n_layers=1, n_heads=4, d_ff=64, max_seq_len=32)
    dec_cfg = ModelConfig(**{**enc_cfg.to_dict(), "arch": "decoder"})
    assert isinstance(build_model(enc_cfg), Encoder) and isinstance(build_model(dec_cfg), LM)
    with pytest.raises(ConfigError, match="model.arch"):
        LM(enc_cfg)
    with pytest.raises(ConfigError, match="model.arch"):
        Encoder(dec_cfg)
    with pytest.raises(ConfigError, match="arch"):
        ModelConfig(arch="seq2seq")
    with pytest.raises(ValueError, match="max_seq_len"):
        build_model(enc_cfg)(torch.zeros(1, 33, dtype=torch.long))
