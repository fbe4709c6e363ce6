"""Tokenized documents cached on disk as flat token files with a JSON manifest.

``<stem>.bin`` holds the token ids of the documents, each document followed by the EOS id, as raw
little-endian ``uint16`` (vocab <= 65536) or ``uint32``; ``<stem>.json`` is the manifest:

``format_version, corpus, split, source_hash, n_documents, tokenizer {name, fingerprint}, dtype,
max_tokens, n_tokens, n_bytes, sha256``

On load the manifest must match what the caller expects (same format version, corpus, split,
source hash, tokenizer fingerprint, dtype and cap), the file size must equal ``n_tokens *
itemsize`` and (for files up to :data:`VERIFY_MAX_BYTES`) its sha256 must match; otherwise the file
is rebuilt, never reused.  Both files are written atomically (temporary file + ``os.replace``), the
token file first, so an interrupted build leaves at worst a manifest that no longer matches.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mhmoe.data.documents import Document, source_hash
from mhmoe.data.tokenizer_base import Tokenizer, check_path_component
from mhmoe.errors import ConfigError, DataError, UnsafePathError, one_line
from mhmoe.runtime.files import atomic_write, make_dirs, sha256_file, what_it_is
from mhmoe.runtime.reading import read_json

CACHE_FORMAT_VERSION = 1
VERIFY_MAX_BYTES = 512 * 2**20
ENCODE_GROUP_CHARS = 1 << 20
_MATCH_KEYS = ("format_version", "corpus", "split", "source_hash", "tokenizer", "dtype", "max_tokens")
log = logging.getLogger(__name__)


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits (vocab_size <= 65536), else ``uint32``."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def default_cache_dir(cache_dir: str | os.PathLike[str] = "") -> Path:
    """``cache_dir`` if given, else ``$MHMOE_CACHE``, else ``~/.cache/mhmoe``."""
    if str(cache_dir):
        return Path(cache_dir).expanduser()
    env = os.environ.get("MHMOE_CACHE", "")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mhmoe"


def usable_cache_dir(cache_dir: str | os.PathLike[str] = "") -> Path:
    """:func:`default_cache_dir` of ``cache_dir``, created if missing; ConfigError naming
    ``data.cache_dir`` and the problem when it cannot be (``/proc/x``, a file, no permission)."""
    path = default_cache_dir(cache_dir)
    try:
        if path.exists() and not path.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, f"it is {what_it_is(path.stat().st_mode)}")
        make_dirs(path)
    except (OSError, UnsafePathError) as exc:
        what = exc.strerror if isinstance(exc, OSError) and exc.strerror else one_line(exc)
        raise ConfigError("data.cache_dir", str(path), f"a directory mhmoe can create and write its caches in "
                          f"({path}: {what})") from None
    return path


@dataclass
class TokenFile:
    """A loaded token file: the memory-mapped ids, its manifest, and whether it was (re)built."""

    tokens: np.ndarray
    manifest: dict[str, Any]
    path: Path
    built: bool = False
    reason: str = ""
    timings: dict[str, float] = field(default_factory=dict)


def _open_tokens(path: Path, dtype: np.dtype, n_tokens: int) -> np.ndarray:
    if n_tokens == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(n_tokens,))


def check_cached(bin_path: Path, expected: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """(manifest, "") if ``bin_path`` and its manifest are valid for ``expected``, else (None, reason)."""
    man_path = bin_path.with_suffix(".json")
    if not man_path.is_file() or not bin_path.is_file():
        return None, "not cached"
    try:
        manifest = read_json(man_path, what="token-cache manifest")  # a FIFO, a device, too large: rebuilt
    except (OSError, ValueError) as e:
        return None, f"unreadable manifest ({e})"
    if not isinstance(manifest, dict):
        return None, "manifest is not a JSON object"
    for key in _MATCH_KEYS:
        if manifest.get(key) != expected[key]:
            return None, f"manifest {key} changed ({manifest.get(key)!r} -> {expected[key]!r})"
    itemsize = np.dtype(expected["dtype"]).itemsize
    size = bin_path.stat().st_size
    n_tokens = manifest.get("n_tokens")
    if not isinstance(n_tokens, int) or size != n_tokens * itemsize or size != manifest.get("n_bytes"):
        return None, f"token file size {size} bytes does not match manifest n_tokens={n_tokens!r}"
    if size <= VERIFY_MAX_BYTES:
        digest = sha256_file(bin_path)
        if digest != manifest.get("sha256"):
            return None, "token file checksum mismatch"
    return manifest, ""


def _encode_groups(documents: Sequence[Document]) -> list[list[Document]]:
    groups: list[list[Document]] = [[]]
    size = 0
    for d in documents:
        if size >= ENCODE_GROUP_CHARS:
            groups.append([])
            size = 0
        groups[-1].append(d)
        size += len(d.text)
    return groups


def build_token_file(
    bin_path: Path,
    documents: Sequence[Document],
    tokenizer: Tokenizer,
    expected: dict[str, Any],
    *,
    max_tokens: int | None = None,
    progress: bool = False,
    root: Path | None = None,
) -> dict[str, Any]:
    """Tokenize ``documents`` (EOS after each) into ``bin_path``, stopping after ``max_tokens``;
    documents are encoded in ~1 MB groups so a capped build only encodes what it needs. ``root``: the
    cache directory (symlinked directories below it are refused, see :mod:`mhmoe.runtime.files`)."""
    dtype = np.dtype(expected["dtype"])
    h, counts = hashlib.sha256(), {"tokens": 0, "docs": 0}
    groups = _encode_groups(documents)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(
            total=len(documents), desc=f"tokenize {expected['corpus']}/{expected['split']}", unit="doc"
        )

    def write(f: Any) -> None:
        for group in groups:
            if max_tokens is not None and counts["tokens"] >= max_tokens:
                break
            for ids in tokenizer.encode_batch([d.text for d in group]):
                ids.append(tokenizer.eos_id)
                if max_tokens is not None:
                    ids = ids[: max_tokens - counts["tokens"]]
                arr = np.asarray(ids, dtype=dtype)
                f.write(arr.tobytes())
                h.update(arr.tobytes())
                counts["tokens"] += len(arr)
                counts["docs"] += 1
                if max_tokens is not None and counts["tokens"] >= max_tokens:
                    break
            if bar is not None:
                bar.update(len(group))

    try:
        atomic_write(bin_path, write, root=root)
    finally:
        if bar is not None:
            bar.close()
    n_tokens, n_docs = counts["tokens"], counts["docs"]
    manifest = dict(expected)
    manifest.update(
        n_tokens=n_tokens, n_bytes=n_tokens * dtype.itemsize, n_documents=n_docs, sha256=h.hexdigest()
    )
    atomic_write(bin_path.with_suffix(".json"), json.dumps(manifest, indent=2, sort_keys=True), root=root)
    return manifest


def load_or_build_tokens(
    cache_dir: Path,
    corpus_key: str,
    split: str,
    documents: Sequence[Document],
    tokenizer: Tokenizer,
    *,
    max_tokens: int | None = None,
    progress: bool = False,
) -> TokenFile:
    """The token file for (corpus, split, tokenizer[, cap]), reused only if its manifest is valid.

    File: ``<cache_dir>/tokens/<corpus_key>/<split>-<tokenizer>-<fingerprint[:12]>[-cap<N>].bin``; each
    part must be a plain file name (DataError otherwise), so the file stays inside ``cache_dir``.
    """
    for value, what in ((corpus_key, "corpus key"), (split, "split"), (tokenizer.name, "tokenizer name"),
                        (tokenizer.fingerprint[:12], "tokenizer fingerprint")):
        check_path_component(value, what)
    if max_tokens is not None and max_tokens < 1:
        raise DataError(f"max_tokens={max_tokens}: must be >= 1")
    dtype = token_dtype(tokenizer.vocab_size)
    expected: dict[str, Any] = {
        "format_version": CACHE_FORMAT_VERSION,
        "corpus": corpus_key,
        "split": split,
        "source_hash": source_hash(documents),
        "tokenizer": {"name": tokenizer.name, "fingerprint": tokenizer.fingerprint},
        "dtype": dtype.str,
        "max_tokens": max_tokens,
    }
    cap = f"-cap{max_tokens}" if max_tokens is not None else ""
    stem = f"{split}-{tokenizer.name}-{tokenizer.fingerprint[:12]}{cap}"
    bin_path = cache_dir / "tokens" / corpus_key / f"{stem}.bin"
    manifest, reason = check_cached(bin_path, expected)
    if manifest is not None:
        return TokenFile(_open_tokens(bin_path, dtype, manifest["n_tokens"]), manifest, bin_path)
    if reason != "not cached":
        log.info("rebuilding %s: %s", bin_path, reason)
    t0 = time.perf_counter()
    manifest = build_token_file(
        bin_path, documents, tokenizer, expected, max_tokens=max_tokens, progress=progress, root=cache_dir
    )
    elapsed = time.perf_counter() - t0
    tokens = _open_tokens(bin_path, dtype, manifest["n_tokens"])
    return TokenFile(tokens, manifest, bin_path, built=True, reason=reason, timings={"tokenize_s": elapsed})
