"""The ``debdocs`` corpus reader on a fake Debian installation (fixture packages), and on the real one
where its packages are installed."""

import pytest
from debdocs_fixture import BOILERPLATE, SOURCES, make_install

from mhmoe.data import debdocs
from mhmoe.data.debdocs import clean_documents, load_debdocs, missing_packages, prose_share
from mhmoe.data.documents import SPLITS, CorpusUnavailableError


@pytest.fixture
def install(tmp_path):
    return make_install(tmp_path / "root")


def test_reads_listed_files_and_cleans(install, tmp_path):
    corpus = load_debdocs(cache_dir=tmp_path / "cache", info_dir=install, sources=SOURCES, workers=1)
    ids = [d.id for d in corpus.documents]
    assert ids[:3] == ["pkga/doc00.rst.txt", "pkga/doc02.rst.txt", "pkga/doc04.rst.txt"]  # listed order is sorted
    assert "pkga/sub/doc01.rst.txt" in ids and "pkgb/page0.html" in ids and len(ids) == 24 + 8
    # excluded (translations/), symlinked, short, identifier-only and near-duplicate files are not documents
    for gone in ("translations", "link", "zz-short", "zz-api", "zz-copy", "style.css"):
        assert not any(gone in i for i in ids), gone
    text = {d.id: d.text for d in corpus.documents}
    assert all(BOILERPLATE not in t for t in text.values())  # in 24 documents: boilerplate
    assert text["pkga/doc00.rst.txt"].startswith("Chapter 0\n\nHandles ") and "====" not in text["pkga/doc00.rst.txt"]
    assert "Home" not in text["pkgb/page3.html"] and text["pkgb/page3.html"].endswith("x = 3")
    splits = corpus.splits()
    assert sorted(d.id for s in SPLITS for d in splits[s]) == sorted(ids) and all(splits[s] for s in SPLITS)


def test_cache_reused_and_rebuilt_on_change(install, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = load_debdocs(cache_dir=cache, info_dir=install, sources=SOURCES, workers=1)
    calls = []
    real = debdocs.convert_file
    monkeypatch.setattr(debdocs, "convert_file", lambda *a: calls.append(a[1]) or real(*a))
    assert load_debdocs(cache_dir=cache, info_dir=install, sources=SOURCES, workers=1) == first
    assert calls == []  # warm: read from the cache
    page = tmp_path / "root/usr/share/doc/pkgb/html/page0.html"
    page.write_text(page.read_text().replace("Page 0", "Page zero"))
    again = load_debdocs(cache_dir=cache, info_dir=install, sources=SOURCES, workers=1)
    assert [c for c in calls if "pkga" in c] == [] and len([c for c in calls if "pkgb" in c]) == 8  # pkgb only
    assert next(d.text for d in again.documents if d.id == "pkgb/page0.html").startswith("Page zero")
    assert debdocs.corpus_report(cache, install, SOURCES)["pkga"]["duplicate_docs"] == 1


def test_missing_package_names_the_install_command(install):
    (install / "pkgb.list").unlink()
    assert missing_packages(SOURCES, install) == ["pkgb"]
    with pytest.raises(CorpusUnavailableError, match=r"not installed \(pkgb\): apt-get install -y pkgb"):
        load_debdocs(info_dir=install, sources=SOURCES)


def test_clean_documents_rules():
    para = "A paragraph long enough to count for duplicates, with words in it, document number"
    rows = [{"id": f"d{i}", "text": f"{para} {i}.\n\nShared footer line.\n\n" + f"Words here {i}. " * 20}
            for i in range(5)]
    kept, report = clean_documents([("p", rows)])
    assert [r["id"] for r in kept] == ["d0", "d1", "d2", "d3", "d4"]
    assert all("Shared footer" not in r["text"] for r in kept)  # in 5 documents: boilerplate
    kept, report = clean_documents([("p", rows[:2]), ("q", [{"id": "x", "text": rows[0]["text"]}])])
    assert [r["id"] for r in kept] == ["d0", "d1"] and report["q"]["duplicate_docs"] == 1
    assert prose_share("The cat sat on the mat.") > 0.9 > 0.3 > prose_share("__a_ptr->m_1[0] = 0x0f;")


def test_real_packages_if_installed(tmp_path):
    if missing_packages():
        pytest.skip(f"debdocs packages not installed ({len(missing_packages())} missing): make system-deps")
    files = debdocs.source_files(debdocs.SOURCES[0])
    assert files and all("/translations/" not in str(f) for f in files)


def test_bpe_trains_on_a_deterministic_sample_of_a_large_split():
    from mhmoe.data.documents import Document
    from mhmoe.data.prepare import bpe_training_documents

    docs = [Document(f"d{i}", "x" * (100 + i)) for i in range(50)]
    assert bpe_training_documents(docs, max_chars=10**6) == docs  # under the budget: the whole split
    sample = bpe_training_documents(docs, max_chars=1000)
    assert 0 < sum(len(d.text) for d in sample) <= 1000 and len(sample) >= 7
    assert [d.id for d in sample] == [d.id for d in docs if d in sample]  # corpus order kept
    assert bpe_training_documents(list(reversed(docs)), max_chars=1000) == list(reversed(sample))
