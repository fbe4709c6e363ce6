"""Data bundles: written from a prepared (fixture) debdocs corpus, read back without the corpus's
packages, refused when damaged or made for another run; a 2-step training from a bundle alone."""

import json
import lzma
import shutil

import numpy as np
import pytest
from debdocs_fixture import SOURCES, make_install

from mhmoe.config.data import DataConfig
from mhmoe.data import debdocs, epochs, load_corpus, prepare_data
from mhmoe.data.bundle import document_prefix, write_bundle
from mhmoe.data.documents import CorpusUnavailableError
from mhmoe.errors import ConfigError, DataError


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(bundle dir, the prepared data it was made from), from the fixture packages."""
    tmp = tmp_path_factory.mktemp("bundle")
    info = make_install(tmp / "root")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(debdocs, "SOURCES", SOURCES)
        mp.setattr(debdocs, "DPKG_INFO", info)
        cfg = DataConfig(corpus="debdocs", vocab_size=300, val_sets=(), val_tokens=64, cache_dir=str(tmp / "c"))
        prepared = prepare_data(cfg, seq_len=16)
        out = tmp / "bundle"
        write_bundle(prepared, cfg, out, max_train_tokens=len(prepared.train) // 2)
    shutil.rmtree(tmp / "root")
    return out, prepared


@pytest.fixture
def bundle(built, tmp_path, monkeypatch):
    """A fresh copy of the bundle, with the fixture packages not installed."""
    out = tmp_path / "bundle"
    shutil.copytree(built[0], out)
    monkeypatch.setattr(debdocs, "SOURCES", SOURCES)
    monkeypatch.setattr(debdocs, "DPKG_INFO", tmp_path / "no-dpkg")
    with pytest.raises(CorpusUnavailableError):
        load_corpus("debdocs")
    return out, built[1]


def test_bundle_round_trip(bundle, tmp_path):
    out, prepared = bundle
    man = json.loads((out / "manifest.json").read_text())
    assert man["corpus"] == "debdocs" and man["tokenizer"]["fingerprint"] == prepared.tokenizer.fingerprint
    assert sorted(man["files"]) == sorted(
        ["tokenizer/tokenizer.json", "tokenizer/tokenizer_meta.json", "train.u16.xz", "val-debdocs.u16.xz"])
    cfg = DataConfig(corpus="debdocs", vocab_size=300, val_sets=(), val_tokens=64, bundle=str(out),
                     cache_dir=str(tmp_path / "other-cache"))
    data = prepare_data(cfg, seq_len=16)
    n = man["train"]["n_tokens"]
    assert 0 < n <= len(prepared.train) // 2 and int(data.train[-1]) == data.tokenizer.eos_id  # whole documents
    assert np.array_equal(data.train, prepared.train[:n])
    assert np.array_equal(data.val["debdocs"], prepared.val["debdocs"])
    assert data.tokenizer.fingerprint == prepared.tokenizer.fingerprint
    assert data.manifest["train_tokens"] == n and epochs(2 * n, data) == 2.0
    assert not (tmp_path / "other-cache").exists()  # nothing prepared from a corpus


def test_bundle_refuses_another_run(bundle):
    out, _ = bundle
    for kw, field in (({"corpus": "kjv"}, "corpus"), ({"vocab_size": 512}, "vocab_size"),
                      ({"tokenizer": "byte"}, "tokenizer")):
        cfg = DataConfig(**{"corpus": "debdocs", "vocab_size": 300, "val_sets": (), "bundle": str(out), **kw})
        with pytest.raises(DataError, match=f"made for {field}"):
            prepare_data(cfg, seq_len=16)
    with pytest.warns(UserWarning, match="'kjv': not in data.bundle"):
        data = prepare_data(DataConfig(corpus="debdocs", vocab_size=300, val_sets=("kjv",), bundle=str(out),
                                       val_tokens=64), seq_len=16)
    assert list(data.val) == ["debdocs"] and data.manifest["skipped_val_sets"] == ["kjv"]


def _cfg(out):
    return DataConfig(corpus="debdocs", vocab_size=300, val_sets=(), val_tokens=64, bundle=str(out))


def test_bundle_untrusted(bundle, tmp_path):
    out, _ = bundle
    train = out / "train.u16.xz"
    good = train.read_bytes()
    train.write_bytes(good[:-8] + bytes(8))
    with pytest.raises(DataError, match="sha256 does not match"):
        prepare_data(_cfg(out), seq_len=16)
    # a consistent manifest that understates the tokens: decompression stops at the declared size
    man = json.loads((out / "manifest.json").read_text())
    raw = lzma.decompress(good)
    big = lzma.compress(raw * 50, format=lzma.FORMAT_XZ)
    train.write_bytes(big)
    import hashlib

    man["train"]["sha256"] = man["files"]["train.u16.xz"]["sha256"] = hashlib.sha256(big).hexdigest()
    (out / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(DataError, match="unpacks to more bytes"):
        prepare_data(_cfg(out), seq_len=16)
    train.unlink()
    train.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(DataError, match="symlink"):
        prepare_data(_cfg(out), seq_len=16)
    (out / "manifest.json").write_text('{"format": "mhmoe-data-bundle", "format_version": 1, "train": {"file": '
                                       '"../x", "n_tokens": 5, "dtype": "<u2"}, "val": {}}')
    with pytest.raises(DataError, match="not a plain file name"):
        prepare_data(_cfg(out), seq_len=16)
    with pytest.raises(DataError, match="not a bundle directory"):
        prepare_data(_cfg(tmp_path / "nothing"), seq_len=16)
    with pytest.raises(ConfigError, match="data.bundle"):
        DataConfig(bundle=" ")


def test_write_refuses_existing_directory(bundle, tmp_path):
    out, prepared = bundle
    with pytest.raises(DataError, match="not an empty directory"):
        write_bundle(prepared, _cfg(""), out, max_train_tokens=100)


def test_document_prefix():
    t = np.array([5, 6, 0, 7, 0, 8, 9], dtype=np.uint16)
    assert document_prefix(t, 0, 4).tolist() == [5, 6, 0]
    assert document_prefix(t, 0, 2).tolist() == [5, 6]  # no whole document fits: the first N ids
    assert document_prefix(t, 0, 99).tolist() == t.tolist()


def test_train_two_steps_from_bundle(bundle, tmp_path):
    from helpers import tiny_run

    from mhmoe.config.run import RunConfig
    from mhmoe.train import train

    out, _ = bundle
    run = tiny_run(tmp_path, max_steps=2, seq_len=16, eval_batches=1)
    run = RunConfig(**{**run.__dict__, "data": _cfg(out)})
    result = train(run, tmp_path / "run", progress=False)
    assert result.step == 2


def test_cli_data_bundle(tmp_path, capsys):
    from helpers import write_corpus

    from mhmoe.cli import main

    corpus = write_corpus(tmp_path / "corpus")
    out = tmp_path / "b"
    argv = ["data", "bundle", "--corpus", str(corpus), "--out", str(out), "--tokenizer", "byte", "--val-sets",
            "--seq-len", "16", "--max-train-tokens", "2000", "--cache-dir", str(tmp_path / "c"), "--no-progress"]
    assert main([*argv, "--json"]) == 0
    written = json.loads(capsys.readouterr().out)
    assert written["out"] == str(out) and 1000 < written["train"]["n_tokens"] <= 2000
    assert set(written["files"]) == {"tokenizer/tokenizer_meta.json", "train.u16.xz", "val-corpus.u16.xz"}
    assert main(argv) == 2  # the directory exists: refused in one line, nothing overwritten
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "not an empty directory" in err
    assert main([*argv[:-1], "--out", str(tmp_path / "x"), "--max-train-tokens", "5"]) == 2
