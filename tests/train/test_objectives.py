"""Training tasks (mhmoe.train.objectives): the masked multi-modal task trains the encoder through the same
trainer, checkpoints and resumes bit-exactly, evaluates a fixed masked set per modality, and the CLI's
train / eval / generate handle an encoder run; config pairs that cannot work are refused in one line.

Runs: tests/mm_helpers.py (scikit-learn's digits and a generated text corpus)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import MHMOE, SMOE, losses, records
from mm_helpers import DIGITS_SEQ, XMOE_MH, mm_run

from mhmoe.checkpoint.format import list_checkpoints
from mhmoe.config.model import ModelConfig
from mhmoe.config.run import RunConfig
from mhmoe.errors import ConfigError
from mhmoe.loading.checkpoint import load_latest
from mhmoe.model import Encoder
from mhmoe.train.loop import train
from mhmoe.train.objectives import LMObjective, MaskedMultimodalObjective, build_objective, evaluate_checkpoint


def test_masked_mm_run_trains_the_encoder(tmp_path):
    run = mm_run(tmp_path, max_steps=8, ckpt_every=4)
    res = train(run, tmp_path / "r", progress=False)
    d = tmp_path / "r"
    recs = records(d)
    assert [r["step"] for r in recs] == list(range(1, 9))
    assert all(math.isfinite(r["loss"]) and r["tokens"] == r["step"] * 6 * DIGITS_SEQ for r in recs)
    assert recs[-1]["loss"] < recs[0]["loss"]
    assert set(res.eval) == {"masked", "masked_image", "masked_text"}
    ev = res.eval
    assert ev["masked"]["tokens"] == ev["masked_image"]["tokens"] + ev["masked_text"]["tokens"]
    # the token-weighted mean over both modalities
    want = (ev["masked_image"]["loss"] * ev["masked_image"]["tokens"] + ev["masked_text"]["loss"]
            * ev["masked_text"]["tokens"]) / ev["masked"]["tokens"]
    assert ev["masked"]["loss"] == pytest.approx(want)
    cfg = RunConfig.load(d / "config.yaml")
    assert cfg.model.arch == "encoder" and cfg.model.vocab_size == 257 + 64 + 4  # bytes, codes, specials
    ck = load_latest(d)
    assert isinstance(ck.model, Encoder) and ck.step == 8
    assert json.loads((d / "results.json").read_text())["eval"] == res.eval


def test_masked_mm_evaluation_is_fixed_and_covers_every_example(tmp_path):
    """Two evaluations of one model agree exactly (fixed masks), and without a cap every validation
    example's masked positions count: the image, pair and text rows of the val split."""
    run = mm_run(tmp_path)
    task = build_objective(run)
    assert isinstance(task, MaskedMultimodalObjective)
    model = Encoder(ModelConfig(**{**run.model.to_dict(), "vocab_size": task.vocab_size}))
    a = task.evaluate(model, max_batches=None, device="cpu", dtype="float32")
    b = task.evaluate(model, max_batches=None, device="cpu", dtype="float32")
    assert a == b
    want = sum(int(x.loss_mask.sum()) for x in task.data.iter_val_batches(6))
    assert a["masked"]["tokens"] == want
    n_text = sum(int((x.loss_mask & (x.modality == 0)).sum()) for x in task.data.iter_val_batches(6))
    assert a["masked_text"]["tokens"] == n_text > 0
    first = task.val_batches(1)[0]  # a capped evaluation still sees every kind of example
    assert sorted(first.kind.tolist()) == [0, 0, 1, 1, 2, 2]
    # an untrained model is near-uniform over the joint vocabulary
    assert abs(a["masked"]["loss"] - math.log(task.vocab_size)) < 0.5


def test_masked_mm_micro_batches_are_the_data_modules(tmp_path):
    run = mm_run(tmp_path)
    task = build_objective(run)
    b = task.micro_batch(3, 1, torch.device("cpu"))
    want = task.data.get_batch(3, 1, batch_size=6)
    assert torch.equal(b.input_ids, want.input_ids) and torch.equal(b.loss_mask, want.loss_mask)
    assert not torch.equal(b.input_ids, task.micro_batch(4, 1, torch.device("cpu")).input_ids)


@pytest.mark.parametrize("moe, extra", [(XMOE_MH, {}), (SMOE, dict(grad_accum=2, eval_every=2))],
                         ids=["mhmoe", "smoe-accum-eval"])
def test_encoder_run_resumes_bit_exactly(tmp_path, moe, extra):
    """Stopped at step 3 (checkpoint) and resumed: the same losses, evaluations and weights, bit for bit."""
    run = mm_run(tmp_path, moe, **extra)
    full, split = tmp_path / "full", tmp_path / "split"
    res_full = train(run, full, progress=False)
    train(run, split, progress=False, stop_after=3)
    assert list_checkpoints(split)[-1].name == "step_00000003"
    res_split = train(run, split, resume=True, progress=False)
    assert losses(full) == losses(split)  # exact
    assert records(full, "eval.jsonl") == records(split, "eval.jsonl")
    assert res_full.eval == res_split.eval
    wa, wb = load_latest(full).model.state_dict(), load_latest(split).model.state_dict()
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_evaluate_checkpoint_runs_the_checkpoints_own_task(tmp_path):
    run = mm_run(tmp_path, max_steps=2)
    res = train(run, tmp_path / "r", progress=False)
    again = evaluate_checkpoint(load_latest(tmp_path / "r"), run.train.eval_batches, "cpu")
    assert again == res.eval


def test_lm_task_is_the_samplers_batches(tmp_path):
    from helpers import tiny_run

    run = tiny_run(tmp_path, MHMOE)
    task = build_objective(run)
    assert isinstance(task, LMObjective) and task.vocab_size == 257
    x, y = task.micro_batch(2, 0, torch.device("cpu"))
    wx, wy = task.sampler.get_batch(2, 0)
    assert torch.equal(x, wx) and torch.equal(y, wy)


def test_config_refuses_task_and_model_that_do_not_fit(tmp_path):
    run = mm_run(tmp_path)
    with pytest.raises(ConfigError, match="model.arch"):
        run.with_overrides(["model.arch=decoder"])
    with pytest.raises(ConfigError, match="model.arch"):
        RunConfig(model=ModelConfig(arch="encoder"))  # an LM task with the encoder
    with pytest.raises(ConfigError, match="data.val_sets"):
        run.with_overrides(["data.val_sets=[kjv]"])
    with pytest.raises(ConfigError, match="data.task"):
        run.with_overrides(["data.task=mlm"])
    with pytest.raises(ConfigError, match="data.image_set"):
        run.with_overrides(["data.image_set=cifar"])
    with pytest.raises(ConfigError, match="data.codebook_size"):
        run.with_overrides(["data.codebook_size=1"])
    with pytest.raises(ConfigError, match="data.text_len"):
        run.with_overrides(["data.text_len=0"])
    with pytest.raises(ConfigError, match=rf"train.seq_len=30: allowed {DIGITS_SEQ}"):
        build_objective(run.with_overrides(["train.seq_len=30"]))


def test_cli_train_eval_generate_export_on_an_encoder_run(tmp_path, capsys):
    from mhmoe.cli import main

    cfg = tmp_path / "mm.yaml"
    cfg.write_text(mm_run(tmp_path, max_steps=2).to_yaml())
    assert main(["train", "--config", str(cfg), "--out", str(tmp_path / "r"), "--no-progress"]) == 0
    assert "masked ppl" in capsys.readouterr().out
    assert main(["eval", "--checkpoint", str(tmp_path / "r"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["eval"]) == {"masked", "masked_image", "masked_text"}
    assert main(["generate", "--checkpoint", str(tmp_path / "r"), "--prompt", "in the"]) == 2
    assert "encoder" in capsys.readouterr().err
    for argv in (["export", "--hf", str(tmp_path / "r"), str(tmp_path / "hf")],
                 ["export", "--bitnet", str(tmp_path / "r"), str(tmp_path / "bitnet")]):
        assert main(argv) == 2  # causal-LM formats refuse an encoder in one line
        assert "decoder" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists() and not (tmp_path / "bitnet").exists()


def test_cli_compare_runs_masked_multimodal_presets(tmp_path, capsys):
    """`mhmoe compare` on two tiny-icml-mm presets (shrunk with --set onto the digits data): one table with
    the masked perplexity columns."""
    from mhmoe.cli import main

    run = mm_run(tmp_path)  # writes the text corpus
    sets = ["model.d_model=48", "model.n_heads=4", "model.d_ff=64", "model.n_layers=2", "model.max_seq_len=32",
            "model.moe.d_expert=32", "model.moe.n_experts=4", "train.batch_size=6", f"train.seq_len={DIGITS_SEQ}",
            "train.eval_batches=2", "train.threads=1", "train.device=cpu", "data.image_set=digits", "data.text_len=8",
            f"data.cache_dir={tmp_path / 'cache'}", "data.val_tokens=512"]
    argv = ["compare", "--presets", "tiny-icml-mm-xmoe-8", "tiny-icml-mm-mh4-8", "--out", str(tmp_path / "c"),
            "--max-steps", "2", "--data", run.data.corpus, "--no-progress"]
    assert main(argv + [a for s in sets for a in ("--set", s)]) == 0
    out = capsys.readouterr().out
    assert "ppl masked_image" in out and "tiny-icml-mm-mh4-8" in out and "tiny-icml-mm-xmoe-8" in out


def test_lm_harness_refuses_an_encoder():
    pytest.importorskip("lm_eval")
    from mhmoe.data.tokenizer import ByteTokenizer
    from mhmoe.integrations.lmeval import MHMoEHarnessLM

    enc = Encoder(ModelConfig(arch="encoder", vocab_size=300, d_model=48, n_layers=1, n_heads=4, d_ff=64,
                              max_seq_len=32))
    with pytest.raises(ValueError, match="model.arch=encoder"):
        MHMoEHarnessLM(model=enc, tokenizer=ByteTokenizer())
