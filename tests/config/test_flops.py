"""Analytic model FLOPs (mhmoe.config.flops) against PyTorch's FLOP counter on the built models."""

from dataclasses import replace

import pytest
import torch

from mhmoe.config import get_preset
from mhmoe.config.flops import model_flops_per_token, moe_layer_flops
from mhmoe.model.lm import LM
from mhmoe.train.evaluate import forward_flops_per_token

NAMES = ["tiny-dense", "tiny-smoe", "tiny-fgmoe", "tiny-mh2", "tiny-mh3", "tiny-mh3-shared", "tiny-icml-xmoe-8",
         "tiny-icml-mh4-8", "tiny-mh3-bitnet"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("impl", ["loop", "auto"])
def test_analytic_flops_equal_measured(name, impl):
    seq = 32
    run = get_preset(name).with_overrides([f"model.max_seq_len={seq}", f"train.seq_len={seq}",
                                           "model.vocab_size=300", f"model.moe.impl={impl}"])
    torch.manual_seed(0)
    measured = forward_flops_per_token(LM(run.model), seq)
    analytic = model_flops_per_token(run.model, seq)
    # PyTorch's CPU attention kernel is not counted by FlopCounterMode: compare without the scores
    assert analytic.total - analytic.scores == pytest.approx(measured, rel=1e-9), (name, analytic.to_dict(), measured)
    assert analytic.scores == run.model.n_layers * 4 * seq * run.model.d_model


def test_expert_choice_charges_its_capacity():
    # expert choice is a layer-level router (the decoder LM refuses it: not causal)
    base = get_preset("tiny-smoe").model.moe
    ec = replace(base, router="expert_choice", capacity_factor=2.0)
    d = get_preset("tiny-smoe").model.d_model
    assert moe_layer_flops(ec, d)["experts"] == 2 * moe_layer_flops(base, d)["experts"]
    assert moe_layer_flops(ec, d)["router"] == moe_layer_flops(base, d)["router"]
