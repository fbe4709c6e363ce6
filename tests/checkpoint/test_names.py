"""Names and directories taken from a checkpoint never decide where mhmoe reads or writes.

Each attack is first shown to be live against the stock code path it targets, then refused:

* a tokenizer name with ``../`` in ``tokenizer_meta.json`` (it becomes part of the token-cache file
  names): ``mhmoe eval`` wrote the validation token file outside the cache directory; now the
  checkpoint is refused in one line (exit status 2) and nothing is written outside;
* the checkpoint's ``data.cache_dir`` decided where ``eval`` writes its caches; now eval uses this
  machine's cache (``$MHMOE_CACHE`` or ``~/.cache/mhmoe``) whatever the checkpoint says;
* file names in ``meta.json`` that leave the checkpoint (``../``, absolute, Windows paths, symlinks) and
  unlisted symlinks out of it are refused before anything outside is read.

(Crafted pickles and DCP data-file names: test_crafted.py.)
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from helpers import rehash, write_corpus

from mhmoe.checkpoint.format import verify_checkpoint
from mhmoe.checkpoint.write import save_checkpoint
from mhmoe.cli import main
from mhmoe.config.data import DataConfig
from mhmoe.config.model import ModelConfig
from mhmoe.config.moe import MoEConfig
from mhmoe.config.run import RunConfig
from mhmoe.config.train import TrainConfig
from mhmoe.data.bpe import train_bpe
from mhmoe.data.documents import Document
from mhmoe.data.token_cache import load_or_build_tokens
from mhmoe.data.tokenizer import ByteTokenizer, load_tokenizer
from mhmoe.errors import CheckpointError, DataError
from mhmoe.loading.checkpoint import load_checkpoint
from mhmoe.model.lm import LM

ESCAPE = "../../../../escaped"


@pytest.fixture
def bpe_run(tmp_path) -> Path:
    """A run directory with one checkpoint of a tiny model and a BPE tokenizer (name read from its meta)."""
    corpus = write_corpus(tmp_path / "corpus", n_docs=6, n_words=120)
    tok = train_bpe([p.read_text() for p in sorted(corpus.iterdir())], 300)
    run = RunConfig(
        model=ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=1, n_heads=2, d_ff=32, max_seq_len=32,
                          moe=MoEConfig(n_experts=2, d_expert=16)),
        train=TrainConfig(seq_len=16, batch_size=2, eval_batches=1, device="cpu"),
        data=DataConfig(corpus=str(corpus), tokenizer="bpe", vocab_size=300, val_sets=(), val_tokens=64,
                        cache_dir=str(tmp_path / "victim")))
    save_checkpoint(tmp_path / "run", 1, LM(run.model), run, tok, {"step": 1})
    return tmp_path / "run"


def _rename_tokenizer(ck: Path, name: str) -> None:
    meta_file = ck / "tokenizer" / "tokenizer_meta.json"
    meta = json.loads(meta_file.read_text())
    meta["name"] = name
    meta_file.write_text(json.dumps(meta))
    rehash(ck)


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def test_tokenizer_name_cannot_lead_out_of_the_cache(bpe_run, tmp_path, capsys):
    ck = bpe_run / "checkpoints" / "step_00000001"
    _rename_tokenizer(ck, ESCAPE)
    # live: the stock loaders accept the name (the fingerprint does not cover it) ...
    with pytest.raises(DataError, match="not a plain file name"):
        load_tokenizer(ck / "tokenizer")
    from mhmoe.data.bpe import BPETokenizer

    meta = json.loads((ck / "tokenizer" / "tokenizer_meta.json").read_text())
    tok = BPETokenizer._from_saved(ck / "tokenizer", meta)  # what load() built before the name check
    assert tok.name == ESCAPE and tok.fingerprint == meta["fingerprint"]
    # ... and the cache path it builds leaves the cache directory; the cache refuses it
    cache = tmp_path / "deep" / "er" / "cache"
    with pytest.raises(DataError, match="tokenizer name"):
        load_or_build_tokens(cache, "corpus", "val", [Document("d", "some text")], tok)
    assert not (tmp_path / "deep").exists()
    before = _files(tmp_path)
    assert main(["eval", "--checkpoint", str(bpe_run)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("mhmoe eval: error:") and "not a plain file name" in err[-1]
    assert _files(tmp_path) == before  # nothing written anywhere under tmp_path


def test_eval_writes_its_caches_where_this_machine_keeps_them(bpe_run, tmp_path, monkeypatch, capsys):
    here = tmp_path / "my-cache"
    monkeypatch.setenv("MHMOE_CACHE", str(here))
    assert main(["eval", "--checkpoint", str(bpe_run), "--batches", "1"]) == 0
    assert "ppl" in capsys.readouterr().out
    assert not (tmp_path / "victim").exists()  # the checkpoint's data.cache_dir
    assert any(here.rglob("*.bin"))


@pytest.mark.parametrize("bad", ["..", ".", "", "a/b", "a\\b", "x\x00y", ESCAPE, 5, None])
def test_cache_path_components_are_plain_names(tmp_path, bad):
    with pytest.raises(DataError, match="not a plain file name"):
        load_or_build_tokens(tmp_path / "cache", bad, "val", [Document("d", "text")], ByteTokenizer())
    assert not (tmp_path / "cache").exists()


@pytest.fixture
def ck(tmp_path) -> Path:
    """A single-file checkpoint of a tiny model, free to tamper with."""
    run = RunConfig(model=ModelConfig(vocab_size=257, d_model=32, n_layers=1, n_heads=2, d_ff=32, max_seq_len=32),
                    train=TrainConfig(seq_len=16), data=DataConfig(tokenizer="byte", val_sets=()))
    return save_checkpoint(tmp_path / "run", 1, LM(run.model), run, ByteTokenizer(), {"step": 1})


# ---- meta.json file names and symlinks -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["../outside.txt", "tokenizer/../../outside.txt", "ABSOLUTE", "/etc/passwd",
                                  "link.txt", "C:\\outside.txt"])
def test_meta_json_names_stay_inside_the_checkpoint(ck, tmp_path, name):
    outside = ck.parent / "outside.txt"
    outside.write_text("a file next to the checkpoint, not in it\n")
    if name == "ABSOLUTE":
        name = str(outside)
    if name == "link.txt":
        (ck / name).symlink_to(outside)
    meta = json.loads((ck / "meta.json").read_text())
    if Path(ck / name).is_file():  # live: the old verify_checkpoint read and hashed this file, and accepted it
        data = (ck / name).read_bytes()
        meta["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    else:
        meta["files"][name] = {"sha256": "0" * 64, "bytes": 1}
    (ck / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="not a file inside the checkpoint|out of the checkpoint") as exc:
        verify_checkpoint(ck)
    msg = str(exc.value)
    assert "\n" not in msg and "truncated" not in msg and "sha256" not in msg  # the outside file was not read
    with pytest.raises(CheckpointError):
        load_checkpoint(ck)


def test_unlisted_symlink_out_of_the_checkpoint_is_refused(ck, tmp_path):
    """config.yaml is read by name: a symlink out of the directory is refused even when meta.json omits it."""
    outside = tmp_path / "config.yaml"
    shutil.copy(ck / "config.yaml", outside)
    (ck / "config.yaml").unlink()
    (ck / "config.yaml").symlink_to(outside)
    meta = json.loads((ck / "meta.json").read_text())
    del meta["files"]["config.yaml"]
    (ck / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="'config.yaml' is a symlink out of the checkpoint directory"):
        load_checkpoint(ck)


def test_symlink_inside_the_checkpoint_is_accepted(ck):
    (ck / "config-link.yaml").symlink_to("config.yaml")
    rehash(ck)
    assert verify_checkpoint(ck)["files"]["config-link.yaml"]["bytes"] == (ck / "config.yaml").stat().st_size
