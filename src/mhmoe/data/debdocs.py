"""``debdocs``: an English training corpus of ~150 MB of text from Debian documentation packages.

Nothing is downloaded: the text comes from the Debian bookworm ``main`` packages in :data:`SOURCES`
(``make system-deps`` installs them), read through dpkg's own file lists
(``/var/lib/dpkg/info/<package>.list``), never by scanning directories.

* **Which files.** Per package, the listed regular files (no symlinks) whose path matches the source's
  ``include`` pattern and not its ``exclude`` pattern: documentation sources where the package ships
  them (reST ``_sources``, POD, Markdown, Vim help), else its HTML in English only (translations,
  API member indexes, search/index pages and duplicate "print" versions excluded).
* **Text.** :mod:`mhmoe.data.doctext` converts each file (HTML through ``html.parser``, inside the
  page's content element, without navigation); code blocks longer than :data:`MAX_CODE_LINES` lines
  are dropped, shorter ones kept (a minor share, see docs/DATA.md). One file = one document, id
  ``<package>/<path below the package's common directory>``.
* **Clean-up**, in corpus order (:func:`clean_documents`): a paragraph found in
  :data:`BOILERPLATE_MIN_DOCS` or more documents of the same package is boilerplate and removed from
  all of them (navigation lines, licence footers, "new in version" notes); documents shorter than
  :data:`MIN_DOC_CHARS` characters, or whose plain-word share is below :data:`MIN_PROSE_SHARE` (API
  indexes that are mostly identifiers), are dropped; a document whose paragraphs (of 40+ characters)
  have mostly, :data:`NEAR_DUP_SHARE` of their characters, appeared in earlier documents is a near
  duplicate and dropped.
* **Splits.** :func:`~mhmoe.data.documents.assign_splits` on the document id (5% val, 5% test).
* **Cache.** Converting every file takes minutes; each package's documents are cached in
  ``<cache>/corpora/debdocs/<package>-<key>.jsonl.gz`` (``key``: the rules' version, the source's
  settings and the path, size and mtime of every file read), the cleaned corpus in
  ``debdocs-<key>.jsonl.gz`` (``key``: the packages' keys), so a package upgrade or a rule change
  rebuilds what it affects and nothing stale is read.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path

from mhmoe.data.doctext import Text, html_to_text, markdown_to_text, pod_to_text, rst_to_text
from mhmoe.data.documents import Corpus, CorpusUnavailableError, Document, decode_text
from mhmoe.data.token_cache import default_cache_dir
from mhmoe.errors import DataError
from mhmoe.runtime.files import atomic_write
from mhmoe.runtime.reading import read_gzip

DPKG_INFO = Path("/var/lib/dpkg/info")
RULES_VERSION = 1  # bump when a converter or a clean-up rule changes (part of every cache key)
MAX_CODE_LINES = 8
MIN_DOC_CHARS = 200
MIN_PROSE_SHARE = 0.55
BOILERPLATE_MIN_DOCS = 5
NEAR_DUP_SHARE = 0.8
NEAR_DUP_MIN_PARA = 40
MAX_FILE_BYTES = 64 << 20  # a documentation file larger than this is not read
_WORD = re.compile(r"\b[A-Za-z][a-z]*\b")
_PARA = re.compile(r"\n\s*\n")
FORMATS = ("rst", "pod", "md", "txt", "html")


@dataclass(frozen=True)
class Source:
    """One Debian package of the corpus: which of its files are read and how they are converted."""

    package: str
    fmt: str  # rst | pod | md | txt | html
    include: str  # regex searched in each listed path
    exclude: str = ""  # regex; a matching path is left out
    root: str = ""  # html: the content element (doctext selector)
    skip: tuple[str, ...] = ()  # html: elements left out
    licence: str = ""  # from /usr/share/doc/<package>/copyright
    what: str = ""


_SPHINX_SKIP = (".headerlink",)
_DOCBOOK_SKIP = (".navheader", ".navfooter", ".NAVHEADER", ".NAVFOOTER")
_TEXI_SKIP = (".header", ".nav-panel", ".contents")
SOURCES: tuple[Source, ...] = (
    Source("linux-doc-6.1", "rst", r"/html/_sources/.*\.rst\.txt$", r"/_sources/translations/",
           licence="GPL-2", what="Linux kernel documentation (reST sources)"),
    Source("perl-doc", "pod", r"\.pod$", licence="GPL-1+ or Artistic", what="Perl manuals (POD)"),
    Source("vim-runtime", "txt", r"/doc/[^/]+\.txt$", licence="Vim", what="Vim help files"),
    Source("llvm-14-doc", "rst", r"/_sources/.*\.rst\.txt$", licence="Apache-2.0 with LLVM exception",
           what="LLVM documentation (reST sources)"),
    Source("clang-14-doc", "rst", r"/_sources/.*\.rst\.txt$", licence="Apache-2.0 with LLVM exception",
           what="Clang documentation (reST sources)"),
    Source("cmake-doc", "rst", r"/_sources/.*\.rst\.txt$", licence="BSD-3-clause",
           what="CMake documentation (reST sources)"),
    Source("python-sqlalchemy-doc", "rst", r"\.rst$", licence="Expat", what="SQLAlchemy documentation (reST)"),
    Source("sphinx-doc", "rst", r"/_sources/.*\.rst\.txt$", licence="BSD-2-clause",
           what="Sphinx documentation (reST sources)"),
    Source("debian-policy", "rst", r"/_sources/.*\.rst\.txt$", licence="GPL-2+",
           what="Debian Policy Manual (reST sources)"),
    Source("ghc-doc", "rst", r"/html/(users_guide|haddock)/_sources/.*\.txt$", r"/\.build-html/",
           licence="BSD-3-clause", what="GHC User's Guide, Haddock manual (reST sources)"),
    Source("nodejs-doc", "md", r"/api/[^/]+\.md(\.gz)?$", licence="Expat", what="Node.js API docs (Markdown)"),
    Source("postgresql-doc-15", "html", r"/html/[^/]+\.html$", r"/(bookindex|index)\.html$", "body",
           _DOCBOOK_SKIP, "PostgreSQL", "PostgreSQL 15 manual"),
    Source("git-doc", "html", r"\.html$", "", "div#content", ("div#footer",), "GPL-2", "Git manuals"),
    Source("python-django-doc", "html", r"/html/.*\.html$", r"/html/(genindex|py-modindex|search|_modules)",
           "div.yui-g", _SPHINX_SKIP, "BSD-3-clause", "Django documentation"),
    Source("rust-doc", "html",
           r"/html/(book|reference|nomicon|rust-by-example|edition-guide|embedded-book|rustc|rustdoc|"
           r"unstable-book)/.*\.html$", r"/(print|toc|404)\.html$|/(first|second)-edition/|/2018-edition/",
           "main", (".nav-wrapper", ".nav-wide-wrapper"), "MIT or Apache-2.0", "Rust books and guides"),
    Source("qtbase5-doc-html", "html", r"\.html$", r"-(members|obsolete)\.html$", "div.mainContent",
           (".sidebar", ".toc", ".navigationbar"), "GFDL-1.3 (no invariant sections)", "Qt 5 base documentation"),
    Source("sqlite3-doc", "html", r"\.html$", "", "body", (".nosearch", ".menu"), "public-domain",
           "SQLite documentation"),
    Source("erlang-doc", "html", r"\.html$", "", "div#content", (".footer",), "Apache-2.0",
           "Erlang/OTP documentation"),
    Source("racket-doc", "html", r"\.html$", "", "div.maincolumn", (".navsettop", ".navsetbottom", ".tocset"),
           "LGPL-2.1+ or MIT", "Racket documentation"),
    Source("lilypond-doc-html", "html", r"/Documentation/[^/]+/[^/.]+\.html$", r"/(internals|snippets)/",
           "body", (".nav_table", "div.header", "div.footer", ".navigation", ".contents"), "GFDL-1.3+",
           "LilyPond manuals (English)"),
    Source("libreoffice-help-en-us", "html", r"/en-US/.*\.html$", "", "div#DisplayArea", (), "MPL-2.0",
           "LibreOffice help (English)"),
    Source("maxima-doc", "html", r"\.html$", "", "body", _TEXI_SKIP, "GPL-2", "Maxima manual"),
    Source("octave-doc", "html", r"octave\.html/.*\.html$", "", "body", _TEXI_SKIP, "GPL-3+", "GNU Octave manual"),
    Source("apache2-doc", "html", r"/manual/en/.*\.html$", "", "div#page-content",
           ("div.toplang", "div.bottomlang", "div#quickview", "div#footer"), "Apache-2.0",
           "Apache HTTP Server manual (English)"),
    Source("gimp-help-en", "html", r"/help/en/.*\.html$", "", "body", _DOCBOOK_SKIP, "GFDL-1.2+ (no invariant "
           "sections)", "GIMP user manual (English)"),
    Source("zsh-doc", "html", r"\.html$", "", "body", _TEXI_SKIP, "Zsh", "Zsh manual"),
    Source("postfix-doc", "html", r"\.html$", "", "body", (), "IPL-1.0 or EPL-2.0", "Postfix documentation"),
    Source("bind9-doc", "html", r"\.html$", "", "div.document", _SPHINX_SKIP, "MPL-2.0",
           "BIND 9 Administrator Reference Manual"),
    Source("wireshark-doc", "html", r"\.html$", "", "body", _DOCBOOK_SKIP, "GPL-2+",
           "Wireshark user's and developer's guides"),
    Source("debian-handbook", "html", r"/html/en-US/.*\.html$", "", "body", ("div#banner", *_DOCBOOK_SKIP),
           "GPL-2+ or CC-BY-SA-3.0", "The Debian Administrator's Handbook (English)"),
    Source("debian-reference-en", "html", r"\.html$", "", "body", _DOCBOOK_SKIP, "GPL-2+", "Debian Reference"),
    Source("developers-reference", "html", r"\.html$", "", "div.body", _SPHINX_SKIP, "GPL-2",
           "Debian Developer's Reference"),
    Source("abs-guide", "html", r"\.html$", "", "body", _DOCBOOK_SKIP, "public-domain",
           "Advanced Bash-Scripting Guide"),
    Source("debian-edu-doc-en", "html", r"\.html$", "", "body", (), "GPL-2+", "Debian Edu manual (English)"),
    Source("kicad-doc-en", "html", r"/en/.*\.html$", "", "body", ("div#toc",), "GPL-3+",
           "KiCad manuals (English)"),
    Source("openjdk-17-doc", "html", r"/api/.*\.html$",
           r"(-summary|-tree|-use|index-all|allclasses|allpackages|overview-|serialized-form|deprecated-list|"
           r"constant-values|/class-use/|/index-files/)", "main",
           (".sub-nav", ".summary", ".member-summary", ".inheritance", ".type-signature"),
           "GPL-2 with Classpath exception", "Java SE 17 API specification (class and package pages)"),
    Source("cppreference-doc-en-html", "html", r"/en/.*\.html$", "", "div#mw-content-text",
           (".t-navbar", "table.t-dcl-begin"), "CC-BY-SA-3.0 or GFDL", "cppreference C and C++ reference (2017)"),
    Source("ada-reference-manual-2012", "html", r"/arm2012\.html/.*\.html$", "", "body", ("div.paranum",),
           "ARM licence (copy and distribute)", "Ada 2012 Reference Manual (not the annotated edition)"),
)
PACKAGES: tuple[str, ...] = tuple(s.package for s in SOURCES)
INSTALL = "apt-get install -y " + " ".join(PACKAGES) + "  (or: make system-deps)"


def missing_packages(sources: Sequence[Source] | None = None, info_dir: Path | None = None) -> list[str]:
    """The packages of ``sources`` (default :data:`SOURCES`) whose dpkg file list is absent (not installed)."""
    info = info_dir or DPKG_INFO
    sources = SOURCES if sources is None else sources
    return [s.package for s in sources if not (info / f"{s.package}.list").is_file()]


def source_files(src: Source, info_dir: Path | None = None) -> list[Path]:
    """The files of ``src`` (see the module docstring), sorted."""
    listing = (info_dir or DPKG_INFO) / f"{src.package}.list"
    try:
        lines = listing.read_text(encoding="utf-8", errors="surrogateescape").splitlines()
    except OSError as e:
        raise CorpusUnavailableError(f"corpus 'debdocs': package {src.package} not installed ({e.strerror}): "
                                     f"apt-get install -y {src.package}") from None
    inc, exc = re.compile(src.include), re.compile(src.exclude) if src.exclude else None
    out = set()
    for line in lines:
        path = line.strip()
        if inc.search(path) and not (exc and exc.search(path)):
            p = Path(path)
            if not p.is_symlink() and p.is_file():
                out.add(p)
    return sorted(out)


def convert_file(fmt: str, path: str, root: str = "", skip: tuple[str, ...] = ()) -> Text:
    """One file's text (gunzipped if ``*.gz``); DataError for unreadable or oversized files."""
    try:
        if os.path.getsize(path) > MAX_FILE_BYTES:
            raise DataError(f"{path}: larger than {MAX_FILE_BYTES >> 20} MiB, not a documentation page")
        data = Path(path).read_bytes()
        if path.endswith(".gz"):
            with gzip.GzipFile(fileobj=io.BytesIO(data)) as f:
                data = f.read(MAX_FILE_BYTES + 1)
            if len(data) > MAX_FILE_BYTES:
                raise DataError(f"{path}: unpacks to more than {MAX_FILE_BYTES >> 20} MiB")
    except (OSError, EOFError) as e:
        raise DataError(f"{path}: cannot read ({e})") from None
    text = decode_text(data.replace(b"\0", b""), path) if fmt != "html" else data.decode("utf-8", "replace")
    if fmt == "html":
        return html_to_text(text, root, skip, MAX_CODE_LINES)
    if fmt == "rst":
        return rst_to_text(text, MAX_CODE_LINES)
    if fmt == "pod":
        return pod_to_text(text, MAX_CODE_LINES)
    if fmt == "md":
        return markdown_to_text(text, MAX_CODE_LINES)
    return Text(text.strip())


def _convert_job(job: tuple[str, str, str, tuple[str, ...]]) -> tuple[str, int, int]:
    t = convert_file(*job)
    return t.text, t.code_chars, t.dropped_code_chars


def _doc_ids(src: Source, files: Sequence[Path]) -> list[str]:
    base = os.path.commonpath([str(f.parent) for f in files]) if files else ""
    return [f"{src.package}/{os.path.relpath(f, base).removesuffix('.gz')}" for f in files]


def _package_key(src: Source, files: Sequence[Path]) -> str:
    h = hashlib.sha256(json.dumps([RULES_VERSION, MAX_CODE_LINES, asdict(src)]).encode())
    for f in files:
        st = f.stat()
        h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()[:16]


def read_cache(path: Path) -> list[dict] | None:
    """Rows of a cached ``*.jsonl.gz`` file, or None if it is missing or damaged (then rebuilt): a FIFO or a
    device there is never read, and it is decompressed within :func:`mhmoe.runtime.reading.gzip_limit` of
    its size."""
    try:
        return [json.loads(row) for row in read_gzip(path).decode("utf-8").splitlines()]
    except (OSError, EOFError, ValueError, RecursionError):
        return None


def write_cache(path: Path, rows: Sequence[dict], root: Path) -> None:
    body = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")
    atomic_write(path, gzip.compress(body, compresslevel=6, mtime=0), root=root)


def _convert_all(jobs: list[tuple], progress: Callable[[int], None], workers: int) -> list[tuple[str, int, int]]:
    """Convert in ``workers`` forked processes (html.parser is pure Python: threads would not help; fork,
    not spawn, so that a caller's script is not re-imported), serially for few files or off Linux."""
    import multiprocessing

    if workers <= 1 or len(jobs) < 64 or "fork" not in multiprocessing.get_all_start_methods():
        out = []
        for job in jobs:
            out.append(_convert_job(job))
            progress(1)
        return out
    out = []
    with ProcessPoolExecutor(workers, mp_context=get_context("fork")) as pool:
        for res in pool.map(_convert_job, jobs, chunksize=16):
            out.append(res)
            progress(1)
    return out


def package_documents(src: Source, cache: Path, *, info_dir: Path | None = None, bar=None,
                      workers: int = 1) -> tuple[list[dict], str]:
    """The converted (not yet cleaned) documents of one package as rows ``{id, text, code, dropped_code}``
    and the package's cache key; from the cache when it matches."""
    files = source_files(src, info_dir)
    key = _package_key(src, files)
    path = cache / f"{src.package}-{key}.jsonl.gz"
    rows = read_cache(path)
    if rows is None:
        jobs = [(src.fmt, str(f), src.root, src.skip) for f in files]
        tick = bar.update if bar is not None else (lambda n: None)
        if bar is not None:
            bar.set_postfix_str(src.package)
        texts = _convert_all(jobs, tick, workers)
        rows = [{"id": i, "text": t, "code": c, "dropped_code": d}
                for i, (t, c, d) in zip(_doc_ids(src, files), texts, strict=True) if t.strip()]
        write_cache(path, rows, cache.parent.parent)
    elif bar is not None:
        bar.update(len(files))
    return rows, key


def prose_share(text: str) -> float:
    """Characters of plain words (``Word``, ``word``) over non-space characters: ~0.8 for prose, below
    0.5 for identifier lists and tables of operands."""
    nonspace = len(text) - text.count(" ") - text.count("\n")
    return sum(len(w) for w in _WORD.findall(text)) / max(nonspace, 1)


def _norm(para: str) -> bytes:
    return hashlib.blake2b(" ".join(para.split()).lower().encode("utf-8"), digest_size=8).digest()


def clean_documents(rows_by_package: Sequence[tuple[str, Sequence[dict]]]) -> tuple[list[dict], dict]:
    """Boilerplate, short, identifier-heavy and near-duplicate documents out (module docstring);
    returns the kept rows (in order) and counts of what was removed per package."""
    kept: list[dict] = []
    seen: set[bytes] = set()
    report: dict[str, dict[str, int]] = {}
    for package, rows in rows_by_package:
        stats = Counter()
        paras = [[p for p in _PARA.split(r["text"]) if p.strip()] for r in rows]
        counts = Counter(h for ps in paras for h in {_norm(p) for p in ps})
        common = {h for h, n in counts.items() if n >= BOILERPLATE_MIN_DOCS}
        for row, ps in zip(rows, paras, strict=True):
            keep = [(p, h) for p in ps if (h := _norm(p)) not in common]
            stats["boilerplate_chars"] += sum(len(p) for p in ps) - sum(len(p) for p, _ in keep)
            text = "\n\n".join(p for p, _ in keep)
            if len(text) < MIN_DOC_CHARS:
                stats["short_docs"] += 1
                continue
            if prose_share(text) < MIN_PROSE_SHARE:
                stats["identifier_docs"] += 1
                stats["identifier_chars"] += len(text)
                continue
            long_paras = [(len(p), h) for p, h in keep if len(p) >= NEAR_DUP_MIN_PARA]
            total = sum(n for n, _ in long_paras)
            if total and sum(n for n, h in long_paras if h in seen) >= NEAR_DUP_SHARE * total:
                stats["duplicate_docs"] += 1
                stats["duplicate_chars"] += len(text)
                continue
            seen.update(h for _, h in long_paras)
            kept.append({**row, "text": text, "code": min(row.get("code", 0), len(text))})
        report[package] = dict(stats)
    return kept, report


def load_debdocs(*, cache_dir: str | os.PathLike[str] = "", progress: bool = False, info_dir: Path | None = None,
                 sources: Sequence[Source] | None = None, workers: int | None = None) -> Corpus:
    """Registry corpus ``debdocs``: every package of ``sources`` (default :data:`SOURCES`) must be
    installed (a partial mix would silently change the corpus), else :class:`CorpusUnavailableError`
    lists the missing ones. ``workers``: processes converting files (default: the CPUs, at most 8)."""
    sources = SOURCES if sources is None else sources
    missing = missing_packages(sources, info_dir)
    if missing:
        raise CorpusUnavailableError(f"corpus 'debdocs': {len(missing)} Debian packages not installed "
                                     f"({' '.join(missing)}): apt-get install -y {' '.join(missing)} "
                                     f"(or: make system-deps)")
    cache = default_cache_dir(cache_dir) / "corpora" / "debdocs"
    final = _final_path(cache_dir, info_dir, sources)
    rows = read_cache(final)
    if rows is None:
        n_files = sum(len(source_files(s, info_dir)) for s in sources)
        rows = _build(sources, cache, info_dir, n_files, progress, workers)
        write_cache(final, rows, cache.parent.parent)
    docs = tuple(Document(str(r["id"]), str(r["text"])) for r in rows if "id" in r)
    if not docs:
        raise DataError("corpus 'debdocs': no documents")
    return Corpus(name="debdocs", source="debian " + "+".join(s.package for s in sources), documents=docs)


def _build(sources: Sequence[Source], cache: Path, info_dir: Path | None, n_files: int, progress: bool,
           workers: int | None) -> list[dict]:
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=n_files, desc="debdocs: convert", unit="file")
    workers = workers if workers is not None else max(1, min(8, os.cpu_count() or 1))
    try:
        per_package = [(s.package, package_documents(s, cache, info_dir=info_dir, bar=bar, workers=workers)[0])
                       for s in sources]
    finally:
        if bar is not None:
            bar.close()
    kept, report = clean_documents(per_package)
    return [*kept, {"report": report}]


def _final_path(cache_dir: str | os.PathLike[str], info_dir: Path | None, sources: Sequence[Source]) -> Path:
    cache = default_cache_dir(cache_dir) / "corpora" / "debdocs"
    keys = [_package_key(s, source_files(s, info_dir)) for s in sources]
    return cache / f"debdocs-{hashlib.sha256(' '.join(keys).encode()).hexdigest()[:16]}.jsonl.gz"


def cached_rows(cache_dir: str | os.PathLike[str] = "", info_dir: Path | None = None,
                sources: Sequence[Source] | None = None) -> list[dict]:
    """The cached cleaned corpus as rows: documents ``{id, text, code, dropped_code}`` (``code``: characters
    of kept code blocks) and a last ``{report}`` row of what the clean-up removed per package ([] if not built)."""
    return read_cache(_final_path(cache_dir, info_dir, SOURCES if sources is None else sources)) or []


def corpus_report(cache_dir: str | os.PathLike[str] = "", info_dir: Path | None = None,
                  sources: Sequence[Source] | None = None) -> dict:
    """What the clean-up removed per package (from the cached corpus; {} if not built)."""
    return next((r["report"] for r in cached_rows(cache_dir, info_dir, sources) if "report" in r), {})
