"""Checkpoints: safetensors weights + YAML config + trainer state + tokenizer, written atomically.

Layout of one checkpoint (``RUN/checkpoints/step_00000600/``)::

    model.safetensors     weights (tied tensors stored once)
    config.yaml           the full RunConfig
    trainer_state.pt      optimizer, LR scheduler, RNG states, step, counters (tensors + plain data,
                          loaded with ``weights_only=True``: nothing is unpickled)
    tokenizer/            the tokenizer files (see mhmoe.data.Tokenizer.save)
    meta.json             step, format version and the sha256 of every file above (written last)

Multi-process runs write sharded ``torch.distributed.checkpoint`` checkpoints instead (``dcp/`` in
place of the safetensors and optimizer files, ``"format": "dcp"`` in meta.json); loading them here
gathers the full model in one process (see :mod:`mhmoe.distributed.checkpoint`).

A checkpoint is written into a hidden temporary directory and renamed into place, so a crash never
leaves a half-written checkpoint under a real name. Loading verifies sizes and hashes; a corrupted
or truncated checkpoint is reported in one line and the previous one is used instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_model

from mhmoe.data import Tokenizer
from mhmoe.errors import CheckpointError
from mhmoe.model import LM
from mhmoe.runconfig import RunConfig

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


def save_checkpoint(run_dir: str | Path, step: int, model: LM, run: RunConfig, tokenizer: Tokenizer,
                    trainer_state: dict[str, Any], keep_last: int = 2) -> Path:
    """Write checkpoint ``step`` atomically and prune all but the newest ``keep_last``.

    Raises CheckpointError (and writes nothing) when the model holds NaN/Inf values.
    """
    if not model_is_finite(model):
        raise CheckpointError(f"refusing to save step {step}: the model has non-finite parameters")
    root = Path(run_dir) / CKPT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:08d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_model(model, str(tmp / "model.safetensors"))
        (tmp / "config.yaml").write_text(run.to_yaml(), encoding="utf-8")
        torch.save(trainer_state, tmp / "trainer_state.pt")
        tokenizer.save(tmp / "tokenizer")
        publish_checkpoint(tmp, final, run_dir, {"format_version": FORMAT_VERSION, "step": step}, keep_last)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


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


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> Checkpoint:
    """Load one verified checkpoint directory."""
    path = Path(path)
    meta = verify_checkpoint(path)
    if meta.get("format") == "dcp":  # sharded (torch.distributed.checkpoint), see mhmoe.distributed.checkpoint
        from mhmoe.distributed.checkpoint import load_dcp_single

        return load_dcp_single(path, int(meta["step"]), device)
    try:
        run = RunConfig.load(path / "config.yaml")
        model = LM(run.model)
        missing, unexpected = load_model(model, str(path / "model.safetensors"), strict=False)
        if [m for m in missing if not m.startswith("rope_")] or unexpected:
            raise CheckpointError(f"{path}: weights do not match the config (missing {missing[:3]}, "
                                  f"unexpected {unexpected[:3]})")
        state = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=True)
        tokenizer = Tokenizer.load(path / "tokenizer")
    except CheckpointError:
        raise
    except Exception as exc:  # corrupted content that passed the hash check (e.g. a foreign file)
        raise CheckpointError(f"{path}: cannot be loaded ({exc.__class__.__name__}: {exc})") from None
    return Checkpoint(path, int(meta["step"]), run, model.to(device), tokenizer, state)


def load_latest(run_or_ckpt: str | Path, device: str | torch.device = "cpu", warn: bool = True) -> Checkpoint:
    """Load the newest valid checkpoint of a run directory (or the given checkpoint directory).

    A corrupted or truncated checkpoint prints one line to stderr and falls back to the previous one.
    """
    p = Path(run_or_ckpt)
    if not p.exists():
        raise CheckpointError(f"{p}: no such run or checkpoint directory")
    if (p / "meta.json").is_file() or p.name.startswith(PREFIX):
        return load_checkpoint(p, device)
    candidates = list_checkpoints(p)
    if not candidates:
        raise CheckpointError(f"{p}: no checkpoints found (expected {p / CKPT_DIR / 'step_*'})")
    errors = []
    for c in reversed(candidates):
        try:
            return load_checkpoint(c, device)
        except CheckpointError as exc:
            errors.append(str(exc))
            if warn:
                print(f"mhmoe: warning: {exc}; falling back to the previous checkpoint", file=sys.stderr)
    raise CheckpointError(f"{p}: no valid checkpoint ({errors[0]})")
