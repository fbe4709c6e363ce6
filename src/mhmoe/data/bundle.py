"""Data bundles: a prepared corpus that travels to a machine without its packages.

:func:`write_bundle` stores what :func:`~mhmoe.data.prepare_data` would give a run: the trained
tokenizer, the first N training tokens (whole documents), every validation set's held-out tokens and a
manifest. :func:`read_bundle` (``DataConfig.bundle``, through ``prepare_data``) reads it back, from the
bundle alone. Layout of ``DIR``::

    manifest.json              format, corpus, data settings, tokenizer fingerprint, token counts, files
    tokenizer/                 Tokenizer.save() (tokenizer_meta.json + the kind's files)
    train.u16.xz               token ids, little-endian uint16 (u32 for vocabularies over 65,536), xz
    val-<name>.u16.xz          one per validation set

A bundle is untrusted input: the manifest is read with the bounded JSON reader, file names must be plain
names from the manifest, files are opened without following symlinks and must be regular files under
:data:`MAX_FILE_BYTES`; every file's sha256 is checked before it is used, decompression stops at the
declared size (so a small file never expands past what the manifest says, itself capped at
:data:`MAX_TOKENS`), and every token id must be below the tokenizer's vocabulary. Nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import stat
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from mhmoe.config.data import DataConfig
from mhmoe.data.token_cache import token_dtype
from mhmoe.data.tokenizer import Tokenizer, load_tokenizer
from mhmoe.data.tokenizer_base import check_path_component
from mhmoe.errors import DataError
from mhmoe.runtime.bounded import load_json
from mhmoe.runtime.files import new_staging_dir, publish_dir

BUNDLE_FORMAT = "mhmoe-data-bundle"
BUNDLE_VERSION = 1
MANIFEST = "manifest.json"
MAX_MANIFEST_CHARS = 1 << 20
MAX_FILE_BYTES = 512 << 20
MAX_TOKENS = 1 << 30
DEFAULT_TRAIN_TOKENS = 40_000_000  # all of debdocs' training split (37.4 M bpe tokens, ~26 MiB packed)
XZ_PRESET = 6
_READ_CHUNK = 1 << 20


def _ids_bytes(tokens: np.ndarray, vocab_size: int) -> bytes:
    return np.ascontiguousarray(tokens, dtype=token_dtype(vocab_size)).tobytes()


def document_prefix(tokens: np.ndarray, eos_id: int, max_tokens: int) -> np.ndarray:
    """The longest prefix of ``tokens`` of at most ``max_tokens`` ids that ends with an EOS (whole
    documents); the first ``max_tokens`` ids if not even one document fits."""
    if len(tokens) <= max_tokens:
        return tokens
    head = np.asarray(tokens[:max_tokens])
    ends = np.flatnonzero(head == eos_id)
    return head[: ends[-1] + 1] if len(ends) else head


def _write_tokens(directory: Path, name: str, tokens: np.ndarray, vocab_size: int) -> dict[str, Any]:
    raw = _ids_bytes(tokens, vocab_size)
    packed = lzma.compress(raw, format=lzma.FORMAT_XZ, preset=XZ_PRESET)
    (directory / name).write_bytes(packed)
    return {"file": name, "n_tokens": int(len(tokens)), "dtype": token_dtype(vocab_size).str,
            "bytes": len(packed), "sha256": hashlib.sha256(packed).hexdigest(),
            "raw_sha256": hashlib.sha256(raw).hexdigest()}


def write_bundle(prepared: Any, cfg: DataConfig, out: str | os.PathLike[str], *, max_train_tokens: int) -> dict:
    """Write ``prepared`` (from :func:`prepare_data` with ``cfg``) as a bundle into the new directory
    ``out`` (refused if it exists and is not empty); returns the manifest."""
    if max_train_tokens < 1:
        raise DataError(f"max_train_tokens={max_train_tokens}: must be >= 1")
    out = Path(out)
    if out.is_symlink() or (out.exists() and (not out.is_dir() or any(out.iterdir()))):
        raise DataError(f"{out}: exists and is not an empty directory; a bundle is written into a new directory")
    tok: Tokenizer = prepared.tokenizer
    tmp = new_staging_dir(out)
    train = document_prefix(prepared.train, tok.eos_id, max_train_tokens)
    ext = "u16" if token_dtype(tok.vocab_size).itemsize == 2 else "u32"
    tok.save(tmp / "tokenizer")
    manifest: dict[str, Any] = {
        "format": BUNDLE_FORMAT, "format_version": BUNDLE_VERSION, "corpus": cfg.corpus,
        "data": {"corpus": cfg.corpus, "tokenizer": cfg.tokenizer, "vocab_size": cfg.vocab_size,
                 "jsonl_field": cfg.jsonl_field, "val_sets": list(cfg.val_sets), "val_tokens": cfg.val_tokens},
        "tokenizer": {"name": tok.name, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
                      "fingerprint": tok.fingerprint},
        "corpus_train_tokens": int(len(prepared.train)),
        "own_val": next(iter(prepared.val)),
        "n_documents": prepared.manifest.get("n_documents", {}),
        "train": _write_tokens(tmp, f"train.{ext}.xz", train, tok.vocab_size),
        "val": {name: _write_tokens(tmp, f"val-{name}.{ext}.xz", arr, tok.vocab_size)
                for name, arr in prepared.val.items()},
    }
    manifest["train"]["documents_whole"] = bool(len(train) and int(train[-1]) == tok.eos_id)
    manifest["files"] = {p.relative_to(tmp).as_posix(): {"bytes": p.stat().st_size,
                                                         "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
                         for p in sorted(tmp.rglob("*")) if p.is_file()}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    publish_dir(tmp, out)
    return manifest


# ---- reading ------------------------------------------------------------------------------------------------
def _read_regular(path: Path, limit: int) -> bytes:
    """The bytes of ``path``: a regular file (no symlink followed) of at most ``limit`` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        hint = "; a symlink?" if os.path.islink(path) else ""
        raise DataError(f"{path}: cannot open bundle file ({e.strerror}{hint})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise DataError(f"{path}: not a regular file")
        if st.st_size > limit:
            raise DataError(f"{path}: {st.st_size} bytes, over the bundle's limit of {limit}")
        return f.read(limit + 1)


def _check_dir(directory: Path) -> None:
    for d in (directory, directory / "tokenizer"):
        if d.is_symlink() or not d.is_dir():
            raise DataError(f"{d}: not a bundle directory (missing, a symlink or not a directory); "
                            "build one with: mhmoe data bundle --out DIR")


def read_manifest(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The validated manifest of the bundle in ``directory`` (DataError with one line otherwise)."""
    directory = Path(directory)
    _check_dir(directory)
    path = directory / MANIFEST
    man = load_json(_read_regular(path, MAX_MANIFEST_CHARS).decode("utf-8", "replace"), str(path))
    if not isinstance(man, dict) or man.get("format") != BUNDLE_FORMAT:
        raise DataError(f"{path}: not an mhmoe data bundle manifest")
    if man.get("format_version") != BUNDLE_VERSION:
        raise DataError(f"{path}: bundle format version {man.get('format_version')!r}, "
                        f"this mhmoe reads {BUNDLE_VERSION}")
    try:
        entries = [man["train"], *man["val"].values()]
        for e in entries:
            check_path_component(e["file"], "bundle file name")
            if not (isinstance(e["n_tokens"], int) and 0 < e["n_tokens"] <= MAX_TOKENS):
                raise DataError(f"{path}: n_tokens of {e['file']} must be an integer in 1..{MAX_TOKENS}")
            if e["dtype"] not in ("<u2", "<u4"):
                raise DataError(f"{path}: dtype of {e['file']} must be <u2 or <u4")
        for name in man["val"]:
            check_path_component(name, "validation set name")
        tok = man["tokenizer"]
        ints = all(isinstance(tok[k], int) for k in ("vocab_size", "eos_id"))
        if not ints or not isinstance(tok["fingerprint"], str):
            raise DataError(f"{path}: bad tokenizer entry")
        if not isinstance(man["files"], dict):
            raise DataError(f"{path}: bad files table")
    except (KeyError, TypeError, AttributeError) as e:
        raise DataError(f"{path}: incomplete bundle manifest ({type(e).__name__}: {e})") from None
    return man


def verify_files(directory: Path, man: dict[str, Any]) -> None:
    """Every file the manifest lists has its size and sha256 (tokenizer files included)."""
    for rel, info in man["files"].items():
        parts = rel.split("/")
        if len(parts) > 2 or (len(parts) == 2 and parts[0] != "tokenizer"):
            raise DataError(f"{directory / MANIFEST}: file {rel!r} outside the bundle's layout")
        for p in parts:
            check_path_component(p, "bundle file name")
        data = _read_regular(directory / rel, MAX_FILE_BYTES)
        if not isinstance(info, dict) or hashlib.sha256(data).hexdigest() != info.get("sha256"):
            raise DataError(f"{directory / rel}: sha256 does not match the bundle manifest (damaged or altered)")


def _read_tokens(directory: Path, entry: dict[str, Any], vocab_size: int) -> np.ndarray:
    path = directory / entry["file"]
    packed = _read_regular(path, MAX_FILE_BYTES)
    if hashlib.sha256(packed).hexdigest() != entry.get("sha256"):
        raise DataError(f"{path}: sha256 does not match the bundle manifest (damaged or altered)")
    dtype = np.dtype(entry["dtype"])
    if dtype != token_dtype(vocab_size):
        raise DataError(f"{path}: dtype {dtype.str} does not fit vocab_size {vocab_size}")
    expected = entry["n_tokens"] * dtype.itemsize
    dec = lzma.LZMADecompressor(format=lzma.FORMAT_XZ)
    try:
        raw = dec.decompress(packed, max_length=expected + 1)
    except lzma.LZMAError as e:
        raise DataError(f"{path}: corrupt xz data ({e})") from None
    if len(raw) != expected or not dec.eof:
        raise DataError(f"{path}: unpacks to {'more' if len(raw) > expected else 'fewer'} bytes than the "
                        f"manifest's {entry['n_tokens']} tokens")
    if hashlib.sha256(raw).hexdigest() != entry.get("raw_sha256"):
        raise DataError(f"{path}: unpacked token ids do not match the manifest's raw_sha256")
    tokens = np.frombuffer(raw, dtype=dtype)
    if len(tokens) and int(tokens.max()) >= vocab_size:
        raise DataError(f"{path}: token id {int(tokens.max())} >= vocab_size {vocab_size}")
    return tokens


def check_bundle_matches(man: dict[str, Any], cfg: DataConfig, where: str) -> None:
    """One-line refusal when the bundle was not made for ``cfg``'s corpus, tokenizer and vocabulary."""
    data = man.get("data", {})
    for field in ("corpus", "tokenizer"):
        if data.get(field) != getattr(cfg, field):
            raise DataError(f"data.bundle {where}: made for {field} {data.get(field)!r}, the run asks for "
                            f"{getattr(cfg, field)!r}")
    if cfg.tokenizer == "bpe" and data.get("vocab_size") != cfg.vocab_size:
        raise DataError(f"data.bundle {where}: made for vocab_size {data.get('vocab_size')}, the run asks for "
                        f"{cfg.vocab_size}")


def read_bundle(cfg: DataConfig, *, seq_len: int, tokenizer: Tokenizer | None = None
                ) -> tuple[Tokenizer, np.ndarray, dict[str, np.ndarray], dict[str, Any]]:
    """``(tokenizer, train tokens, validation arrays, manifest)`` from the bundle ``cfg.bundle`` alone (no
    corpus package needed; :func:`~mhmoe.data.prepare_data` wraps them). Validation sets of
    ``cfg.val_sets`` the bundle lacks are skipped with a warning; each is cut to ``cfg.val_tokens``."""
    directory = Path(cfg.bundle).expanduser()
    man = read_manifest(directory)
    check_bundle_matches(man, cfg, str(directory))
    verify_files(directory, man)
    tok = load_tokenizer(directory / "tokenizer")
    if tok.fingerprint != man["tokenizer"]["fingerprint"]:
        raise DataError(f"{directory}: tokenizer fingerprint does not match the bundle manifest")
    if tokenizer is not None and tokenizer.fingerprint != tok.fingerprint:
        raise DataError(f"data.bundle {directory}: its tokenizer ({tok.fingerprint[:16]}) is not the run's "
                        f"({tokenizer.fingerprint[:16]}); build the bundle with the run's tokenizer")
    train = _read_tokens(directory, man["train"], tok.vocab_size)
    need = seq_len + 1
    if len(train) < need:
        raise DataError(f"data.bundle {directory}: {len(train)} training tokens; one sequence needs seq_len+1 = {need}")
    own = man.get("own_val", cfg.corpus)
    wanted = [own, *(v for v in dict.fromkeys(cfg.val_sets) if v not in (cfg.corpus, own))]
    val, skipped = {}, []
    for name in wanted:
        if name not in man["val"]:
            warnings.warn(f"skipping validation set {name!r}: not in data.bundle {directory}", stacklevel=2)
            skipped.append(name)
            continue
        arr = _read_tokens(directory, man["val"][name], tok.vocab_size)[: cfg.val_tokens]
        if len(arr) < need:
            warnings.warn(f"skipping validation set {name!r}: {len(arr)} tokens < seq_len+1 = {need}", stacklevel=2)
            skipped.append(name)
            continue
        val[name] = arr
    manifest = {"corpus": cfg.corpus, "bundle": str(directory), "n_documents": man.get("n_documents", {}),
                "tokenizer": dict(man["tokenizer"]), "train_tokens": int(len(train)),
                "corpus_train_tokens": man.get("corpus_train_tokens"),
                "train": {**man["train"], "path": str(directory / man["train"]["file"])},
                "val": {k: {**man["val"][k], "n_tokens": int(len(v))} for k, v in val.items()},
                "skipped_val_sets": skipped, "timings": {}}
    return (tok if tokenizer is None else tokenizer), train, val, manifest
