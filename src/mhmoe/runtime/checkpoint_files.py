"""The files of a checkpoint directory, without torch: layout names, ``meta.json`` verification (sizes,
sha256, names that stay inside the directory) and finding a run's checkpoints.

Everything here reads files only; the loaders that build models sit above (:mod:`mhmoe.model.pretrained`
for the weights alone, :mod:`mhmoe.train.checkpoint` for a run's full state). Checkpoints are
downloaded and shared, so ``meta.json`` is treated as untrusted: its file names must be relative,
without ``..``, and no symlink in the checkpoint may lead out of it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, TypeVar

from mhmoe.errors import CheckpointError

FORMAT_VERSION = 1
CKPT_DIR = "checkpoints"
PREFIX = "step_"
T = TypeVar("T")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_files(root: Path) -> list[Path]:
    """Every file below ``root`` except ``meta.json``, sorted."""
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != "meta.json")


def first_line(exc: BaseException) -> str:
    """An exception's message cut to its first line (CheckpointError messages are one line)."""
    lines = str(exc).strip().splitlines()
    return lines[0][:300] if lines else ""


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Checkpoint directories of a run, oldest first (temporary directories excluded)."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()]
    return sorted(dirs, key=lambda p: int(p.name[len(PREFIX):]))


def is_checkpoint_dir(path: Path) -> bool:
    """A single checkpoint directory (``meta.json`` inside, or named ``step_N``), not a run directory."""
    return (path / "meta.json").is_file() or path.name.startswith(PREFIX)


def checkpoint_candidates(run_or_ckpt: str | Path) -> list[Path]:
    """The checkpoint directories to try for a run directory, newest first, or ``[path]`` for a checkpoint
    directory; CheckpointError when there are none."""
    p = Path(run_or_ckpt)
    if not p.exists():
        raise CheckpointError(f"{p}: no such run or checkpoint directory")
    if is_checkpoint_dir(p):
        return [p]
    candidates = list_checkpoints(p)
    if not candidates:
        raise CheckpointError(f"{p}: no checkpoints found (expected {p / CKPT_DIR / 'step_*'})")
    return list(reversed(candidates))


def newest_valid(run_or_ckpt: str | Path, load: Callable[[Path], T], warn: bool = True) -> T:
    """``load(checkpoint_dir)`` for a checkpoint directory, or for a run directory on its newest checkpoint
    that loads: one that raises CheckpointError prints one line to stderr (``warn``) and the previous one
    is tried (the rule of :func:`mhmoe.train.checkpoint.load_latest`)."""
    candidates = checkpoint_candidates(run_or_ckpt)
    if is_checkpoint_dir(Path(run_or_ckpt)):
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
    meta_path = path / "meta.json"
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable meta.json ({exc.__class__.__name__})") from None
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
            raise CheckpointError(f"{path}: missing {name}")
        if f.stat().st_size != size:
            raise CheckpointError(f"{path}: {name} is truncated ({f.stat().st_size} of {size} bytes)")
        if sha256_file(f) != sha:
            raise CheckpointError(f"{path}: {name} is corrupted (sha256 mismatch)")
    return meta
