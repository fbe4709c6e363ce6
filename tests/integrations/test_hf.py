"""transformers integration: save/load round-trip, Auto* registration, generate() vs our sampler,
padded batches, tokenizer export and `mhmoe export --hf` (skipped without the ``hf`` extra)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from ecosystem_helpers import KINDS, tiny_checkpoint, trained_lm  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from mhmoe.cli import main  # noqa: E402
from mhmoe.data import ByteTokenizer, Tokenizer, get_pretrained_tokenizer, train_bpe  # noqa: E402
from mhmoe.errors import DataError  # noqa: E402
from mhmoe.integrations.hf import MHMoEConfig, MHMoEForCausalLM, MHMoESamplingFilter, to_hf_tokenizer  # noqa: E402
from mhmoe.model.generate import generate  # noqa: E402
from mhmoe.model.lm import KVCache  # noqa: E402

EOS = 256


def _ids(b: int = 2, t: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 257, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", KINDS)
def test_save_pretrained_round_trip_gives_identical_logits(kind, tmp_path):
    lm = trained_lm(kind)
    model = MHMoEForCausalLM.from_lm(lm, eos_token_id=EOS)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "mhmoe"
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:  # tied embeddings stored once
        keys = set(f.keys())
    assert "model.embed.weight" in keys and "model.lm_head.weight" not in keys
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is MHMoEForCausalLM and not loaded.training
    assert loaded.model.lm_head.weight is loaded.model.embed.weight
    assert loaded.config.model_config() == lm.cfg
    x = _ids()
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, lm(x).logits)
        assert torch.equal(model(x).logits, lm(x).logits)


def test_untied_embeddings_round_trip(tmp_path):
    lm = trained_lm("smoe", tie_embeddings=False)
    MHMoEForCausalLM.from_lm(lm).save_pretrained(tmp_path)
    loaded = MHMoEForCausalLM.from_pretrained(tmp_path)
    assert loaded.model.lm_head.weight is not loaded.model.embed.weight
    assert torch.equal(loaded.model.lm_head.weight, lm.lm_head.weight)
    with torch.no_grad():
        assert torch.equal(loaded(_ids()).logits, lm(_ids()).logits)


def test_auto_classes_are_registered():
    cfg = AutoConfig.for_model("mhmoe", mhmoe=trained_lm("dense", steps=0).cfg.to_dict(), eos_token_id=EOS)
    assert isinstance(cfg, MHMoEConfig) and cfg.vocab_size == 257 and cfg.tie_word_embeddings
    assert cfg.pad_token_id == cfg.bos_token_id == EOS
    assert type(AutoModelForCausalLM.from_config(cfg)) is MHMoEForCausalLM


def test_bad_nested_config_is_a_one_line_config_error():
    bad = trained_lm("dense", steps=0).cfg.to_dict()
    bad["n_heads"] = 5
    with pytest.raises(ValueError, match="n_heads"):
        MHMoEConfig(mhmoe=bad)


def test_labels_loss_is_shifted_cross_entropy_plus_aux():
    lm = trained_lm("mhmoe")
    model = MHMoEForCausalLM.from_lm(lm)
    x = _ids(2, 10)
    with torch.no_grad():
        out = model(x, labels=x)
        ref = lm(x[:, :-1], x[:, 1:])
    assert out.aux_loss is not None and float(out.aux_loss) > 0
    torch.testing.assert_close(out.loss, ref.total_loss, rtol=1e-5, atol=1e-6)


def test_cache_decoding_matches_full_forward():
    model = MHMoEForCausalLM.from_lm(trained_lm("mhmoe"))
    x = _ids(2, 10)
    with torch.no_grad():
        full = model(x, use_cache=False).logits
        first = model(x[:, :6], use_cache=True)
        cache = first.past_key_values
        rest = [model(x[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(6, 10)]
    torch.testing.assert_close(torch.cat([first.logits, *rest], 1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["mhmoe", "bitnet"])
def test_greedy_generate_matches_our_generator(kind):
    lm = trained_lm(kind)
    model = MHMoEForCausalLM.from_lm(lm, eos_token_id=EOS)
    prompt = _ids(2, 5)
    ours = generate(lm, prompt, 12, temperature=0)
    theirs = model.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert torch.equal(theirs, ours)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 20, 1.0), (1.3, 0, 0.9), (0.7, 40, 0.8)])
def test_sampling_generate_matches_our_generator_for_the_same_seed(temperature, top_k, top_p):
    """transformers draws with the global generator, ours with an explicit one: seeding both with
    the same seed gives the same multinomial draws on the same probabilities. top-p runs our whole
    step through MHMoESamplingFilter (transformers' TopPLogitsWarper cuts at ties differently)."""
    lm = trained_lm("mhmoe")
    model = MHMoEForCausalLM.from_lm(lm, eos_token_id=EOS)
    prompt = _ids(2, 4)
    for seed in (0, 7):
        ours = generate(lm, prompt, 16, temperature, top_k, top_p, generator=torch.Generator().manual_seed(seed))
        torch.manual_seed(seed)
        if top_p < 1.0:
            ours_step = MHMoESamplingFilter(temperature, top_k, top_p)
            theirs = model.generate(prompt, max_new_tokens=16, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                    logits_processor=[ours_step], eos_token_id=None)
        else:
            theirs = model.generate(prompt, max_new_tokens=16, do_sample=True, temperature=temperature, top_k=top_k,
                                    top_p=1.0, eos_token_id=None)
        assert torch.equal(theirs, ours), seed
    # transformers' own top-p warper agrees with ours away from exact probability ties
    torch.manual_seed(3)
    theirs = model.generate(prompt, max_new_tokens=16, do_sample=True, temperature=1.3, top_k=0, top_p=0.9,
                            eos_token_id=None)
    assert torch.equal(theirs, generate(lm, prompt, 16, 1.3, 0, 0.9, generator=torch.Generator().manual_seed(3)))


def test_left_padded_batch_generates_like_single_rows():
    lm = trained_lm("mhmoe")
    model = MHMoEForCausalLM.from_lm(lm, eos_token_id=EOS)
    long, short = _ids(1, 7, seed=2)[0], _ids(1, 4, seed=3)[0]
    batch = torch.stack([long, torch.cat([torch.full((3,), EOS), short])])
    mask = torch.tensor([[1] * 7, [0, 0, 0, 1, 1, 1, 1]])
    out = model.generate(batch, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert torch.equal(out[0], generate(lm, long[None], 8, temperature=0)[0])
    assert torch.equal(out[1, 3:], generate(lm, short[None], 8, temperature=0)[0])
    with torch.no_grad():  # the padded row's logits equal the unpadded row's
        torch.testing.assert_close(model(batch, attention_mask=mask).logits[1, 3:], lm(short[None]).logits[0],
                                   rtol=1e-4, atol=1e-5)


def test_our_kv_cache_still_works_directly():
    lm = trained_lm("smoe")
    x = _ids(1, 6)
    cache = KVCache(lm.cfg.n_layers)
    with torch.no_grad():
        a = lm(x[:, :4], cache=cache).logits
        b = lm(x[:, 4:], cache=cache).logits
        torch.testing.assert_close(torch.cat([a, b], 1), lm(x).logits, rtol=1e-5, atol=1e-5)
    assert cache.length == 6 and cache.layer_length(1) == 6


TEXTS = ["In the beginning God created the heaven and the earth.", "naïve café 日本 🙂\n\n  x  y\t", "don't 123456"]


@pytest.mark.parametrize("which", ["byte", "bpe", "gpt2", "cl100k_base"])
def test_tokenizer_export_keeps_ids(which, tmp_path):
    if which == "bpe":
        tok: Tokenizer = train_bpe([" ".join(TEXTS) * 20, "the earth and the heaven"], 300)
    elif which == "byte":
        tok = ByteTokenizer()
    else:
        try:
            tok = get_pretrained_tokenizer(which)
        except DataError as exc:
            pytest.skip(str(exc))
    to_hf_tokenizer(tok, model_max_length=64).save_pretrained(tmp_path)
    fast = AutoTokenizer.from_pretrained(tmp_path)
    assert fast.eos_token_id == fast.pad_token_id == tok.eos_id and fast.model_max_length == 64
    for text in TEXTS:
        ids = fast(text, add_special_tokens=False)["input_ids"]
        assert ids == tok.encode(text) and fast.decode(ids) == tok.decode(ids)


def test_export_hf_cli_converts_a_checkpoint(tmp_path, capsys):
    ck = tiny_checkpoint(tmp_path / "run", "mhmoe")
    out = tmp_path / "hf"
    assert main(["export", "--hf", str(tmp_path / "run"), str(out), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["max_abs_logit_diff"] == 0.0 and rep["step"] == 3
    assert {"config.json", "model.safetensors", "tokenizer.json", "mhmoe_tokenizer/tokenizer_meta.json"} <= set(
        rep["files"])
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    from mhmoe.train.checkpoint import load_checkpoint

    lm = load_checkpoint(ck).model.eval()
    x = torch.tensor([tok("In the beginning")["input_ids"]])
    assert x[0].tolist() == list(b"In the beginning")
    with torch.no_grad():
        assert torch.equal(model(x).logits, lm(x).logits)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp")] == []


def test_export_hf_refuses_a_non_empty_out_and_bad_checkpoints(tmp_path, capsys):
    tiny_checkpoint(tmp_path / "run", "dense")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["export", "--hf", str(tmp_path / "run"), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "refusing to overwrite" in err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert main(["export", "--hf", str(tmp_path / "nope"), str(tmp_path / "o2")]) == 2
    assert capsys.readouterr().err.count("\n") == 1 and not (tmp_path / "o2").exists()
    with pytest.raises(SystemExit) as exc:  # argparse: one format only
        main(["export", "--hf", "--bitnet", str(tmp_path / "run"), str(tmp_path / "o3")])
    assert exc.value.code == 2 and capsys.readouterr().err.count("\n") == 1
    empty = tmp_path / "empty"
    empty.mkdir()  # an existing empty directory is fine
    assert main(["export", "--hf", str(tmp_path / "run"), str(empty)]) == 0
