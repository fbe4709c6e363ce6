"""Saving checkpoints (mhmoe.checkpoint.write): the layout, keep_last pruning, atomic writes (a failed
write leaves nothing, a stale temporary directory is ignored), replacing a step, and never saving a
non-finite model."""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers import MHMOE

from mhmoe.checkpoint.format import list_checkpoints, verify_checkpoint
from mhmoe.checkpoint.write import save_checkpoint
from mhmoe.config.data import DataConfig
from mhmoe.config.model import ModelConfig
from mhmoe.config.run import RunConfig
from mhmoe.config.train import TrainConfig
from mhmoe.data import ByteTokenizer
from mhmoe.errors import CheckpointError
from mhmoe.loading.checkpoint import load_latest
from mhmoe.model.lm import LM

MODEL = ModelConfig(vocab_size=257, d_model=48, n_layers=2, n_heads=4, d_ff=64, max_seq_len=64, moe=MHMOE)


def _small_run() -> RunConfig:
    return RunConfig(model=MODEL, train=TrainConfig(seq_len=32), data=DataConfig(tokenizer="byte", val_sets=()))


def test_layout_and_keep_last(trained):
    ckpts = list_checkpoints(trained)
    assert [c.name for c in ckpts] == ["step_00000004", "step_00000006"]
    assert not list((trained / "checkpoints").glob(".tmp-*"))
    c = ckpts[-1]
    assert {p.name for p in c.iterdir()} == {"model.safetensors", "config.yaml", "trainer_state.pt", "tokenizer",
                                             "meta.json"}  # the format: the names never change
    meta = verify_checkpoint(c)
    assert meta["step"] == 6 and "model.safetensors" in meta["files"]
    assert any(name.startswith("tokenizer/") for name in meta["files"])


def test_keep_last_one(tmp_path):
    model, run, tok = LM(MODEL), _small_run(), ByteTokenizer()
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, model, run, tok, {"step": step}, keep_last=1)
    assert [c.name for c in list_checkpoints(tmp_path)] == ["step_00000003"]


def test_failed_write_leaves_no_partial_checkpoint(trained, tmp_path, monkeypatch):
    run_dir = tmp_path / "r"
    shutil.copytree(trained, run_dir)
    ck = load_latest(run_dir)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space"):
        save_checkpoint(run_dir, 8, ck.model, ck.run, ck.tokenizer, ck.trainer_state, keep_last=2)
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == ["step_00000004", "step_00000006"]  # no step 8, no .tmp-*, nothing pruned
    assert load_latest(run_dir).step == 6


def test_stale_temporary_directory_is_ignored(run_dir):
    stale = run_dir / "checkpoints" / ".tmp-step_00000008-99999"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half a file")
    assert [c.name for c in list_checkpoints(run_dir)] == ["step_00000004", "step_00000006"]
    assert load_latest(run_dir).step == 6


def test_resave_same_step_replaces_it(tmp_path):
    model, run, tok = LM(MODEL), _small_run(), ByteTokenizer()
    save_checkpoint(tmp_path, 5, model, run, tok, {"step": 5})
    with torch.no_grad():
        model.embed.weight.add_(1.0)
    save_checkpoint(tmp_path, 5, model, run, tok, {"step": 5})
    assert len(list_checkpoints(tmp_path)) == 1
    assert torch.equal(load_latest(tmp_path).model.embed.weight, model.embed.weight)


# ---- non-finite models are never saved ------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_model_is_never_saved(tmp_path, bad):
    model, run, tok = LM(MODEL), _small_run(), ByteTokenizer()
    save_checkpoint(tmp_path, 1, model, run, tok, {"step": 1})
    with torch.no_grad():
        next(iter(model.blocks[1].ffn.parameters())).view(-1)[3] = bad
    with pytest.raises(CheckpointError, match="non-finite"):
        save_checkpoint(tmp_path, 2, model, run, tok, {"step": 2})
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_00000001"]
    assert load_latest(tmp_path).step == 1
