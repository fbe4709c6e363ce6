"""The checkpoint directory format, without torch: layout names, ``meta.json`` (written last, verified
first: sizes, sha256, names that stay inside the directory), atomic and durable publication, and
finding a run's checkpoints (newest valid first).

Checkpoints are downloaded and shared, so ``meta.json`` is treated as untrusted: its file names must be
relative, without ``..``, and no symlink in the checkpoint may lead out of it. A run's checkpoint
directories are never symlinks (one planted there is ignored).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, TypeVar

from mhmoe.checkpoint.layout import (
    CKPT_DIR,
    FORMAT_VERSION,
    META_FILE,
    PREFIX,
    is_checkpoint_dir,
    is_saved_dir,
    step_of,
)
from mhmoe.errors import CheckpointError, one_line
from mhmoe.runtime.bounded import MAX_JSON_CHARS, load_json
from mhmoe.runtime.files import (
    STAGING_PREFIX,
    atomic_write,
    durable_default,
    publish_dir,
    remove_tree,
    sha256_file,
)
from mhmoe.runtime.reading import read_text

T = TypeVar("T")


def checkpoint_files(root: Path) -> list[Path]:
    """Every file below ``root`` except ``meta.json``, sorted."""
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != META_FILE)


def _is_step_dir(p: Path) -> bool:
    return step_of(p.name) is not None and p.is_dir() and not p.is_symlink()


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Checkpoint directories of a run, oldest first (temporary directories and symlinks excluded)."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir() or root.is_symlink():
        return []
    return sorted((p for p in root.iterdir() if _is_step_dir(p)), key=lambda p: step_of(p.name) or 0)


def _one_directory(p: Path) -> bool:
    """A checkpoint or saved-model directory: loaded as it is, with no fallback."""
    return is_checkpoint_dir(p) or is_saved_dir(p)


def checkpoint_candidates(run_or_ckpt: str | os.PathLike[str]) -> list[Path]:
    """The checkpoint directories to try for a run directory, newest first, or ``[path]`` for a checkpoint
    (or saved-model) directory; CheckpointError when there are none."""
    p = Path(run_or_ckpt)
    if not p.exists():
        raise CheckpointError(f"{p}: no such run or checkpoint directory")
    if _one_directory(p):
        return [p]
    candidates = list_checkpoints(p)
    if not candidates:
        raise CheckpointError(f"{p}: no checkpoints found (expected {p / CKPT_DIR / PREFIX}*)")
    return list(reversed(candidates))


def newest_valid(run_or_ckpt: str | os.PathLike[str], load: Callable[[Path], T], warn: bool = True) -> T:
    """``load(directory)`` for a checkpoint or saved-model directory, or for a run directory on its newest
    checkpoint that loads: one that raises CheckpointError prints one line to stderr (``warn``) and the
    previous one is tried. The one fallback rule of every loader of run directories (``LM.from_pretrained``,
    ``mhmoe.load``, ``load_latest``, the resume of single-process and torchrun training)."""
    candidates = checkpoint_candidates(run_or_ckpt)
    if _one_directory(Path(run_or_ckpt)):
        return load(candidates[0])
    errors = []
    for c in candidates:
        try:
            return load(c)
        except CheckpointError as exc:
            errors.append(str(exc))
            if warn:
                print(f"mhmoe: warning: {exc}; falling back to the previous checkpoint", file=sys.stderr)
    raise CheckpointError(f"{run_or_ckpt}: no valid checkpoint ({errors[0]})")


def resolves_inside(p: Path, root: Path) -> bool:
    try:
        return p.resolve().is_relative_to(root.resolve())
    except (OSError, RuntimeError):  # a symlink loop
        return False


def inside(path: Path, name: Any) -> Path:
    """``path / name`` for a file name taken from meta.json: relative, no ``..``, and (symlinks resolved)
    inside the checkpoint directory; anything else raises CheckpointError (meta.json is checkpoint
    content, as untrusted as the rest)."""
    ok = (isinstance(name, str) and name.isprintable() and name.strip() != ""
          and not PurePosixPath(name).is_absolute() and not PureWindowsPath(name).anchor
          and ".." not in PurePosixPath(name.replace("\\", "/")).parts)
    if not ok:
        raise CheckpointError(f"{path}: meta.json names {name!r}, which is not a file inside the checkpoint")
    f = path / name
    if not resolves_inside(f, path):
        raise CheckpointError(f"{path}: {name!r} leads out of the checkpoint directory (symlink)")
    return f


def check_links(path: Path) -> None:
    """Refuse a directory holding a symlink that resolves outside it (the loaders open config.yaml,
    tokenizer/, ... by name, listed in meta.json or not)."""
    root = path.resolve()
    for dirpath, dirnames, filenames in os.walk(path):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            if p.is_symlink() and not resolves_inside(p, root):
                raise CheckpointError(f"{path}: {str(p.relative_to(path))!r} is a symlink out of the checkpoint "
                                      "directory")


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """Check meta.json, file names, sizes and hashes; return the meta dict or raise CheckpointError.

    File names in meta.json must stay inside the checkpoint directory (no absolute paths, no ``..``,
    no symlink out of it)."""
    meta_path = path / META_FILE
    try:  # a regular file (a FIFO never blocks), its size from fstat before reading it
        meta = load_json(read_text(meta_path, MAX_JSON_CHARS, what=META_FILE), str(meta_path))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable meta.json ({one_line(exc, 200)})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: malformed meta.json (not an object)")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format_version {meta.get('format_version')!r}, expected {FORMAT_VERSION}")
    try:  # a corrupted but still parseable meta.json must not escape as KeyError/TypeError
        int(meta["step"])
        files = [(name, int(info["bytes"]), str(info["sha256"])) for name, info in meta["files"].items()]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{path}: malformed meta.json ({exc.__class__.__name__}: {exc})") from None
    check_links(path)
    for name, size, sha in files:
        f = inside(path, name)
        if not f.is_file():
            if not os.path.lexists(f):
                raise CheckpointError(f"{path}: missing {name}")
            raise CheckpointError(f"{path}: {name} is not a regular file (a FIFO, a device or a directory: never read)")
        if f.stat().st_size != size:
            raise CheckpointError(f"{path}: {name} is truncated ({f.stat().st_size} of {size} bytes)")
        if sha256_file(f) != sha:
            raise CheckpointError(f"{path}: {name} is corrupted (sha256 mismatch)")
    return meta


def publish_checkpoint(tmp: Path, final: Path, run_dir: str | Path, meta: dict[str, Any], keep_last: int,
                       durable: bool | None = None) -> None:
    """Write ``meta.json`` (``meta`` + every file's sha256 and size) into the finished ``tmp`` directory,
    publish it as ``final`` (fsync'd files and directories before and after the rename, ``durable``;
    :func:`mhmoe.runtime.files.publish_dir`; an existing ``final`` is replaced) and prune all but the
    newest ``keep_last`` checkpoints."""
    durable = durable_default() if durable is None else durable
    meta = {**meta, "files": {str(p.relative_to(tmp)): {"sha256": sha256_file(p), "bytes": p.stat().st_size}
                              for p in checkpoint_files(tmp)}}
    atomic_write(tmp / META_FILE, json.dumps(meta, indent=1), durable=False)  # fsync'd with the tree
    publish_dir(tmp, final, replace=True, durable=durable)
    for old in list_checkpoints(run_dir)[:-keep_last]:
        with contextlib.suppress(OSError):  # pruning is best effort: the new checkpoint is published
            remove_tree(old)


def remove_stale_temporaries(run_dir: str | Path) -> list[Path]:
    """Remove the hidden ``checkpoints/.tmp-*`` directories a killed run left behind (a checkpoint being
    written when the process died); call only while holding the run directory's lock (no writer is
    active). Returns what was removed."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir() or root.is_symlink():
        return []
    stale = [p for p in root.iterdir() if p.name.startswith(STAGING_PREFIX) and p.is_dir() and not p.is_symlink()]
    for p in stale:
        remove_tree(p)
    return stale
