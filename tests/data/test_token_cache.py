"""Token cache: manifest contents, reuse, and detection of every kind of staleness."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mhmoe.config.data import DataConfig
from mhmoe.data import prepare_data
from mhmoe.data.documents import Document
from mhmoe.data.token_cache import default_cache_dir, load_or_build_tokens, token_dtype
from mhmoe.data.tokenizer import ByteTokenizer

DOCS = [Document(f"d{i}", f"document number {i} " * 20) for i in range(10)]


def test_tokens_joined_with_eos_and_manifest(tmp_path: Path) -> None:
    tok = ByteTokenizer()
    tf = load_or_build_tokens(tmp_path, "corp", "train", DOCS, tok)
    assert tf.built and isinstance(tf.tokens, np.memmap) and tf.tokens.dtype == np.uint16
    expected = []
    for d in DOCS:
        expected += tok.encode(d.text) + [tok.eos_id]
    assert tf.tokens.tolist() == expected
    m = json.loads(tf.path.with_suffix(".json").read_text())
    assert m["n_tokens"] == len(expected) and m["split"] == "train" and m["dtype"] == "<u2"
    assert m["tokenizer"] == {"name": "byte", "fingerprint": tok.fingerprint}
    assert m["format_version"] == 1 and len(m["source_hash"]) == 64 and m["n_documents"] == 10
    again = load_or_build_tokens(tmp_path, "corp", "train", DOCS, tok)
    assert not again.built and again.tokens.tolist() == expected


def test_cap_stops_early(tmp_path: Path) -> None:
    tf = load_or_build_tokens(tmp_path, "corp", "val", DOCS, ByteTokenizer(), max_tokens=500)
    assert len(tf.tokens) == 500 and tf.manifest["max_tokens"] == 500
    assert tf.manifest["n_documents"] == 2
    other = load_or_build_tokens(tmp_path, "corp", "val", DOCS, ByteTokenizer(), max_tokens=600)
    assert other.built and len(other.tokens) == 600 and other.path != tf.path


def test_modified_source_rebuilds(tmp_path: Path) -> None:
    tok = ByteTokenizer()
    a = load_or_build_tokens(tmp_path, "corp", "train", DOCS, tok)
    changed = [*DOCS[:-1], Document("d9", "edited text")]
    b = load_or_build_tokens(tmp_path, "corp", "train", changed, tok)
    assert b.built and "source_hash changed" in b.reason and b.path == a.path
    assert b.tokens.tolist()[-12:] == tok.encode("edited text") + [tok.eos_id]


@pytest.mark.parametrize(
    "damage",
    ["truncate", "extend", "flip", "delete_bin", "manifest_garbage", "manifest_count", "manifest_version"],
)
def test_damaged_cache_rebuilt(tmp_path: Path, damage: str) -> None:
    tok = ByteTokenizer()
    good = load_or_build_tokens(tmp_path, "corp", "train", DOCS, tok)
    want = good.tokens.tolist()
    bin_path, man_path = good.path, good.path.with_suffix(".json")
    data = bin_path.read_bytes()
    man = json.loads(man_path.read_text())
    if damage == "truncate":
        bin_path.write_bytes(data[: len(data) // 2])
    elif damage == "extend":
        bin_path.write_bytes(data + b"\0\0")
    elif damage == "flip":
        bin_path.write_bytes(data[:10] + bytes([data[10] ^ 1]) + data[11:])
    elif damage == "delete_bin":
        bin_path.unlink()
    elif damage == "manifest_garbage":
        man_path.write_text("{")
    elif damage == "manifest_count":
        man_path.write_text(json.dumps({**man, "n_tokens": man["n_tokens"] - 1}))
    elif damage == "manifest_version":
        man_path.write_text(json.dumps({**man, "format_version": 0}))
    rebuilt = load_or_build_tokens(tmp_path, "corp", "train", DOCS, tok)
    assert rebuilt.built and rebuilt.tokens.tolist() == want
    assert not load_or_build_tokens(tmp_path, "corp", "train", DOCS, tok).built
    assert not list(bin_path.parent.glob(".*.tmp"))  # atomic writes leave no temporaries


def test_prepare_data_rebuilds_when_user_file_changes(tmp_path: Path) -> None:
    f = tmp_path / "corpus.txt"
    f.write_text("\n\n".join(f"Paragraph {i}: " + "lorem ipsum dolor sit amet " * 30 for i in range(40)))
    cfg = DataConfig(corpus=str(f), tokenizer="byte", val_sets=(), cache_dir=str(tmp_path / "c"))
    first = prepare_data(cfg, seq_len=32)
    assert first.manifest["train"]["built"]
    assert not prepare_data(cfg, seq_len=32).manifest["train"]["built"]
    f.write_text(f.read_text().replace("lorem", "Lorem"))
    third = prepare_data(cfg, seq_len=32)
    for part in (third.manifest["train"], third.manifest["val"]["corpus"]):
        assert part["built"]
    assert third.manifest["train"]["source_hash"] != first.manifest["train"]["source_hash"]
    assert third.manifest["train"]["path"] == first.manifest["train"]["path"]  # same file, rewritten
    assert "Lorem ipsum" in third.tokenizer.decode(third.train[:200].tolist())
    assert "lorem ipsum" in first.tokenizer.decode(first.train[:200].tolist())  # old map still valid


def test_dtype_and_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert token_dtype(8192) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32 and token_dtype(100277) == np.uint32
    assert default_cache_dir(str(tmp_path)) == tmp_path
    monkeypatch.setenv("MHMOE_CACHE", str(tmp_path / "env"))
    assert default_cache_dir("") == tmp_path / "env"
    monkeypatch.delenv("MHMOE_CACHE")
    assert default_cache_dir("") == Path.home() / ".cache" / "mhmoe"
