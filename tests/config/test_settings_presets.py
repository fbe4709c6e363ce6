"""Presets of ICML Table 1's multilingual (`*-icml-ml-*`) and masked multi-modal (`*-icml-mm-*`) settings:
the same Dense / X-MoE / MH-MoE models as the English setting, on the data and task of each setting, with
constants that agree with the data layer they cannot import."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mhmoe.config.data import IMAGE_SETS
from mhmoe.config.presets import MANPAGES_VAL_SETS, MM_SEQ_LEN, MM_VOCAB, get_preset, preset_names
from mhmoe.data import images, manpages

SETTINGS = [f"{s}-icml-{t}-{k}" for s in ("tiny", "paper") for t in ("ml", "mm")
            for k in ("dense", "xmoe-8", "mh4-8", "xmoe-32", "mh4-32")]


def test_every_setting_preset_exists_with_short_paper_names():
    names = set(preset_names())
    assert set(SETTINGS) <= names
    for name in SETTINGS:
        if name.startswith("paper-"):
            assert get_preset(name.removeprefix("paper-")) == get_preset(name)


@pytest.mark.parametrize("kind", ["dense", "xmoe-8", "mh4-8", "xmoe-32", "mh4-32"])
@pytest.mark.parametrize("scale", ["tiny", "paper"])
def test_settings_share_the_english_models(scale, kind):
    english = get_preset(f"{scale}-dense" if kind == "dense" else f"{scale}-icml-{kind}")
    for setting in ("ml", "mm"):
        run = get_preset(f"{scale}-icml-{setting}-{kind}")
        moe = run.model.moe
        if moe.kind == "moe":  # renormalised top-2 weights (X-MoE), routing dimension 16 / 16/h (ICML Table 9)
            assert moe.renormalize is True and moe.router_dim == (4 if moe.heads == 4 else 16)
            moe = replace(moe, renormalize=english.model.moe.renormalize, router_dim=english.model.moe.router_dim)
        assert moe == english.model.moe
        assert (run.model.d_model, run.model.n_layers, run.model.n_heads, run.model.d_ff) == (
            english.model.d_model, english.model.n_layers, english.model.n_heads, english.model.d_ff)


def test_multilingual_presets_validate_every_language():
    assert MANPAGES_VAL_SETS == manpages.MANPAGES_VAL_SETS
    for scale, tok in (("tiny", "bpe"), ("paper", "cl100k_base")):
        run = get_preset(f"{scale}-icml-ml-mh4-8")
        assert run.data.corpus == "manpages" and run.data.val_sets == MANPAGES_VAL_SETS
        assert run.data.tokenizer == tok and run.model.arch == "decoder" and run.data.task == "lm"
    assert get_preset("tiny-icml-ml-mh4-8").model.vocab_size == get_preset("tiny-icml-ml-mh4-8").data.vocab_size


def test_masked_multimodal_presets_fit_the_data():
    assert set(IMAGE_SETS) == set(images.IMAGE_SETS)
    grid = images.EMOJI_SIZE // images.EMOJI_PATCH
    run = get_preset("tiny-icml-mm-mh4-8")
    assert run.model.arch == "encoder" and run.data.task == "masked_mm" and run.data.image_set == "emoji"
    assert MM_SEQ_LEN == run.train.seq_len == grid * grid + run.data.text_len + 3
    assert MM_VOCAB == run.model.vocab_size == 257 + images.DEFAULT_CODEBOOK_SIZE["emoji"] + 4
    assert run.train.seq_len <= run.model.max_seq_len
    paper = get_preset("icml-mm-mh4-8")  # ICML Table 10's multi-modal optimisation
    assert (paper.train.lr, paper.train.schedule, paper.train.weight_decay) == (2.8e-3, "cosine", 0.05)
    assert paper.train.batch_size * paper.train.grad_accum == 512
