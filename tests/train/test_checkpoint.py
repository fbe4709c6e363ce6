"""Checkpoints: atomic writes, keep_last pruning, verification (flipped bytes, truncation, missing
files, foreign content), falling back to the previous checkpoint with a one-line warning, and never
saving a non-finite model."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path

import pytest
import torch

import mhmoe.train.checkpoint as ckpt_mod
from mhmoe.checkpoint import list_checkpoints, verify_checkpoint
from mhmoe.config.data import DataConfig
from mhmoe.config.model import ModelConfig
from mhmoe.config.moe import MoEConfig
from mhmoe.config.run import RunConfig
from mhmoe.config.train import TrainConfig
from mhmoe.data import ByteTokenizer
from mhmoe.errors import CheckpointError
from mhmoe.model.lm import LM
from mhmoe.train.checkpoint import load_checkpoint, load_latest, save_checkpoint
from mhmoe.train.loop import train

MHMOE = MoEConfig(n_experts=6, top_k=3, d_expert=16, heads=3, head_layer=True, merge_layer=True)
WORDS = "in the beginning was the word and light dark water earth heaven man made said god day night".split()



def tiny_run(corpus: Path, cache: Path, **train_kw) -> RunConfig:
    t = dict(max_steps=6, batch_size=4, seq_len=32, log_every=1, eval_batches=2, warmup_steps=2, lr=1e-3,
             dtype="float32", device="cpu", threads=1, ckpt_every=2, keep_last=2)
    t.update(train_kw)
    return RunConfig(
        name="tiny-test",
        model=ModelConfig(vocab_size=0, d_model=48, n_layers=2, n_heads=4, d_ff=64, max_seq_len=64, moe=MHMOE),
        train=TrainConfig(**t),
        data=DataConfig(corpus=str(corpus), tokenizer="byte", val_sets=(), val_tokens=512, cache_dir=str(cache)),
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One 6-step run with checkpoints every 2 steps and keep_last=2 (-> steps 4 and 6)."""
    root = tmp_path_factory.mktemp("ckpt")
    corpus = root / "corpus"
    corpus.mkdir()
    rng = random.Random(0)
    for i in range(12):
        (corpus / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(250)) + "\n")
    threads = torch.get_num_threads()
    train(tiny_run(corpus, root / "cache"), root / "run", progress=False)
    torch.set_num_threads(threads)
    return root / "run"


@pytest.fixture
def run_dir(trained, tmp_path):
    """A private copy of the trained run, free to corrupt."""
    dst = tmp_path / "run"
    shutil.copytree(trained, dst)
    return dst


def _small_model() -> LM:
    return LM(ModelConfig(vocab_size=257, d_model=48, n_layers=2, n_heads=4, d_ff=64, max_seq_len=64, moe=MHMOE))


def _small_run() -> RunConfig:
    return RunConfig(model=ModelConfig(vocab_size=257, d_model=48, n_layers=2, n_heads=4, d_ff=64, max_seq_len=64,
                                       moe=MHMOE),
                     train=TrainConfig(seq_len=32), data=DataConfig(tokenizer="byte", val_sets=()))


def _flip_bytes(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0xFF
    data[i + 1] ^= 0x5A
    path.write_bytes(bytes(data))


def _warnings(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.strip()]


# ---- layout, atomicity, pruning ---------------------------------------------------------------------------
def test_layout_and_keep_last(trained):
    ckpts = list_checkpoints(trained)
    assert [c.name for c in ckpts] == ["step_00000004", "step_00000006"]
    assert not list((trained / "checkpoints").glob(".tmp-*"))
    c = ckpts[-1]
    assert {p.name for p in c.iterdir()} == {"model.safetensors", "config.yaml", "trainer_state.pt", "tokenizer",
                                             "meta.json"}
    meta = verify_checkpoint(c)
    assert meta["step"] == 6 and "model.safetensors" in meta["files"]
    assert any(name.startswith("tokenizer/") for name in meta["files"])


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


def test_keep_last_one(tmp_path):
    model, run, tok = _small_model(), _small_run(), ByteTokenizer()
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, model, run, tok, {"step": step}, keep_last=1)
    assert [c.name for c in list_checkpoints(tmp_path)] == ["step_00000003"]


def test_failed_write_leaves_no_partial_checkpoint(trained, tmp_path, monkeypatch):
    run_dir = tmp_path / "r"
    shutil.copytree(trained, run_dir)
    ck = load_latest(run_dir)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt_mod.torch, "save", disk_full)
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
    model, run, tok = _small_model(), _small_run(), ByteTokenizer()
    save_checkpoint(tmp_path, 5, model, run, tok, {"step": 5})
    with torch.no_grad():
        model.embed.weight.add_(1.0)
    save_checkpoint(tmp_path, 5, model, run, tok, {"step": 5})
    assert len(list_checkpoints(tmp_path)) == 1
    assert torch.equal(load_latest(tmp_path).model.embed.weight, model.embed.weight)


# ---- corruption and fallback ------------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["flip-weights", "truncate-weights", "flip-state", "delete-tokenizer",
                                    "bad-meta", "delete-meta", "meta-key", "meta-list", "meta-no-step"])
def test_corrupted_newest_falls_back_with_one_line_warning(run_dir, capsys, damage):
    newest = list_checkpoints(run_dir)[-1]
    if damage == "flip-weights":
        _flip_bytes(newest / "model.safetensors")
    elif damage == "truncate-weights":
        p = newest / "model.safetensors"
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    elif damage == "flip-state":
        _flip_bytes(newest / "trainer_state.pt")
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
    _flip_bytes(list_checkpoints(run_dir)[-1] / "model.safetensors")
    assert load_latest(run_dir, warn=False).step == 4
    assert capsys.readouterr().err == ""


def test_foreign_content_with_matching_hashes_is_rejected(run_dir, capsys):
    """A file replaced *and* meta.json rewritten to match passes the hash check but not the loader."""
    newest = list_checkpoints(run_dir)[-1]
    weights = newest / "model.safetensors"
    weights.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    meta = json.loads((newest / "meta.json").read_text())
    meta["files"]["model.safetensors"] = {"sha256": hashlib.sha256(weights.read_bytes()).hexdigest(),
                                          "bytes": weights.stat().st_size}
    (newest / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="cannot be loaded|do not match"):
        load_checkpoint(newest)
    assert load_latest(run_dir).step == 4
    assert len(_warnings(capsys.readouterr().err)) == 1


def test_all_corrupt_raises(run_dir, capsys):
    for c in list_checkpoints(run_dir):
        _flip_bytes(c / "model.safetensors")
    with pytest.raises(CheckpointError, match="no valid checkpoint"):
        load_latest(run_dir)
    assert len(_warnings(capsys.readouterr().err)) == 2  # one line per checkpoint tried


def test_explicit_corrupt_checkpoint_dir_raises(run_dir):
    newest = list_checkpoints(run_dir)[-1]
    _flip_bytes(newest / "model.safetensors")
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
    _flip_bytes(list_checkpoints(run_dir)[-1] / "model.safetensors")
    before = [json.loads(ln)["loss"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    run = load_latest(run_dir, warn=False).run
    res = train(run, run_dir, resume=True, progress=False)
    assert res.step == 6
    assert "falling back" in capsys.readouterr().err
    after = [json.loads(ln)["loss"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert after == before  # bit-exact replay of steps 5-6
    assert load_latest(run_dir).step == 6  # the corrupted step 6 was replaced by a valid one


# ---- non-finite models are never saved ------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_model_is_never_saved(tmp_path, bad):
    model, run, tok = _small_model(), _small_run(), ByteTokenizer()
    save_checkpoint(tmp_path, 1, model, run, tok, {"step": 1})
    with torch.no_grad():
        next(iter(model.blocks[1].ffn.parameters())).view(-1)[3] = bad
    with pytest.raises(CheckpointError, match="non-finite"):
        save_checkpoint(tmp_path, 2, model, run, tok, {"step": 2})
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_00000001"]
    assert load_latest(tmp_path).step == 1


def test_old_torch_warns_once_before_loading(capsys):
    """torch.load(weights_only=True) reads trainer_state.pt and DCP items; with a torch that has known
    bugs in that unpickler (before 2.10) loading warns once per process, in one line."""
    from mhmoe.checkpoint import warn_if_unsafe_torch

    warn_if_unsafe_torch.cache_clear()
    assert warn_if_unsafe_torch("2.5.1") and warn_if_unsafe_torch("2.5.1")  # printed once (cached)
    assert warn_if_unsafe_torch("2.9.1+cu126")
    assert not warn_if_unsafe_torch("2.10.0") and not warn_if_unsafe_torch(torch.__version__)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "CVE-2026-24747" in err[0] and "torch >= 2.10" in err[0]
    warn_if_unsafe_torch.cache_clear()
