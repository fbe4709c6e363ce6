"""Multilingual man-page corpora (man-<lang>, manpages): rendering, caching, splits, val sets."""

from __future__ import annotations

import gzip
import sys
from pathlib import Path

import pytest

from mhmoe.data import corpora, manpages
from mhmoe.data.corpora import CorpusUnavailableError, load_corpus
from mhmoe.data.documents import doc_hash
from mhmoe.data.manpages import ManLanguage, clean_rendered, is_so_stub, roff_to_text
from mhmoe.data.prepare import DataConfig, prepare_data
from mhmoe.errors import DataError

HAS_MANDOC = manpages.find_mandoc() is not None
ROFF = b""".TH LS 1 "2022" "GNU coreutils 9.1" "User Commands"
.SH NAME
ls \\- list directory contents
.SH DESCRIPTION
List information about the \\fBFILE\\fPs (the current directory by default).
Sort entries alphabetically.
.TP
\\fB\\-a\\fR, \\fB\\-\\-all\\fR
do not ignore entries starting with .
.SH TRANSLATION
Boilerplate translator credits.
"""

# mandoc -T utf8 output shape: header block, body, footer block; bold as overstrike
RENDERED = (
    "LS(1)            User Commands            LS(1)\n\n"
    "N\bNA\bAM\bME\bE\n  ls - list\n\n\n\n"
    "  ┌────────────────────────────┬──────┐\n"
    "  │Interface" + " " * 40 + "│ Value│\n\n"
    "TRANSLATION\n  credits\n\n"
    "GNU coreutils 9.1            2022            LS(1)\n"
)


def test_clean_rendered_rules() -> None:
    text = clean_rendered(RENDERED, ("TRANSLATION",))
    assert text == "NAME\n  ls - list\n\n  ┌─┬─┐\n  │Interface    │ Value│"
    assert "credits" in clean_rendered(RENDERED)  # no boilerplate heading given: kept
    assert clean_rendered("HEADER\n\nFOOTER\n") == ""  # no body


def test_so_stub_detection() -> None:
    assert is_so_stub(b".so man3/foo.3\n")
    assert is_so_stub(b'.\\" alias\n.so man3/foo.3\n')
    assert not is_so_stub(ROFF)


@pytest.mark.skipif(not HAS_MANDOC, reason="apt-get install -y mandoc")
def test_roff_to_text_with_mandoc() -> None:
    text = roff_to_text(ROFF, boilerplate=("TRANSLATION",))
    assert text.startswith("NAME\n  ls - list directory contents\n\nDESCRIPTION\n  List information about the FILEs")
    assert "Sort entries alphabetically." in text  # filled into one paragraph line
    assert "-a, --all" in text and "\b" not in text
    assert "User Commands" not in text and "credits" not in text and "GNU coreutils" not in text
    assert roff_to_text(ROFF, boilerplate=("TRANSLATION",)) == text


def test_roff_to_text_without_mandoc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manpages, "find_mandoc", lambda: None)
    with pytest.raises(CorpusUnavailableError, match="apt-get install -y mandoc"):
        roff_to_text(ROFF)


# -- a fake Debian: dpkg file lists and gzipped pages in tmp_path, a fake renderer -------------

PAGES = [f"man1/cmd{i:02d}.1" for i in range(40)] + [f"man3/fn{i:02d}.3" for i in range(40)]


def fake_render(roff: bytes, mandoc: str, where: str = "") -> str:
    body = roff.decode().split("\n", 1)[1]
    return f"HEAD(1)   header\n\n{body}\n\nfooter line\n"


def make_language(tmp: Path, code: str, pages: list[str], info: Path) -> ManLanguage:
    root = tmp / "man" / code
    listed = []
    for key in pages:
        path = root / f"{key}.gz"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(gzip.compress(f".TH X 1\nNAME\n  {code} text of {key}\n".encode() + b"x y z\n" * 30))
        listed.append(str(path))
    alias = root / "man1" / "alias.1.gz"
    alias.write_bytes(gzip.compress(b".so man1/cmd00.1\n"))
    link = root / "man1" / "link.1.gz"
    link.symlink_to(root / f"{pages[0]}.gz")
    listed += [str(alias), str(link), str(root), str(tmp / "elsewhere" / "man1" / "x.1.gz")]
    info.mkdir(parents=True, exist_ok=True)
    (info / f"fake-{code}.list").write_text("\n".join(listed) + "\n")
    return ManLanguage(code, f"Lang {code}", (f"fake-{code}",), root, ("TRANSLATION",))


@pytest.fixture
def fake_debian(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    info = tmp_path / "dpkg-info"
    langs = {
        # real registry codes (the registry's loaders look languages up at call time)
        "de": make_language(tmp_path, "de", PAGES, info),
        "fr": make_language(tmp_path, "fr", PAGES[::2], info),  # a subset of the pages
    }
    monkeypatch.setattr(manpages, "DPKG_INFO", info)
    monkeypatch.setattr(manpages, "MAN_LANGUAGES", langs)
    monkeypatch.setattr(manpages, "MANPAGES_LANGS", ("de", "fr"))
    monkeypatch.setattr(manpages, "find_mandoc", lambda: sys.executable)  # hashed as "the binary"
    monkeypatch.setattr(manpages, "render_roff", fake_render)
    monkeypatch.setenv("MHMOE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(manpages, "_MEMO", {})
    return tmp_path


def test_loader_reads_package_pages_deterministically(fake_debian: Path) -> None:
    a = manpages.load_man_language("de")
    assert a.name == "man-de"
    assert [d.id for d in a.documents] == [f"de/{k}" for k in sorted(PAGES)]  # no alias, link, stray path
    assert a.documents[0].text.startswith("NAME\n  de text of man1/cmd00.1\nx y z")
    manpages._MEMO.clear()
    again = manpages.load_man_language("de")
    assert again.documents == a.documents and again.splits() == a.splits()


def test_cache_is_used_and_invalidated(fake_debian: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = manpages.load_man_language("de")
    cached = list((fake_debian / "cache" / "corpora" / "manpages").glob("de-*.jsonl.gz"))
    assert len(cached) == 1
    manpages._MEMO.clear()

    def boom(*args: object, **kwargs: object) -> str:
        raise AssertionError("rendered although cached")

    monkeypatch.setattr(manpages, "render_roff", boom)
    assert manpages.load_man_language("de").documents == first.documents
    page = fake_debian / "man" / "de" / "man1" / "cmd00.1.gz"
    page.write_bytes(gzip.compress(b".TH X 1\nNAME\n  changed\n"))
    monkeypatch.setattr(manpages, "render_roff", fake_render)
    changed = manpages.load_man_language("de")
    assert changed.documents[0].text == "NAME\n  changed"
    assert len(list((fake_debian / "cache" / "corpora" / "manpages").glob("de-*.jsonl.gz"))) == 2


def test_splits_by_page_across_languages(fake_debian: Path) -> None:
    a, b = manpages.load_man_language("de"), manpages.load_man_language("fr")
    for corpus in (a, b):
        parts = corpus.splits()
        ids = [d.id for s in parts.values() for d in s]
        assert sorted(ids) == sorted(d.id for d in corpus.documents)  # a partition
        assert parts["train"] and parts["val"] and parts["test"]
    split_a = {d.id.split("/", 1)[1]: a.split_of(d.id) for d in a.documents}
    for d in b.documents:  # the same page is in the same split in every language
        assert b.split_of(d.id) == split_a[d.id.split("/", 1)[1]]


def test_combined_corpus_keeps_splits_and_caps_train(fake_debian: Path) -> None:
    a, b = manpages.load_man_language("de"), manpages.load_man_language("fr")
    full = manpages.load_manpages(cap_bytes=None)
    assert len(full.documents) == len(a.documents) + len(b.documents)
    assert [manpages.language_of(d.id) for d in full.documents[:4]] == ["de", "fr", "de", "fr"]  # interleaved
    for d in full.documents:
        src = a if d.id.startswith("de/") else b
        assert full.split_of(d.id) == src.split_of(d.id)
    size = len(a.documents[0].text.encode())
    capped = manpages.load_manpages(cap_bytes=5 * size)
    train_a = [d for d in capped.split("train") if d.id.startswith("de/")]
    assert 1 <= len(train_a) <= 5 and sum(len(d.text.encode()) for d in train_a) <= 5 * size + 50
    for split in ("val", "test"):  # held-out documents are never capped
        assert sorted(d.id for d in capped.split(split)) == sorted(d.id for d in full.split(split))
    kept = {d.id for d in train_a}
    order = sorted((d for d in a.split("train")), key=lambda d: doc_hash(d.id))
    assert order[0].id in kept
    assert manpages.load_manpages(cap_bytes=5 * size).documents == capped.documents


def test_per_language_validation_sets_in_prepare_data(fake_debian: Path) -> None:
    cfg = DataConfig(
        corpus="manpages", tokenizer="byte", val_sets=("man-de", "man-fr"), cache_dir=str(fake_debian / "tok")
    )
    data = prepare_data(cfg, seq_len=32)
    assert set(data.val) == {"manpages", "man-de", "man-fr"}
    a_val = manpages.load_man_language("de").split("val")
    expected = sum(len(d.text.encode()) + 1 for d in a_val)  # bytes + one EOS per document
    assert len(data.val["man-de"]) == expected


def test_missing_packages_raise_with_install_command(fake_debian: Path) -> None:
    (fake_debian / "dpkg-info" / "fake-fr.list").unlink()
    with pytest.raises(CorpusUnavailableError, match="apt-get install -y fake-fr mandoc"):
        manpages.load_man_language("fr")
    with pytest.raises(CorpusUnavailableError, match="not installed: fake-fr"):
        manpages.load_manpages()
    with pytest.raises(DataError, match="unknown"):
        manpages.load_man_language("xx")


def test_registry_names_and_install_hints() -> None:
    names = corpora.registry_names()
    assert "manpages" in names and {"man-en", "man-de", "man-ja", "man-zh"} <= set(names)
    assert corpora.REGISTRY["man-de"].install == "apt-get install -y manpages-de manpages-de-dev mandoc"
    assert "manpages-zh" in corpora.REGISTRY["manpages"].install
    assert manpages.MANPAGES_VAL_SETS == tuple(f"man-{c}" for c in manpages.MANPAGES_LANGS)


def test_registry_missing_package_message(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(manpages, "DPKG_INFO", tmp_path)
    with pytest.raises(CorpusUnavailableError, match="apt-get install -y manpages-it manpages-it-dev mandoc"):
        load_corpus("man-it")


REAL_IT = manpages.missing_packages([manpages.MAN_LANGUAGES["it"]]) == [] and HAS_MANDOC


@pytest.mark.skipif(not REAL_IT, reason="apt-get install -y manpages-it manpages-it-dev mandoc")
def test_real_italian_pages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MHMOE_CACHE", str(tmp_path))
    monkeypatch.setattr(manpages, "_MEMO", {})
    it = load_corpus("man-it")
    assert len(it.documents) > 80 and all(d.id.startswith("it/man") for d in it.documents)
    assert all(it.split(s) for s in ("train", "val", "test"))
    assert not any("TRADUZIONE" in d.text.split("\n") for d in it.documents)
    assert sum(d.text.startswith("NOME\n") for d in it.documents) > 0.9 * len(it.documents)
    assert not any("\b" in d.text for d in it.documents)
