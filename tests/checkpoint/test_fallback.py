"""Reading checkpoints back: everything a run saved is restored; verification (flipped bytes, truncation,
missing files, damaged meta.json, foreign content with matching hashes, the format version); a damaged
newest checkpoint falls back to the previous one with a one-line warning (a named one never does); and
a torch with known unpickler bugs warns once."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import MHMOE, flip_bytes, rehash

from mhmoe.checkpoint.format import list_checkpoints, verify_checkpoint
from mhmoe.checkpoint.read import warn_if_unsafe_torch
from mhmoe.data import ByteTokenizer
from mhmoe.errors import CheckpointError
from mhmoe.loading.checkpoint import load_checkpoint, load_latest
from mhmoe.train.loop import train


def _warnings(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.strip()]


def test_load_latest_restores_everything(trained):
    ck = load_latest(trained)
    assert ck.step == 6 and ck.path.name == "step_00000006"
    assert ck.run.model.vocab_size == 257 and ck.run.model.moe == MHMOE
    assert isinstance(ck.tokenizer, ByteTokenizer)
    st = ck.trainer_state
    assert st["step"] == 6 and st["nan_total"] == 0 and st["tokens_seen"] == 6 * 4 * 32
    assert {"optimizer", "scheduler", "rng_cpu"} <= set(st)
    # tied embeddings survive the round trip (stored once)
    assert ck.model.lm_head.weight.data_ptr() == ck.model.embed.weight.data_ptr()
    # loading a checkpoint directory directly gives the same weights
    direct = load_latest(ck.path)
    for (k, a), (_, b) in zip(ck.model.state_dict().items(), direct.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), k


# ---- corruption and fallback ------------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["flip-weights", "truncate-weights", "flip-state", "delete-tokenizer",
                                    "bad-meta", "delete-meta", "meta-key", "meta-list", "meta-no-step"])
def test_corrupted_newest_falls_back_with_one_line_warning(run_dir, capsys, damage):
    newest = list_checkpoints(run_dir)[-1]
    if damage == "flip-weights":
        flip_bytes(newest / "model.safetensors")
    elif damage == "truncate-weights":
        p = newest / "model.safetensors"
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    elif damage == "flip-state":
        flip_bytes(newest / "trainer_state.pt")
    elif damage == "delete-tokenizer":
        shutil.rmtree(newest / "tokenizer")
    elif damage == "bad-meta":
        (newest / "meta.json").write_text("{not json")
    elif damage == "delete-meta":
        (newest / "meta.json").unlink()
    elif damage == "meta-key":  # still valid JSON, but a key name was hit
        m = newest / "meta.json"
        m.write_text(m.read_text().replace('"bytes"', '"bxtes"', 1))
    elif damage == "meta-list":
        (newest / "meta.json").write_text("[1, 2]")
    elif damage == "meta-no-step":
        meta = json.loads((newest / "meta.json").read_text())
        del meta["step"]
        (newest / "meta.json").write_text(json.dumps(meta))
    ck = load_latest(run_dir)
    assert ck.step == 4 and ck.path.name == "step_00000004"
    lines = _warnings(capsys.readouterr().err)
    assert len(lines) == 1, lines
    assert "step_00000006" in lines[0] and "falling back" in lines[0]
    expected = {"flip-weights": "corrupted", "truncate-weights": "truncated", "flip-state": "corrupted",
                "delete-tokenizer": "missing", "bad-meta": "meta.json", "delete-meta": "meta.json",
                "meta-key": "malformed meta.json", "meta-list": "malformed meta.json",
                "meta-no-step": "malformed meta.json"}[damage]
    assert expected in lines[0]


def test_warning_can_be_silenced(run_dir, capsys):
    flip_bytes(list_checkpoints(run_dir)[-1] / "model.safetensors")
    assert load_latest(run_dir, warn=False).step == 4
    assert capsys.readouterr().err == ""


def test_foreign_content_with_matching_hashes_is_rejected(run_dir, capsys):
    """A file replaced *and* meta.json rewritten to match passes the hash check but not the loader."""
    newest = list_checkpoints(run_dir)[-1]
    weights = newest / "model.safetensors"
    weights.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    rehash(newest)
    with pytest.raises(CheckpointError, match="cannot be loaded|do not match"):
        load_checkpoint(newest)
    assert load_latest(run_dir).step == 4
    assert len(_warnings(capsys.readouterr().err)) == 1


def test_all_corrupt_raises(run_dir, capsys):
    for c in list_checkpoints(run_dir):
        flip_bytes(c / "model.safetensors")
    with pytest.raises(CheckpointError, match="no valid checkpoint"):
        load_latest(run_dir)
    assert len(_warnings(capsys.readouterr().err)) == 2  # one line per checkpoint tried


def test_explicit_corrupt_checkpoint_dir_raises(run_dir):
    newest = list_checkpoints(run_dir)[-1]
    flip_bytes(newest / "model.safetensors")
    with pytest.raises(CheckpointError, match="sha256"):
        load_latest(newest)  # a named checkpoint is never silently replaced by another one


def test_missing_and_empty_run_directories(tmp_path):
    with pytest.raises(CheckpointError, match="no such"):
        load_latest(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no checkpoints"):
        load_latest(tmp_path / "empty")
    with pytest.raises(CheckpointError):
        verify_checkpoint(tmp_path / "empty")


def test_format_version_is_checked(run_dir):
    newest = list_checkpoints(run_dir)[-1]
    meta = json.loads((newest / "meta.json").read_text())
    meta["format_version"] = 99
    (newest / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="format_version"):
        verify_checkpoint(newest)


def test_resume_from_corrupted_newest_uses_previous(run_dir, capsys):
    """train(resume=True) falls back to step 4 and trains steps 5-6 again, writing a fresh step 6."""
    flip_bytes(list_checkpoints(run_dir)[-1] / "model.safetensors")
    before = [json.loads(ln)["loss"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    run = load_latest(run_dir, warn=False).run
    res = train(run, run_dir, resume=True, progress=False)
    assert res.step == 6
    assert "falling back" in capsys.readouterr().err
    after = [json.loads(ln)["loss"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert after == before  # bit-exact replay of steps 5-6
    assert load_latest(run_dir).step == 6  # the corrupted step 6 was replaced by a valid one


def test_old_torch_warns_once_before_loading(capsys):
    """torch.load(weights_only=True) reads trainer_state.pt and DCP items; with a torch that has known
    bugs in that unpickler (before 2.10) loading warns once per process, in one line."""
    warn_if_unsafe_torch.cache_clear()
    assert warn_if_unsafe_torch("2.5.1") and warn_if_unsafe_torch("2.5.1")  # printed once (cached)
    assert warn_if_unsafe_torch("2.9.1+cu126")
    assert not warn_if_unsafe_torch("2.10.0") and not warn_if_unsafe_torch(torch.__version__)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "CVE-2026-24747" in err[0] and "torch >= 2.10" in err[0]
    warn_if_unsafe_torch.cache_clear()
