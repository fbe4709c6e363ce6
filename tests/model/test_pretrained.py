"""``LM.save_pretrained`` / ``LM.from_pretrained``: round trips, the directories it reads (saved, export --hf,
checkpoint, run), both formats, what it refuses (overwrites, damaged or foreign files, symlinks out), and that a
failed save leaves nothing behind."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from mhmoe.checkpoint.layout import SAVED_CONFIG_FILE as CONFIG_FILE
from mhmoe.checkpoint.layout import WEIGHTS_FILE
from mhmoe.checkpoint.write import save_checkpoint
from mhmoe.config.model import ModelConfig
from mhmoe.config.moe import MoEConfig
from mhmoe.config.run import RunConfig
from mhmoe.config.train import TrainConfig
from mhmoe.data import ByteTokenizer
from mhmoe.errors import CheckpointError
from mhmoe.model.lm import LM
from mhmoe.train.convert import safetensors_to_dcp

MOE = MoEConfig(n_experts=4, top_k=2, d_expert=16, heads=2, head_layer=True, merge_layer=True)
CFG = ModelConfig(vocab_size=257, d_model=32, n_layers=2, n_heads=4, d_ff=32, max_seq_len=32, moe=MOE)
RUN = RunConfig(model=CFG, train=TrainConfig(seq_len=32))
IDS = torch.randint(0, 257, (2, 12), generator=torch.Generator().manual_seed(0))


def _logits(model: LM) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(IDS).logits


def _checkpointed_run(root: Path, steps: tuple[int, ...] = (1, 2)) -> tuple[Path, list[LM]]:
    """A run directory with one checkpoint per step (different weights each)."""
    models = []
    for step in steps:
        torch.manual_seed(step)
        model = LM(CFG)
        save_checkpoint(root, step, model, RUN, ByteTokenizer(), {"step": step}, keep_last=5)
        models.append(model)
    return root, models


@pytest.mark.parametrize("moe", [MOE, MoEConfig(kind="dense", d_expert=32), MoEConfig(n_experts=4, top_k=1,
                                                                                       d_expert=16)])
def test_round_trip_is_exact(tmp_path, moe):
    model = LM(ModelConfig(**{**CFG.to_dict(), "moe": moe}))
    out = model.save_pretrained(tmp_path / "saved")
    assert sorted(p.name for p in out.iterdir()) == [CONFIG_FILE, WEIGHTS_FILE]
    loaded = LM.from_pretrained(out)
    assert loaded.cfg == model.cfg and not loaded.training
    assert torch.equal(_logits(loaded), _logits(model))


def test_config_json_is_a_transformers_config(tmp_path):
    LM(CFG).save_pretrained(tmp_path / "saved", tokenizer=ByteTokenizer())
    meta = json.loads((tmp_path / "saved" / CONFIG_FILE).read_text())
    assert meta["model_type"] == "mhmoe" and meta["architectures"] == ["MHMoEForCausalLM"]
    assert meta["vocab_size"] == 257 and meta["hidden_size"] == 32 and meta["eos_token_id"] == 256
    assert ModelConfig.from_dict(meta["mhmoe"]) == CFG
    assert (tmp_path / "saved" / "tokenizer").is_dir()


def test_loads_in_transformers_and_from_an_hf_export(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    import mhmoe.integrations.hf  # noqa: F401 -- registers model_type "mhmoe"

    model = LM(CFG)
    model.save_pretrained(tmp_path / "saved")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    with torch.no_grad():
        assert torch.equal(hf(IDS).logits, _logits(model))
    hf.save_pretrained(tmp_path / "hf")  # transformers' own writer: our loader reads it back
    assert torch.equal(_logits(LM.from_pretrained(tmp_path / "hf")), _logits(model))


def test_reads_checkpoint_and_run_directories(tmp_path):
    run, models = _checkpointed_run(tmp_path / "run")
    assert torch.equal(_logits(LM.from_pretrained(run)), _logits(models[-1]))  # newest checkpoint
    first = run / "checkpoints" / "step_00000001"
    assert torch.equal(_logits(LM.from_pretrained(first)), _logits(models[0]))


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, capsys):
    run, models = _checkpointed_run(tmp_path / "run")
    weights = run / "checkpoints" / "step_00000002" / WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)  # same size, different bytes
    assert torch.equal(_logits(LM.from_pretrained(run)), _logits(models[0]))
    assert "sha256 mismatch" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match="sha256"):
        LM.from_pretrained(run / "checkpoints" / "step_00000002")  # asked for that one: no fallback


def test_dcp_checkpoints_load_as_their_single_file_source(tmp_path):
    run, _ = _checkpointed_run(tmp_path / "run", (1,))
    dcp = safetensors_to_dcp(run / "checkpoints" / "step_00000001", tmp_path / "dcp")
    a, b = LM.from_pretrained(run), LM.from_pretrained(dcp)
    assert a.state_dict().keys() == b.state_dict().keys()
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())
    assert not (dcp / WEIGHTS_FILE).exists()  # read from the shards


def test_never_overwrites_unless_asked(tmp_path):
    a, b = LM(CFG), LM(CFG)
    out = tmp_path / "saved"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="refusing to overwrite"):
        a.save_pretrained(out)
    assert (out / "notes.txt").read_text() == "mine"
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError):
        a.save_pretrained(tmp_path / "file", overwrite=True)  # never replaces a file with a directory
    a.save_pretrained(out, overwrite=True)
    assert not (out / "notes.txt").exists() and torch.equal(_logits(LM.from_pretrained(out)), _logits(a))
    b.save_pretrained(tmp_path / "empty-dir-is-fine")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary leftovers


def test_a_failed_save_leaves_the_old_directory_and_no_temporary(tmp_path, monkeypatch):
    model = LM(CFG)
    out = model.save_pretrained(tmp_path / "saved")
    before = (out / WEIGHTS_FILE).read_bytes()

    class Broken:
        eos_id = 0

        def save(self, directory):
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        LM(CFG).save_pretrained(out, tokenizer=Broken(), overwrite=True)
    assert (out / WEIGHTS_FILE).read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["saved"]


@pytest.mark.parametrize("damage", ["no-mhmoe-section", "bad-json", "bad-config", "missing-weights", "wrong-shape",
                                    "garbage-weights"])
def test_unloadable_directories_are_one_line_errors(tmp_path, damage):
    out = LM(CFG).save_pretrained(tmp_path / "saved")
    cfg_path, weights = out / CONFIG_FILE, out / WEIGHTS_FILE
    meta = json.loads(cfg_path.read_text())
    if damage == "no-mhmoe-section":
        cfg_path.write_text(json.dumps({"model_type": "llama"}))
    elif damage == "bad-json":
        cfg_path.write_text("{")
    elif damage == "bad-config":
        cfg_path.write_text(json.dumps({**meta, "mhmoe": {**meta["mhmoe"], "n_heads": 5}}))
    elif damage == "missing-weights":
        weights.unlink()
    elif damage == "wrong-shape":
        LM(ModelConfig(**{**CFG.to_dict(), "d_ff": 48})).save_pretrained(tmp_path / "other")
        shutil.copy(tmp_path / "other" / WEIGHTS_FILE, weights)
    else:
        weights.write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError) as info:
        LM.from_pretrained(out)
    assert "\n" not in str(info.value) and str(out) in str(info.value)


def test_symlinks_out_of_the_directory_are_refused(tmp_path):
    outside = LM(CFG).save_pretrained(tmp_path / "outside")
    out = tmp_path / "saved"
    out.mkdir()
    (out / CONFIG_FILE).write_text((outside / CONFIG_FILE).read_text())
    os.symlink(outside / WEIGHTS_FILE, out / WEIGHTS_FILE)
    with pytest.raises(CheckpointError, match="symlink"):
        LM.from_pretrained(out)


def test_missing_path_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="no such"):
        LM.from_pretrained(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no checkpoints"):
        LM.from_pretrained(tmp_path / "empty")
