"""The on-disk checkpoint format shared by single-file and sharded (DCP) checkpoints: directory layout,
``meta.json`` (format version, step, sha256 and size of every file, written last), atomic publication
by rename, verification, and the :class:`Checkpoint` a loader returns. See :mod:`mhmoe.train.checkpoint`."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch

from mhmoe.config.run import RunConfig
from mhmoe.data.tokenizer_base import Tokenizer
from mhmoe.errors import CheckpointError
from mhmoe.model.encoder import Encoder
from mhmoe.model.lm import LM

FORMAT_VERSION = 1
CKPT_DIR = "checkpoints"
PREFIX = "step_"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != "meta.json")


def first_line(exc: BaseException) -> str:
    """An exception's message cut to its first line (CheckpointError messages are one line)."""
    lines = str(exc).strip().splitlines()
    return lines[0][:300] if lines else ""


def model_is_finite(model: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def publish_checkpoint(tmp: Path, final: Path, run_dir: str | Path, meta: dict[str, Any], keep_last: int) -> None:
    """Write ``meta.json`` (``meta`` + every file's sha256 and size) into the finished ``tmp`` directory,
    rename it to ``final`` atomically, and prune all but the newest ``keep_last`` checkpoints."""
    meta = {**meta, "files": {str(p.relative_to(tmp)): {"sha256": _sha256(p), "bytes": p.stat().st_size}
                              for p in _files(tmp)}}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Checkpoint directories of a run, oldest first (temporary directories excluded)."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()]
    return sorted(dirs, key=lambda p: int(p.name[len(PREFIX):]))


def _resolves_inside(p: Path, root: Path) -> bool:
    try:
        return p.resolve().is_relative_to(root.resolve())
    except (OSError, RuntimeError):  # a symlink loop
        return False


def _inside(path: Path, name: Any) -> Path:
    """``path / name`` for a file name taken from meta.json: relative, no ``..``, and (symlinks resolved)
    inside the checkpoint directory; anything else raises CheckpointError (meta.json is checkpoint
    content, as untrusted as the rest)."""
    ok = (isinstance(name, str) and name.isprintable() and name.strip() != ""
          and not PurePosixPath(name).is_absolute() and not PureWindowsPath(name).anchor
          and ".." not in PurePosixPath(name.replace("\\", "/")).parts)
    if not ok:
        raise CheckpointError(f"{path}: meta.json names {name!r}, which is not a file inside the checkpoint")
    f = path / name
    if not _resolves_inside(f, path):
        raise CheckpointError(f"{path}: {name!r} leads out of the checkpoint directory (symlink)")
    return f


def _check_links(path: Path) -> None:
    """Refuse a checkpoint holding a symlink that resolves outside its directory (the loaders open
    config.yaml, tokenizer/, ... by name, listed in meta.json or not)."""
    root = path.resolve()
    for dirpath, dirnames, filenames in os.walk(path):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            if p.is_symlink() and not _resolves_inside(p, root):
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
    _check_links(path)
    for name, size, sha in files:
        f = _inside(path, name)
        if not f.is_file():
            raise CheckpointError(f"{path}: missing {name}")
        if f.stat().st_size != size:
            raise CheckpointError(f"{path}: {name} is truncated ({f.stat().st_size} of {size} bytes)")
        if _sha256(f) != sha:
            raise CheckpointError(f"{path}: {name} is corrupted (sha256 mismatch)")
    return meta


@dataclass
class Checkpoint:
    path: Path
    step: int
    run: RunConfig
    model: LM | Encoder  # ModelConfig.arch: decoder | encoder
    tokenizer: Tokenizer
    trainer_state: dict[str, Any]
