"""The common :class:`Tokenizer` interface, the trivial :class:`ByteTokenizer`, and save/load of one kind
(:mod:`mhmoe.data.tokenizer` maps kinds and pretrained names to classes).

Every tokenizer has an end-of-text token (text form ``<|endoftext|>``, id ``eos_id``) used as the
document separator.  ``encode`` treats a literal ``<|endoftext|>`` in the input as ordinary text;
``decode`` renders the EOS id as ``<|endoftext|>``.  ``fingerprint`` is a sha256 hex digest of
everything that determines the id mapping, used as a cache key and checked on load.

Saved layout (``save(dir)``): ``dir/tokenizer_meta.json`` (``kind``, ``name``, ``vocab_size``,
``eos_id``, ``fingerprint``, ``format_version``, kind-specific fields) plus kind-specific files.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from mhmoe.errors import DataError
from mhmoe.runtime.files import atomic_write, make_dirs
from mhmoe.runtime.reading import read_json

EOS_TEXT = "<|endoftext|>"
META_FILE = "tokenizer_meta.json"
TOKENIZER_FORMAT_VERSION = 1
ENCODE_CHUNK_CHARS = 4096
_PATH_SEPARATORS = re.compile(r"[/\\\x00]")


def check_path_component(value: object, what: str) -> str:
    """``value`` if it can be used as one file-name component: a printable string of at most 200
    characters without ``/``, ``\\`` or NUL, and not ``.`` or ``..``. Names read from files (a
    tokenizer's name in ``tokenizer_meta.json``, which comes with downloaded checkpoints) become parts
    of cache paths and must not lead out of their directory. DataError otherwise."""
    ok = (isinstance(value, str) and value not in ("", ".", "..") and len(value) <= 200 and value.isprintable()
          and not _PATH_SEPARATORS.search(value))
    if not ok:
        raise DataError(f"{what} {value!r} is not a plain file name (no '/', '\\', '..' or control characters)")
    return value


def sha256_hex(*parts: bytes | str) -> str:
    """sha256 of the length-prefixed concatenation of ``parts``."""
    h = hashlib.sha256()
    for p in parts:
        b = p.encode("utf-8") if isinstance(p, str) else p
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def split_for_encoding(text: str, target_chars: int = ENCODE_CHUNK_CHARS) -> list[str]:
    """Cut ``text`` into pieces of about ``target_chars`` that tokenize exactly like the whole.

    Cuts are made only just before a single ASCII space that sits between two non-whitespace
    characters.  The GPT-2 and cl100k pre-tokenizer regexes never put such a space anywhere but at
    the start of a pre-token, so no pre-token (and hence no BPE merge) straddles a cut.  Used to give
    batch encoders many mid-sized pieces to parallelise over instead of a few huge documents.
    """
    out, start, n = [], 0, len(text)
    while n - start > target_chars:
        j = text.find(" ", start + target_chars)
        while j != -1 and (j + 1 >= n or text[j - 1].isspace() or text[j + 1].isspace()):
            j = text.find(" ", j + 1)
        if j == -1:
            break
        out.append(text[start:j])
        start = j
    out.append(text[start:])
    return out



def encode_in_pieces(texts: Sequence[str], encode_many: Callable[[list[str]], Iterable[list[int]]]) -> list[list[int]]:
    """Encode each text by cutting it with :func:`split_for_encoding`, encoding all pieces in one
    batch call (``encode_many``: list of pieces -> ids per piece) and joining each text's pieces."""
    pieces, owner = [], []
    for i, t in enumerate(texts):
        for p in split_for_encoding(t):
            pieces.append(p)
            owner.append(i)
    out: list[list[int]] = [[] for _ in texts]
    for i, ids in zip(owner, encode_many(pieces), strict=True):
        out[i].extend(ids)
    return out

class Tokenizer(ABC):
    """Common interface: ``name``, ``vocab_size``, ``eos_id``, ``encode``, ``decode``,
    ``encode_batch``, ``fingerprint``, ``save(dir)`` and ``load(dir)``."""

    kind: str = ""
    name: str
    vocab_size: int
    eos_id: int

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no EOS appended; literal ``<|endoftext|>`` is plain text)."""

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``[encode(t) for t in texts]``; subclasses parallelise."""
        return [self.encode(t) for t in texts]

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; the EOS id decodes to ``<|endoftext|>``; invalid UTF-8 is replaced."""

    @property
    @abstractmethod
    def fingerprint(self) -> str:
        """sha256 hex digest identifying this exact id mapping."""

    @abstractmethod
    def _save_files(self, directory: Path) -> dict[str, Any]:
        """Write kind-specific files into ``directory``; return extra metadata fields."""

    @classmethod
    @abstractmethod
    def _from_saved(cls, directory: Path, meta: dict[str, Any]) -> Tokenizer:
        """Rebuild from the files written by :meth:`_save_files`."""

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"
        )

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Save into ``directory`` (created; refused if it is a symlink) so that
        :func:`mhmoe.data.tokenizer.load_tokenizer` restores it exactly."""
        d = make_dirs(directory, root=Path(directory).parent)
        meta = {
            "format_version": TOKENIZER_FORMAT_VERSION,
            "kind": self.kind,
            "name": self.name,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "fingerprint": self.fingerprint,
        }
        meta.update(self._save_files(d))
        atomic_write(d / META_FILE, json.dumps(meta, indent=2, sort_keys=True).encode())
        return d

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> Tokenizer:
        """Load a tokenizer of this class saved with :meth:`save`; DataError if missing, corrupt, altered or
        of another kind (:func:`mhmoe.data.tokenizer.load_tokenizer` loads any kind)."""
        d = Path(directory)
        meta = read_tokenizer_meta(d)
        if meta["kind"] != cls.kind:
            raise DataError(f"{d / META_FILE}: tokenizer kind {meta['kind']!r}, expected {cls.kind!r}")
        tok = cls._from_saved(d, meta)
        if tok.fingerprint != meta["fingerprint"]:
            raise DataError(
                f"{d}: tokenizer files do not match the fingerprint in {META_FILE} (altered or corrupt)"
            )
        return tok


def read_tokenizer_meta(directory: Path) -> dict[str, Any]:
    """The checked ``tokenizer_meta.json`` of a saved tokenizer (``kind`` and ``fingerprint`` present,
    current format version); DataError otherwise."""
    meta_path = directory / META_FILE
    if not meta_path.exists():
        raise DataError(f"{meta_path}: tokenizer metadata not found")
    try:  # a FIFO, a device, a directory or an oversized file: refused in one line, never read
        meta = read_json(meta_path, what=META_FILE)
        if not isinstance(meta["kind"], str) or not isinstance(meta["fingerprint"], str):
            raise TypeError("kind and fingerprint must be strings")
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{meta_path}: corrupt tokenizer metadata ({e})") from None
    if not isinstance(meta, dict):
        raise DataError(f"{meta_path}: corrupt tokenizer metadata (not an object)")
    if "name" in meta:  # becomes part of token-cache file names
        check_path_component(meta["name"], f"{meta_path}: tokenizer name")
    if meta.get("format_version") != TOKENIZER_FORMAT_VERSION:
        raise DataError(f"{meta_path}: format_version {meta.get('format_version')!r} != {TOKENIZER_FORMAT_VERSION}")
    return meta


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255 plus EOS = 256 (vocab 257).  Lossless; handy for tests."""

    kind = "byte"

    def __init__(self) -> None:
        self.name = "byte"
        self.vocab_size = 257
        self.eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        parts, buf = [], bytearray()
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                parts.append(buf.decode("utf-8", errors="replace") + EOS_TEXT)
                buf = bytearray()
            elif 0 <= i < 256:
                buf.append(i)
            else:
                raise DataError(f"byte tokenizer: token id {i} out of range 0..256")
        parts.append(buf.decode("utf-8", errors="replace"))
        return "".join(parts)

    @property
    def fingerprint(self) -> str:
        return sha256_hex("byte", "utf-8 bytes 0..255 + eos 256")

    def _save_files(self, directory: Path) -> dict[str, Any]:
        return {}

    @classmethod
    def _from_saved(cls, directory: Path, meta: dict[str, Any]) -> Tokenizer:
        return cls()
