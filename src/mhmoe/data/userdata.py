"""User corpora from a path: a text file, a directory, a ``.jsonl`` file or a ``.parquet`` file.

Documents:

* directory -> every ``*.txt``/``*.md``/``*.rst`` file below it (recursively, sorted by relative
  path) is one document, id = relative path; empty files are skipped;
* ``.jsonl`` -> one document per row (string field ``field``, default ``text``), id = row number;
* ``.parquet`` -> one document per row of column ``field`` (needs ``pyarrow``);
* any other file -> plain UTF-8 text, cut by :func:`~mhmoe.data.documents.chunk_text` into
  ~4 KB documents at blank-line paragraph breaks, id = chunk number.

Every problem raises :class:`~mhmoe.errors.DataError` naming the file (and line/row) at fault.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from mhmoe.data.documents import Corpus, Document, chunk_text, decode_text, read_data_file, read_text_file
from mhmoe.errors import DataError

TEXT_SUFFIXES: tuple[str, ...] = (".txt", ".md", ".rst")
PYARROW_INSTALL = "pip install pyarrow  (or: pip install 'mhmoe[parquet]')"


def _corpus(path: Path, field: str, docs: list[Document], kind: str) -> Corpus:
    if not docs:
        raise DataError(f"{path}: no text found (empty {kind})")
    ident = f"{path.resolve()}|{kind}|{field}".encode()
    key = f"{path.stem or 'corpus'}-{hashlib.sha256(ident).hexdigest()[:10]}"
    return Corpus(name=path.stem or path.name, source=str(path), documents=tuple(docs), key=key)


def load_text_file(path: Path) -> Corpus:
    """A single UTF-8 text file, chunked into ~4 KB documents at paragraph breaks."""
    text = read_text_file(path)
    if not text.strip():
        raise DataError(f"{path}: empty file (no text)")
    docs = [Document(f"{i:06d}", chunk) for i, chunk in enumerate(chunk_text(text))]
    return _corpus(path, "", docs, "text file")


def load_directory(path: Path) -> Corpus:
    """Every ``*.txt``/``*.md``/``*.rst`` file below ``path`` is one document."""
    files = sorted(
        (p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES),
        key=lambda p: p.relative_to(path).as_posix(),
    )
    if not files:
        raise DataError(f"{path}: directory has no {'/'.join('*' + s for s in TEXT_SUFFIXES)} files")
    docs = []
    for f in files:
        text = read_text_file(f).strip()
        if text:
            docs.append(Document(f.relative_to(path).as_posix(), text))
    if not docs:
        raise DataError(f"{path}: all {len(files)} text files in the directory are empty")
    return _corpus(path, "", docs, "directory")


def load_jsonl(path: Path, field: str = "text") -> Corpus:
    """One document per JSON line, text in string field ``field``; blank lines and empty texts skipped."""
    raw = read_data_file(path)  # a regular file (a FIFO or a device is refused, never read)
    if not raw.strip():
        raise DataError(f"{path}: empty file (no rows)")
    docs = []
    for lineno, line in enumerate(decode_text(raw, str(path)).split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
        except RecursionError:
            raise DataError(f"{path}:{lineno}: JSON nested too deeply") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}:{lineno}: expected a JSON object per line, got {type(row).__name__}")
        if field not in row:
            keys = ", ".join(sorted(map(str, row))[:10]) or "none"
            raise DataError(f"{path}:{lineno}: field {field!r} missing (row has keys: {keys})")
        _add_text(docs, row[field], f"{lineno:09d}", f"{path}:{lineno}: field {field!r}")
    return _corpus(path, field, docs, "jsonl file")


def _add_text(docs: list[Document], value: object, doc_id: str, where: str) -> None:
    """Append ``value`` as a document (normalised newlines, stripped; empty skipped); non-strings
    are a DataError naming ``where``."""
    if not isinstance(value, str):
        raise DataError(f"{where} is {type(value).__name__}, expected a string")
    text = value.replace("\r\n", "\n").strip()
    if text:
        docs.append(Document(doc_id, text))


def load_parquet(path: Path, field: str = "text") -> Corpus:
    """One document per row of string column ``field`` (``pyarrow`` required)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading .parquet needs pyarrow: {PYARROW_INSTALL}") from None
    try:
        pf = pq.ParquetFile(path)
        names = pf.schema_arrow.names
        if field not in names:
            raise DataError(f"{path}: column {field!r} missing (columns: {', '.join(names[:10]) or 'none'})")
        column = pf.read(columns=[field]).column(field)
    except DataError:
        raise
    except Exception as e:  # pyarrow raises several unrelated types for corrupt files
        raise DataError(f"{path}: cannot read parquet ({type(e).__name__}: {e})") from None
    docs = []
    for i, value in enumerate(column.to_pylist()):
        if value is not None:
            _add_text(docs, value, f"{i:09d}", f"{path}: row {i}: column {field!r}")
    return _corpus(path, field, docs, "parquet file")


def load_path_corpus(path: Path, *, field: str = "text") -> Corpus:
    """Dispatch on what ``path`` is: directory, ``.jsonl``, ``.parquet`` or a text file."""
    if not path.exists():
        raise DataError(f"{path}: no such file or directory")
    if path.is_dir():
        return load_directory(path)
    if not path.is_file():
        raise DataError(f"{path}: not a regular file or directory")
    if path.stat().st_size == 0:
        raise DataError(f"{path}: empty file (0 bytes)")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return load_jsonl(path, field)
    if suffix == ".parquet":
        return load_parquet(path, field)
    return load_text_file(path)
