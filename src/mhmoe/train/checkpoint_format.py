"""The on-disk checkpoint format shared by single-file and sharded (DCP) checkpoints: directory layout,
``meta.json`` (format version, step, sha256 and size of every file, written last), atomic publication
by rename, verification, and the :class:`Checkpoint` a loader returns. See :mod:`mhmoe.train.checkpoint`."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch

from mhmoe.config.run import RunConfig
from mhmoe.data.tokenizer_base import Tokenizer
from mhmoe.errors import CheckpointError
from mhmoe.model.lm import LM
from mhmoe.train.optim import build_optimizer

FORMAT_VERSION = 1
CKPT_DIR = "checkpoints"
PREFIX = "step_"
#: torch.load(weights_only=True) had code-execution bugs before this version (CVE-2025-32434 before 2.6,
#: CVE-2026-24747 before 2.10); trainer_state.pt and DCP items are read with it
SAFE_TORCH = (2, 10)


def torch_version(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of ``version`` (default: the installed torch)."""
    major, minor = (int(x) for x in re.findall(r"\d+", str(version or torch.__version__))[:2])
    return major, minor


@functools.cache
def warn_if_unsafe_torch(version: str) -> bool:
    """Once per process and version: a one-line warning when this torch's ``weights_only`` unpickler has
    known code-execution bugs (see :data:`SAFE_TORCH`). Returns whether the version is unsafe."""
    if torch_version(version) >= SAFE_TORCH:
        return False
    print(f"mhmoe: warning: torch {version} has known code-execution bugs in torch.load(weights_only=True) "
          "(CVE-2025-32434, CVE-2026-24747): load checkpoints you did not write only with torch >= "
          f"{SAFE_TORCH[0]}.{SAFE_TORCH[1]}", file=sys.stderr)
    return True


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


def remove_stale_temporaries(run_dir: str | Path) -> list[Path]:
    """Remove the hidden ``checkpoints/.tmp-*`` directories a killed run left behind (a checkpoint being
    written when the process died); call only while holding the run directory's lock (no writer is
    active). Returns what was removed."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    stale = [p for p in root.iterdir() if p.name.startswith(".tmp-") and p.is_dir() and not p.is_symlink()]
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


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


def _bad(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"{path}: trainer_state.pt {what}")


def check_trainer_state(path: Path, state: Any, step: int, with_optimizer: bool) -> dict[str, Any]:
    """The trainer state of checkpoint ``step`` has what a resume needs, with the right types: counters
    (``step`` equal to the checkpoint's), the LR scheduler at that step, the CPU RNG state and (single-file
    checkpoints) the optimizer state dict. CheckpointError otherwise, so a resume falls back to an older
    checkpoint instead of failing half-way."""
    if not isinstance(state, dict):
        raise _bad(path, f"is a {type(state).__name__}, not a dict")
    need = {"step": int, "nan_total": int, "tokens_seen": int, "train_s": (int, float), "scheduler": dict,
            "rng_cpu": torch.Tensor, **({"optimizer": dict} if with_optimizer else {})}
    for key, kind in need.items():
        if not isinstance(state.get(key), kind) or isinstance(state.get(key), bool):
            raise _bad(path, f"lacks {key!r} (or it is not a {getattr(kind, '__name__', 'number')})")
    if state["step"] != step or min(state["nan_total"], state["tokens_seen"], state["train_s"]) < 0:
        raise _bad(path, f"holds step {state['step']} and counters that do not match checkpoint step {step}")
    sched = state["scheduler"]
    if sched.get("last_epoch") != step or any(not isinstance(k, str) or k.startswith("__") or k == "optimizer"
                                              for k in sched):
        raise _bad(path, f"holds a scheduler state that is not at step {step}")
    rng = state["rng_cpu"]
    if rng.dtype != torch.uint8 or rng.shape != torch.get_rng_state().shape:
        raise _bad(path, "holds a malformed CPU RNG state")
    if with_optimizer:
        opt = state["optimizer"]
        if not isinstance(opt.get("state"), dict) or not isinstance(opt.get("param_groups"), list):
            raise _bad(path, "holds no optimizer state ('state' and 'param_groups')")
    return state


def check_optimizer_state(path: Path, model: LM, run: RunConfig, saved: dict[str, Any]) -> None:
    """``saved`` (an AdamW ``state_dict``) fits ``model``: it loads into the run's optimizer and every
    moment tensor has its parameter's shape; CheckpointError otherwise."""
    opt = build_optimizer(model, run.train)
    try:
        opt.load_state_dict(saved)
    except (ValueError, KeyError, TypeError, IndexError, RuntimeError) as exc:
        raise _bad(path, f"holds an optimizer state that does not fit the model ({exc.__class__.__name__}: "
                         f"{first_line(exc)})") from None
    for p in (q for g in opt.param_groups for q in g["params"]):
        for k, v in opt.state.get(p, {}).items():
            if k != "step" and (not isinstance(v, torch.Tensor) or v.shape != p.shape):
                raise _bad(path, f"holds an optimizer {k!r} of the wrong shape for a {tuple(p.shape)} parameter")


@dataclass
class Checkpoint:
    path: Path
    step: int
    run: RunConfig
    model: LM
    tokenizer: Tokenizer
    trainer_state: dict[str, Any]
