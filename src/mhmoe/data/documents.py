"""Documents, corpora and the deterministic document-level train/val/test split.

A corpus is an ordered tuple of :class:`Document` (an id and its text).  Splits are always made
*by document*, never by lines: a document goes wholly to one of ``train``, ``val`` or ``test``.

Split rule (:func:`assign_splits`): ``bucket = int(sha256(doc_id)[:16], 16) % 100``;
``bucket < val_percent`` -> ``val``, ``bucket < val_percent + test_percent`` -> ``test``, else
``train``.  A corpus may instead carry a fixed ``doc id -> split`` table (KJV holds out named books).
When there are >= 2 documents, ``train`` and ``val`` are never empty (and ``test`` is never empty
with >= 3 documents): an empty split takes, from the largest split, the document with the smallest
hash value, so the repair is deterministic too.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from mhmoe.errors import DataError
from mhmoe.runtime.bounded import BoundedLoadError
from mhmoe.runtime.reading import open_regular, read_gzip

SPLITS: tuple[str, ...] = ("train", "val", "test")
DEFAULT_VAL_PERCENT = 5
DEFAULT_TEST_PERCENT = 5
TEXT_CHUNK_CHARS = 4096
_BLANK_LINE = re.compile(r"\n[ \t]*\n")



class CorpusUnavailableError(DataError):
    """A registry corpus whose providing package is not installed (the message carries the install command)."""


@dataclass(frozen=True)
class Document:
    """One document: a stable id (unique within its corpus) and its text."""

    id: str
    text: str


@dataclass(frozen=True)
class Corpus:
    """An ordered collection of documents with a deterministic document-level split.

    ``name`` is the registry name (``kjv``) or a short name derived from a user path; ``key`` is a
    file-system-safe cache key; ``source`` says where the text came from.  ``fixed_splits`` maps doc
    ids to ``val``/``test`` (all other documents are ``train``) and overrides the hash rule.
    """

    name: str
    source: str
    documents: tuple[Document, ...]
    key: str = ""
    fixed_splits: Mapping[str, str] | None = None
    val_percent: int = DEFAULT_VAL_PERCENT
    test_percent: int = DEFAULT_TEST_PERCENT
    _assignment: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.key:
            object.__setattr__(self, "key", self.name)
        if self.fixed_splits is not None:
            object.__setattr__(self, "fixed_splits", MappingProxyType(dict(self.fixed_splits)))
            assignment = [self.fixed_splits.get(d.id, "train") for d in self.documents]
        else:
            assignment = assign_splits(
                [d.id for d in self.documents], val_percent=self.val_percent, test_percent=self.test_percent
            )
        object.__setattr__(self, "_assignment", tuple(assignment))

    @property
    def n_chars(self) -> int:
        """Total number of characters over all documents."""
        return sum(len(d.text) for d in self.documents)

    def split_of(self, doc_id: str) -> str:
        """The split (``train``/``val``/``test``) that document ``doc_id`` belongs to."""
        for doc, split in zip(self.documents, self._assignment, strict=True):
            if doc.id == doc_id:
                return split
        raise KeyError(doc_id)

    def split(self, name: str) -> list[Document]:
        """The documents of split ``name`` in corpus order."""
        if name not in SPLITS:
            raise DataError(f"split {name!r}: unknown, expected one of {', '.join(SPLITS)}")
        return [d for d, s in zip(self.documents, self._assignment, strict=True) if s == name]

    def splits(self) -> dict[str, list[Document]]:
        """All three splits, ``{"train": [...], "val": [...], "test": [...]}``."""
        return {name: self.split(name) for name in SPLITS}


def doc_hash(doc_id: str) -> int:
    """A stable 64-bit hash of a document id (first 16 hex digits of its sha256)."""
    return int(hashlib.sha256(doc_id.encode("utf-8")).hexdigest()[:16], 16)


def assign_splits(
    ids: Sequence[str],
    *,
    val_percent: int = DEFAULT_VAL_PERCENT,
    test_percent: int = DEFAULT_TEST_PERCENT,
) -> list[str]:
    """Assign each document id to ``train``, ``val`` or ``test`` by a stable hash of the id.

    Deterministic and independent of the order or number of the other ids, except for the
    non-empty repair described in the module docstring.
    """
    if val_percent < 0 or test_percent < 0 or val_percent + test_percent > 100:
        raise DataError(f"split percentages val={val_percent} test={test_percent}: must be >= 0, sum <= 100")
    hashes = [doc_hash(i) for i in ids]
    out = []
    for h in hashes:
        bucket = h % 100
        out.append(
            "val" if bucket < val_percent else "test" if bucket < val_percent + test_percent else "train"
        )
    required = []
    if len(ids) >= 2:
        required += ["train", "val"]
    if len(ids) >= 3 and test_percent > 0:
        required.append("test")
    for split in required:
        if split in out:
            continue
        counts = {s: out.count(s) for s in SPLITS}
        donor = max(SPLITS, key=lambda s: (counts[s], -SPLITS.index(s)))
        idx = min((i for i, s in enumerate(out) if s == donor), key=lambda i: (hashes[i], ids[i]))
        out[idx] = split
    return out


def source_hash(documents: Sequence[Document]) -> str:
    """sha256 over the ids and texts of ``documents`` (length-prefixed, so unambiguous)."""
    h = hashlib.sha256()
    for d in documents:
        for part in (d.id.encode("utf-8"), d.text.encode("utf-8")):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
    return h.hexdigest()


def decode_text(data: bytes, where: str) -> str:
    """Decode UTF-8 bytes strictly, rejecting binary data; normalise newlines and drop a BOM.

    ``where`` (a path, or ``path:line``) is named in the :class:`DataError` message.
    """
    nul = data.find(b"\0")
    if nul >= 0:
        raise DataError(f"{where}: binary data, not text (NUL byte at offset {nul})")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        bad = data[e.start : e.start + 1].hex()
        raise DataError(f"{where}: not valid UTF-8 (byte 0x{bad} at offset {e.start})") from None
    if text.startswith("\ufeff"):
        text = text[1:]
    return text.replace("\r\n", "\n").replace("\r", "\n")


def read_text_file(path: Path) -> str:
    """Read a UTF-8 regular text file (transparently gunzipping ``*.gz``, within
    :func:`mhmoe.runtime.reading.gzip_limit` of its size: a gzip bomb is refused) via :func:`decode_text`."""
    return decode_text(read_data_file(path), str(path))


def read_data_file(path: Path) -> bytes:
    """The bytes of a regular data file, gunzipped if ``*.gz`` (within
    :func:`mhmoe.runtime.reading.gzip_limit` of its size); a FIFO, a device or a directory is refused
    before a byte is read. DataError naming the file."""
    try:
        if path.suffix == ".gz":
            data = read_gzip(path)
        else:
            with os.fdopen(open_regular(path), "rb") as f:  # a FIFO or a device is refused, never read
                data = f.read()
    except BoundedLoadError as e:
        raise DataError(str(e)) from None
    except (OSError, EOFError) as e:
        raise DataError(f"{path}: cannot read ({e})") from None
    return data


def _find_break(text: str, lo: int, hi: int) -> int:
    """Best split position in ``text[lo:hi]``: after a blank line, else a newline, else a space."""
    m = _BLANK_LINE.search(text, lo, hi)
    if m:
        return m.end()
    for sep in ("\n", " "):
        j = text.find(sep, lo, hi)
        if j >= 0:
            return j + 1
    return hi


def chunk_text(text: str, target_chars: int = TEXT_CHUNK_CHARS) -> list[str]:
    """Split a long text into documents of about ``target_chars`` characters.

    Each document ends at the first blank-line paragraph break after ``target_chars`` characters
    (falling back to a line break, then a space, within ``4 * target_chars``); pieces are stripped and
    empty ones dropped.  Deterministic.
    """
    out = []
    start, n = 0, len(text)
    while start < n:
        end = (
            n
            if n - start <= target_chars
            else _find_break(text, start + target_chars, min(n, start + 4 * target_chars))
        )
        piece = text[start:end].strip()
        if piece:
            out.append(piece)
        start = end
    return out
