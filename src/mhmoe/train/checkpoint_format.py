"""The on-disk checkpoint format shared by single-file and sharded (DCP) checkpoints: directory layout,
``meta.json`` (format version, step, sha256 and size of every file, written last), atomic publication
by rename, verification, and the :class:`Checkpoint` a loader returns. See :mod:`mhmoe.train.checkpoint`.

The torch-free part (names, verification, listing) is :mod:`mhmoe.runtime.checkpoint_files`, so that
:meth:`mhmoe.model.LM.from_pretrained` can read checkpoints from below this layer; it is re-exported here."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mhmoe.config.run import RunConfig
from mhmoe.data.tokenizer_base import Tokenizer
from mhmoe.errors import CheckpointError
from mhmoe.model.encoder import Encoder
from mhmoe.model.lm import LM
from mhmoe.runtime.checkpoint_files import (  # noqa: F401 -- re-exported: the file format lives in runtime/
    CKPT_DIR,
    FORMAT_VERSION,
    PREFIX,
    check_links,
    first_line,
    inside,
    list_checkpoints,
    verify_checkpoint,
)
from mhmoe.runtime.checkpoint_files import checkpoint_files as _files
from mhmoe.runtime.checkpoint_files import sha256_file as _sha256
from mhmoe.train.optim import build_optimizer

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
    model: LM | Encoder  # ModelConfig.arch: decoder | encoder
    tokenizer: Tokenizer
    trainer_state: dict[str, Any]
