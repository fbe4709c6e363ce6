"""The on-disk checkpoint format shared by single-file and sharded (DCP) checkpoints: directory layout,
``meta.json`` (format version, step, sha256 and size of every file, written last), atomic publication
by rename, verification, and the :class:`Checkpoint` a loader returns. See :mod:`mhmoe.train.checkpoint`."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mhmoe.config.run import RunConfig
from mhmoe.data.tokenizer_base import Tokenizer
from mhmoe.errors import CheckpointError
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


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """Check meta.json, file sizes and hashes; return the meta dict or raise CheckpointError."""
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
    for name, size, sha in files:
        f = path / name
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
    model: LM
    tokenizer: Tokenizer
    trainer_state: dict[str, Any]
