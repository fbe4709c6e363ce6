"""Multilingual corpus: Debian's translated manual pages, rendered to plain text with ``mandoc``.

One registry corpus per language (``man-en``, ``man-de``, ...) and a combined training corpus
``manpages`` (every language, training splits capped per language).  Nothing is downloaded: the
pages come from installed Debian packages (``manpages``/``manpages-dev`` for English, the
``manpages-l10n`` translations ``manpages-XX``/``manpages-XX-dev``, ``manpages-ja``/``-ja-dev`` and
``manpages-zh``) and are converted by ``mandoc -T utf8`` (Debian package ``mandoc``).

* **Which files.**  Exactly the man pages that the language's packages own, read from dpkg's file
  lists (``/var/lib/dpkg/info/<package>.list``), so pages that other installed software ships in
  ``/usr/share/man/<lang>`` never leak in and the corpus depends only on the package versions.
  Symbolic links and one-line ``.so`` stubs (aliases) are skipped; one file = one page = one
  document, id ``<lang>/<section dir>/<file>`` (``de/man1/ls.1``).
* **Text.**  ``mandoc -T utf8 -O width=1000,indent=2`` (a paragraph is one line up to 1,000
  characters, body indent 2); overstrike bold/underline (``c\\bc``) removed; the page header and
  footer lines dropped; the trailing translator-credits section that every translated page ends
  with (``ÜBERSETZUNG``, ``TRADUCTION``, ``ПЕРЕВОД``, ``跋``, ...) and the Japanese colophon
  (``この文書について``) cut, since they are the same boilerplate on every page; trailing spaces
  stripped and runs of blank lines collapsed.
  Pages whose text is degenerate (zlib ratio < 0.1, i.e. roff residue, see :func:`is_degenerate`)
  are dropped.
* **Splits.**  By the page (``man1/ls.1``), not by the language's document id: a page is in the same
  split in every language, so no translation of a validation page is trained on.  The rule is
  :func:`~mhmoe.data.documents.assign_splits` (5% val, 5% test by sha256 of the page key).
* **Cache.**  Rendering all languages takes ~30 s on 2 cores; the text of each language is cached
  in ``<cache>/corpora/manpages/<lang>-<key>.jsonl.gz`` where ``key`` hashes the raw bytes of every
  page, the ``mandoc`` binary and the rendering rules, so a package upgrade or a converter change
  rebuilds it and nothing stale is ever read.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import zlib
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from mhmoe.data.documents import Corpus, CorpusUnavailableError, Document, assign_splits, doc_hash
from mhmoe.data.token_cache import default_cache_dir
from mhmoe.errors import DataError
from mhmoe.runtime.files import atomic_write, sha256_file
from mhmoe.runtime.reading import read_gzip

DPKG_INFO = Path("/var/lib/dpkg/info")
MAN_ROOT = Path("/usr/share/man")
MANDOC_OPTIONS: tuple[str, ...] = ("-T", "utf8", "-O", "width=1000,indent=2")
# Bump when the rendering or clean-up rules change (part of the cache key).
RENDER_VERSION = 4
CACHE_FORMAT = 1
# Per-language cap on the UTF-8 bytes of training documents in the combined ``manpages`` corpus.
# Bytes rather than characters: a CJK character is 3 bytes and roughly one cl100k token, a Latin
# one 1 byte and ~1/4 token, so a byte budget is closer to a token budget than a character one.
MANPAGES_TRAIN_CAP_BYTES = 4_000_000
_OVERSTRIKE = re.compile(".\x08")
_BLANK_RUN = re.compile(r"\n{3,}")
# Tables with expanding columns are stretched to the 1,000-column width: shorten rules and padding.
_RULE_RUN = re.compile(r"([─━═])\1+")
_PAD_RUN = re.compile(r"(?<=\S) {16,}")
TABLE_PAD = "    "
# A rendered page that zlib shrinks below this ratio is degenerate (median page: ~0.46; in bookworm
# only ja/man7/groff_char.7, whose low-level roff mandoc cannot run, 685 kB of ``.tr`` residue: 0.014).
MIN_ZLIB_RATIO = 0.1
_SECTION_DIR = re.compile(r"^man[0-9][0-9a-z]*$")
INSTALL_MANDOC = "apt-get install -y mandoc"
# In-process memo of loaded languages by cache file (content-addressed, so never stale): prepare_data
# loads ``manpages`` and then each ``man-XX`` validation set.
_MEMO: dict[Path, tuple[Document, ...]] = {}


@dataclass(frozen=True)
class ManLanguage:
    """One language of the multilingual corpus: its packages, man directory and boilerplate."""

    code: str  # registry suffix: ``man-<code>``
    name: str
    packages: tuple[str, ...]
    root: Path  # pages are ``<root>/man<section>/<file>.gz``
    boilerplate: tuple[str, ...] = ()  # section headings cut (with everything after them)

    @property
    def corpus_name(self) -> str:
        return f"man-{self.code}"

    @property
    def install(self) -> str:
        return "apt-get install -y " + " ".join((*self.packages, "mandoc"))


def _lang(code: str, name: str, packages: Sequence[str], subdir: str, *boilerplate: str) -> ManLanguage:
    return ManLanguage(code, name, tuple(packages), MAN_ROOT / subdir if subdir else MAN_ROOT, boilerplate)


def _l10n(code: str, name: str, subdir: str, heading: str, dev: bool = True) -> ManLanguage:
    pkg = f"manpages-{subdir.lower().replace('_', '-')}"
    return _lang(code, name, (pkg, pkg + "-dev") if dev else (pkg,), subdir, heading)


# Debian bookworm package sets.  manpages-l10n 4.18.1 for the European languages (translations of
# the Linux man-pages project, coreutils, util-linux, procps, ...), the JM project for Japanese,
# the Chinese man-pages project for Simplified Chinese (manpages-zh also ships zh_TW, a script
# conversion of the same text, which is not used).
MAN_LANGUAGES: dict[str, ManLanguage] = {
    lang.code: lang
    for lang in (
        _lang("en", "English", ("manpages", "manpages-dev"), "", "COLOPHON"),
        _l10n("de", "German", "de", "ÜBERSETZUNG"),
        _l10n("fr", "French", "fr", "TRADUCTION"),
        _l10n("es", "Spanish", "es", "TRADUCCIÓN"),
        _l10n("it", "Italian", "it", "TRADUZIONE"),
        _l10n("pt-br", "Portuguese (Brazil)", "pt_BR", "TRADUÇÃO"),
        _l10n("nl", "Dutch", "nl", "VERTALING"),
        _l10n("pl", "Polish", "pl", "TŁUMACZENIE"),
        _l10n("cs", "Czech", "cs", "PŘEKLAD"),
        _l10n("ru", "Russian", "ru", "ПЕРЕВОД"),
        _l10n("uk", "Ukrainian", "uk", "ПЕРЕКЛАД"),
        _lang("ja", "Japanese", ("manpages-ja", "manpages-ja-dev"), "ja", "この文書について"),
        _lang("zh", "Chinese (Simplified)", ("manpages-zh",), "zh_CN", "跋"),
    )
}
MANPAGES_LANGS: tuple[str, ...] = tuple(MAN_LANGUAGES)
# The per-language validation sets of the combined corpus, for ``DataConfig.val_sets``.
MANPAGES_VAL_SETS: tuple[str, ...] = tuple(f"man-{c}" for c in MANPAGES_LANGS)
ALL_PACKAGES: tuple[str, ...] = tuple(dict.fromkeys(p for lang in MAN_LANGUAGES.values() for p in lang.packages))


def _unavailable(message: str) -> DataError:

    return CorpusUnavailableError(message)


def find_mandoc() -> str | None:
    """Path of the ``mandoc`` executable, or None."""
    return shutil.which("mandoc")


def missing_packages(langs: Iterable[ManLanguage], info_dir: Path | None = None) -> list[str]:
    """The packages of ``langs`` whose dpkg file list is absent (i.e. not installed)."""
    info = info_dir or DPKG_INFO
    return [p for lang in langs for p in lang.packages if not (info / f"{p}.list").is_file()]


def page_key(lang: ManLanguage, path: Path) -> str | None:
    """``man1/ls.1`` for ``<root>/man1/ls.1.gz`` (the language-independent page name), else None."""
    try:
        rel = path.relative_to(lang.root)
    except ValueError:
        return None
    if len(rel.parts) != 2 or not _SECTION_DIR.match(rel.parts[0]) or not rel.name.endswith(".gz"):
        return None
    return f"{rel.parts[0]}/{rel.name.removesuffix('.gz')}"


def man_files(lang: ManLanguage, info_dir: Path | None = None) -> list[tuple[str, Path]]:
    """``(page key, path)`` of the language's pages owned by its packages, sorted by key.

    Symbolic links (alias pages) are skipped; a page listed by two packages is taken once.
    """
    found: dict[str, Path] = {}
    for pkg in lang.packages:
        listing = (info_dir or DPKG_INFO) / f"{pkg}.list"
        try:
            lines = listing.read_text(encoding="utf-8", errors="surrogateescape").splitlines()
        except OSError as e:
            raise _unavailable(
                f"corpus {lang.corpus_name!r}: package {pkg} not installed ({e.strerror}): {lang.install}"
            ) from None
        for line in lines:
            path = Path(line.strip())
            key = page_key(lang, path)
            if key is not None and key not in found and path.is_file() and not path.is_symlink():
                found[key] = path
    return sorted(found.items())


def is_so_stub(roff: bytes) -> bool:
    """True for an alias page whose only request is ``.so other/page.N`` (at most a few lines)."""
    lines = [ln.strip() for ln in roff.strip().splitlines() if ln.strip() and not ln.startswith((b'.\\"', b"'\\\""))]
    return len(lines) == 1 and lines[0].startswith(b".so ")


def clean_rendered(text: str, boilerplate: Sequence[str] = ()) -> str:
    """Plain text from ``mandoc -T utf8`` output (see the module docstring for the rules)."""
    text = _OVERSTRIKE.sub("", text.replace("\r\n", "\n"))
    lines = [_PAD_RUN.sub(TABLE_PAD, _RULE_RUN.sub(r"\1", ln.rstrip())) for ln in text.split("\n")]
    # header: the first block (up to the first blank line); footer: the last block
    while lines and not lines[-1]:
        lines.pop()
    if "" in lines:
        first_blank = lines.index("")
        last_blank = len(lines) - 1 - lines[::-1].index("")
        lines = lines[first_blank + 1 : last_blank]  # empty when the page has no body
    cut = set(boilerplate)
    for i, line in enumerate(lines):
        if line in cut:
            lines = lines[:i]
            break
    return _BLANK_RUN.sub("\n\n", "\n".join(lines)).strip("\n")


def is_degenerate(text: str) -> bool:
    """True for rendered text so repetitive that zlib compresses it below :data:`MIN_ZLIB_RATIO`
    (rendering garbage, not prose); texts under 2 kB are never judged."""
    data = text.encode("utf-8")
    return len(data) >= 2048 and len(zlib.compress(data, 6)) < MIN_ZLIB_RATIO * len(data)


def render_roff(roff: bytes, mandoc: str, where: str = "<roff>") -> str:
    """``mandoc -T utf8`` output of man/mdoc source ``roff`` (uncleaned); DataError on failure.

    mandoc exits 0..3 for pages with warnings or errors it could recover from; 4+ is fatal.
    """
    try:
        r = subprocess.run(
            [mandoc, *MANDOC_OPTIONS],
            input=roff,
            capture_output=True,
            timeout=60,
            env={"LC_ALL": "C.UTF-8", "PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        )
    except (OSError, subprocess.SubprocessError) as e:
        raise DataError(f"{where}: mandoc failed ({e})") from None
    if r.returncode > 3:
        err = r.stderr.decode("utf-8", "replace").strip().splitlines()[:1]
        raise DataError(f"{where}: mandoc exit status {r.returncode} ({err[0] if err else 'no message'})")
    return r.stdout.decode("utf-8", errors="replace")


def roff_to_text(roff: bytes, *, boilerplate: Sequence[str] = (), mandoc: str | None = None) -> str:
    """Render one man page (roff source bytes, not gzipped) to cleaned plain text."""
    exe = mandoc or find_mandoc()
    if exe is None:
        raise _unavailable(f"mandoc not installed (needed to render man pages): {INSTALL_MANDOC}")
    return clean_rendered(render_roff(roff, exe), boilerplate)


def _read_file(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read man page ({e.strerror})") from None


def _gunzip(data: bytes, where: str) -> bytes:
    try:
        return gzip.decompress(data)
    except (OSError, EOFError) as e:
        raise DataError(f"{where}: corrupt gzip data ({e})") from None


def _cache_key(lang: ManLanguage, pages: Sequence[tuple[str, bytes]], mandoc: str) -> str:
    h = hashlib.sha256()
    meta = {
        "format": CACHE_FORMAT,
        "render": RENDER_VERSION,
        "options": MANDOC_OPTIONS,
        "mandoc_sha256": sha256_file(mandoc),
        "lang": lang.code,
        "boilerplate": lang.boilerplate,
    }
    h.update(json.dumps(meta, sort_keys=True, ensure_ascii=False).encode())
    for key, roff in pages:
        for part in (key.encode(), roff):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
    return h.hexdigest()[:16]


def _read_cache(path: Path) -> list[Document] | None:
    """The documents of a cached ``*.jsonl.gz`` file (a FIFO or a device is never read; decompressed within
    :func:`mhmoe.runtime.reading.gzip_limit` of its size), or None when it is missing or damaged."""
    try:
        rows = read_gzip(path).decode("utf-8").splitlines()
        return [Document(str(r["id"]), str(r["text"])) for r in map(json.loads, rows)]
    except FileNotFoundError:
        return None
    except (OSError, EOFError, ValueError, KeyError, TypeError, RecursionError):
        return None  # damaged: rebuilt and replaced atomically


def _render_all(lang: ManLanguage, pages: Sequence[tuple[str, bytes]], mandoc: str) -> list[Document]:
    def one(item: tuple[str, bytes]) -> Document | None:
        key, raw = item
        roff = _gunzip(raw, f"{lang.corpus_name}:{key}")
        if is_so_stub(roff):
            return None
        text = clean_rendered(render_roff(roff, mandoc, f"{lang.corpus_name}:{key}"), lang.boilerplate)
        return Document(f"{lang.code}/{key}", text) if text.strip() and not is_degenerate(text) else None

    workers = max(1, min(8, os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:  # order-preserving: deterministic output
        docs = list(pool.map(one, pages))
    return [d for d in docs if d is not None]


def man_page_splits(keys: Sequence[str]) -> dict[str, str]:
    """``page key -> split`` by :func:`assign_splits` on the page keys (language-independent)."""
    return dict(zip(keys, assign_splits(list(keys)), strict=True))


def load_man_documents(
    lang: ManLanguage, *, info_dir: Path | None = None, cache_dir: str | os.PathLike[str] = ""
) -> list[Document]:
    """The rendered pages of ``lang``, from the cache if it matches, else rendered and cached."""
    missing = missing_packages([lang], info_dir)
    if missing:
        raise _unavailable(
            f"corpus {lang.corpus_name!r}: {lang.name} man pages not installed ({', '.join(missing)}): {lang.install}"
        )
    mandoc = find_mandoc()
    if mandoc is None:
        raise _unavailable(f"corpus {lang.corpus_name!r}: mandoc not installed: {lang.install}")
    files = man_files(lang, info_dir)
    if not files:  # e.g. a minimal image whose dpkg config excludes /usr/share/man (path-exclude)
        raise _unavailable(
            f"corpus {lang.corpus_name!r}: packages {', '.join(lang.packages)} are installed but none of their "
            f"man pages is on disk (dpkg path-exclude?): {lang.install} after removing the exclusion"
        )
    pages = [(key, _read_file(path)) for key, path in files]  # gzipped; the key hashes these bytes
    cache = default_cache_dir(cache_dir) / "corpora" / "manpages" / f"{lang.code}-{_cache_key(lang, pages, mandoc)}"
    cache = cache.with_suffix(".jsonl.gz")
    docs = _MEMO.get(cache) or _read_cache(cache)
    if docs is None:
        docs = _render_all(lang, pages, mandoc)
        if not docs:
            raise DataError(f"corpus {lang.corpus_name!r}: no text rendered from {len(pages)} pages")
        body = "".join(json.dumps({"id": d.id, "text": d.text}, ensure_ascii=False) + "\n" for d in docs)
        atomic_write(cache, gzip.compress(body.encode("utf-8"), compresslevel=6, mtime=0))
    _MEMO[cache] = docs = tuple(docs)
    return list(docs)


def _key_of(doc_id: str) -> str:
    return doc_id.split("/", 1)[1]


def load_man_language(code: str, *, info_dir: Path | None = None, cache_dir: str | os.PathLike[str] = "") -> Corpus:
    """Registry corpus ``man-<code>``: every page of one language, split by page key."""
    lang = MAN_LANGUAGES.get(code)  # looked up at call time (tests substitute languages)
    if lang is None:
        raise DataError(f"man page language {code!r}: unknown, expected one of {', '.join(MAN_LANGUAGES)}")
    return language_corpus(lang, load_man_documents(lang, info_dir=info_dir, cache_dir=cache_dir))


def language_corpus(lang: ManLanguage, docs: Sequence[Document]) -> Corpus:
    """A one-language corpus whose split table comes from the page keys."""
    splits = man_page_splits([_key_of(d.id) for d in docs])
    fixed = {d.id: splits[_key_of(d.id)] for d in docs if splits[_key_of(d.id)] != "train"}
    source = f"debian {'+'.join(lang.packages)} via mandoc"
    return Corpus(name=lang.corpus_name, source=source, documents=tuple(docs), fixed_splits=fixed)


def _split_table(corpus: Corpus) -> dict[str, str]:
    """``doc id -> split`` of ``corpus`` (``Corpus.split_of`` is a linear scan)."""
    return {d.id: name for name, docs in corpus.splits().items() for d in docs}


def cap_train(docs: Sequence[Document], corpus: Corpus, cap_bytes: int) -> list[Document]:
    """``corpus``'s val/test documents plus its train documents up to ``cap_bytes`` UTF-8 bytes.

    Train documents are taken in order of :func:`doc_hash` of their id (a fixed pseudo-random
    order) while the budget lasts; kept documents stay in corpus order.
    """
    split = _split_table(corpus)
    train = [d for d in docs if split[d.id] == "train"]
    keep, used = set(), 0
    for d in sorted(train, key=lambda d: (doc_hash(d.id), d.id)):
        size = len(d.text.encode("utf-8"))
        if used + size > cap_bytes and used > 0:
            continue
        keep.add(d.id)
        used += size
    return [d for d in docs if split[d.id] != "train" or d.id in keep]


def combine(corpora: Sequence[Corpus], *, name: str = "manpages", cap_bytes: int | None = None) -> Corpus:
    """Interleave language corpora (round-robin by document, so a prefix of any split mixes all
    languages) keeping every document's split; ``cap_bytes`` caps each language's train split."""
    lists = [cap_train(c.documents, c, cap_bytes) if cap_bytes else list(c.documents) for c in corpora]
    tables = [_split_table(c) for c in corpora]
    fixed = {d.id: t[d.id] for t, docs in zip(tables, lists, strict=True) for d in docs if t[d.id] != "train"}
    merged = [docs[i] for i in range(max(map(len, lists), default=0)) for docs in lists if i < len(docs)]
    source = "; ".join(c.source for c in corpora)
    return Corpus(name=name, source=source, documents=tuple(merged), fixed_splits=fixed)


def load_manpages(
    langs: Sequence[str] | None = None,
    *,
    cap_bytes: int | None = MANPAGES_TRAIN_CAP_BYTES,
    info_dir: Path | None = None,
    cache_dir: str | os.PathLike[str] = "",
) -> Corpus:
    """Registry corpus ``manpages``: ``langs`` (default all), train splits capped at ``cap_bytes`` each.

    Every language must be installed (a partial mix would silently change the corpus): otherwise
    :class:`~mhmoe.data.corpora.CorpusUnavailableError` lists the missing packages.
    """
    langs = MANPAGES_LANGS if langs is None else tuple(langs)
    chosen = [MAN_LANGUAGES[c] for c in langs]
    missing = missing_packages(chosen, info_dir)
    if missing or find_mandoc() is None:
        need = [*missing, *(["mandoc"] if find_mandoc() is None else [])]
        raise _unavailable(
            f"corpus 'manpages': not installed: {' '.join(need)}: apt-get install -y {' '.join(need)} "
            f"(or: bash scripts/install-system-deps.sh)"
        )
    parts = [load_man_language(c, info_dir=info_dir, cache_dir=cache_dir) for c in langs]
    return combine(parts, name="manpages", cap_bytes=cap_bytes)


def language_of(doc_id: str) -> str:
    """The language code of a ``manpages``/``man-XX`` document id (``de/man1/ls.1`` -> ``de``)."""
    return doc_id.split("/", 1)[0]
