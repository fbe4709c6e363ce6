"""Analytic model FLOPs (mhmoe.config.flops) against PyTorch's FLOP counter on the built models."""

import pytest
import torch

from mhmoe.config import get_preset
from mhmoe.config.flops import model_flops_per_token
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
    run = get_preset("tiny-smoe").with_overrides(["model.moe.router=expert_choice", "model.moe.capacity_factor=2.0"])
    base = get_preset("tiny-smoe")
    ec, tc = model_flops_per_token(run.model, 64), model_flops_per_token(base.model, 64)
    assert ec.moe > tc.moe and ec.attention == tc.attention
