"""User corpora from paths, and every bad-input case -> DataError with a useful message."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from mhmoe.config.data import DataConfig
from mhmoe.data import load_corpus, prepare_data
from mhmoe.errors import DataError

TEXT = "\n\n".join(
    f"Paragraph {i}. " + "The quick brown fox jumps over the lazy dog. " * 12 for i in range(60)
)


def test_text_file_split_into_paragraph_documents(tmp_path: Path) -> None:
    f = tmp_path / "book.txt"
    f.write_text(TEXT)
    c = load_corpus(str(f))
    assert c.name == "book" and len(c.documents) >= 8
    assert all(2000 < len(d.text) < 8000 for d in c.documents[:-1])
    assert " ".join(d.text for d in c.documents).split() == TEXT.split()
    assert all(c.splits().values())


def test_crlf_and_bom_normalised(tmp_path: Path) -> None:
    f = tmp_path / "win.txt"
    f.write_bytes(b"\xef\xbb\xbfline one\r\nline two\r\n")
    assert load_corpus(str(f)).documents[0].text == "line one\nline two"


def test_directory_one_document_per_file(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("alpha text")
    (tmp_path / "sub" / "b.md").write_text("# beta")
    (tmp_path / "sub" / "c.rst").write_text("gamma\n=====")
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "ignored.py").write_text("print('no')")
    c = load_corpus(str(tmp_path))
    assert [d.id for d in c.documents] == ["a.txt", "sub/b.md", "sub/c.rst"]


def test_jsonl_field_configurable(tmp_path: Path) -> None:
    f = tmp_path / "rows.jsonl"
    f.write_text("\n".join(json.dumps({"body": f"row {i}", "text": 1}) for i in range(5)) + "\n\n")
    c = load_corpus(str(f), jsonl_field="body")
    assert [d.text for d in c.documents] == [f"row {i}" for i in range(5)]
    with pytest.raises(DataError, match=r"rows.jsonl:1: field 'text' is int"):
        load_corpus(str(f))
    with pytest.raises(
        DataError, match=r"rows.jsonl:1: field 'missing' missing \(row has keys: body, text\)"
    ):
        load_corpus(str(f), jsonl_field="missing")


def test_jsonl_invalid_json_names_line(tmp_path: Path) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text('{"text": "ok"}\n{"text": broken}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: invalid JSON"):
        load_corpus(str(f))
    f.write_text('["a list"]\n')
    with pytest.raises(DataError, match=r"bad.jsonl:1: expected a JSON object"):
        load_corpus(str(f))


def test_parquet(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    f = tmp_path / "t.parquet"
    pq.write_table(pa.table({"content": ["first doc", None, "second doc"], "n": [1, 2, 3]}), f)
    c = load_corpus(str(f), jsonl_field="content")
    assert [d.text for d in c.documents] == ["first doc", "second doc"]
    with pytest.raises(DataError, match=r"t.parquet: column 'text' missing \(columns: content, n\)"):
        load_corpus(str(f))
    with pytest.raises(DataError, match=r"t.parquet: row 0: column 'n' is int"):
        load_corpus(str(f), jsonl_field="n")


def test_parquet_without_pyarrow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "t.parquet"
    f.write_bytes(b"PAR1 not really")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match=r"t.parquet: reading .parquet needs pyarrow: pip install pyarrow"):
        load_corpus(str(f))


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"nope.txt: no such file or directory"):
        load_corpus(str(tmp_path / "nope.txt"))


@pytest.mark.parametrize("content", [b"", b"   \n\n  "])
def test_empty_file(tmp_path: Path, content: bytes) -> None:
    f = tmp_path / "empty.txt"
    f.write_bytes(content)
    with pytest.raises(DataError, match=r"empty.txt: empty file"):
        load_corpus(str(f))
    j = tmp_path / "empty.jsonl"
    j.write_bytes(content)
    with pytest.raises(DataError, match=r"empty.jsonl: empty file"):
        load_corpus(str(j))


def test_empty_directory(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"directory has no \*.txt/\*.md/\*.rst files"):
        load_corpus(str(tmp_path))
    (tmp_path / "x.txt").write_text("")
    with pytest.raises(DataError, match=r"all 1 text files in the directory are empty"):
        load_corpus(str(tmp_path))


def test_binary_file_named(tmp_path: Path) -> None:
    f = tmp_path / "image.txt"
    f.write_bytes(b"GIF89a\x00\x01\x02binary")
    with pytest.raises(DataError, match=r"image.txt: binary data, not text \(NUL byte at offset 6\)"):
        load_corpus(str(f))


def test_non_utf8_file_named_in_directory(tmp_path: Path) -> None:
    (tmp_path / "good.txt").write_text("fine")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1.txt: not valid UTF-8 \(byte 0xe9 at offset 3\)"):
        load_corpus(str(tmp_path))


def test_too_little_text_for_one_sequence(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("tiny one")
    (tmp_path / "b.txt").write_text("tiny two")
    cfg = DataConfig(corpus=str(tmp_path), tokenizer="byte", val_sets=(), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError, match=r"training split has 9 tokens \(byte\); one training sequence needs"):
        prepare_data(cfg, seq_len=64)


def test_single_document_corpus_rejected(tmp_path: Path) -> None:
    f = tmp_path / "short.txt"
    f.write_text("just one short paragraph")
    cfg = DataConfig(corpus=str(f), tokenizer="byte", val_sets=(), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError, match=r"only 1 document; need >= 2"):
        prepare_data(cfg, seq_len=4)
