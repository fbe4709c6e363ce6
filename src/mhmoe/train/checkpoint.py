"""Checkpoints: safetensors weights + YAML config + trainer state + tokenizer, written atomically.

Layout of one checkpoint (``RUN/checkpoints/step_00000600/``)::

    model.safetensors     weights (tied tensors stored once)
    config.yaml           the full RunConfig
    trainer_state.pt      optimizer, LR scheduler, RNG states, step, counters (tensors + plain data,
                          loaded with ``weights_only=True``: torch's allow-list unpickler builds
                          tensors and plain values only, so no code from the file runs)
    tokenizer/            the tokenizer files (see mhmoe.data.Tokenizer.save)
    meta.json             step, format version and the sha256 of every file above (written last)

Multi-process runs write sharded ``torch.distributed.checkpoint`` checkpoints instead (``dcp/`` in
place of the safetensors and optimizer files, ``"format": "dcp"`` in meta.json); loading them here
gathers the full model in one process (see :mod:`mhmoe.train.dcp_reader`).

Checkpoints are downloaded and shared, so loading one never executes code from it (DCP metadata is
read by the restricted unpickler of :mod:`mhmoe.train.dcp_safe`), and never reads outside its
directory: meta.json's file names must be relative, without ``..``, and no symlink in the checkpoint
may lead out of it.

A checkpoint is written into a hidden temporary directory and renamed into place, so a crash never
leaves a half-written checkpoint under a real name (the temporary directories a killed run leaves are
removed by the next run, :func:`~mhmoe.train.checkpoint_format.remove_stale_temporaries`). Loading
verifies sizes and hashes; a corrupted or truncated checkpoint is reported in one line and the
previous one is used instead. For a resume (``for_resume=True``) the trainer state must also hold
counters, scheduler and RNG state of the checkpoint's step and an optimizer state that fits the model
(:func:`~mhmoe.train.checkpoint_format.check_trainer_state`), else it falls back the same way.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_model

from mhmoe.config.run import RunConfig
from mhmoe.data.tokenizer import load_tokenizer
from mhmoe.data.tokenizer_base import Tokenizer
from mhmoe.errors import CheckpointError
from mhmoe.model import build_model
from mhmoe.train.checkpoint_format import (
    CKPT_DIR,
    FORMAT_VERSION,
    PREFIX,
    Checkpoint,
    check_optimizer_state,
    check_trainer_state,
    first_line,
    list_checkpoints,
    model_is_finite,
    publish_checkpoint,
    verify_checkpoint,
    warn_if_unsafe_torch,
)
from mhmoe.train.dcp_reader import load_dcp_single


def save_checkpoint(run_dir: str | Path, step: int, model: torch.nn.Module, run: RunConfig, tokenizer: Tokenizer,
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


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu", for_resume: bool = False) -> Checkpoint:
    """Load one verified checkpoint directory. ``for_resume``: also check that the trainer state holds
    everything a resume needs (counters at the checkpoint's step, scheduler, RNG, an optimizer state that
    fits the model), so a damaged one is refused here (and :func:`load_latest` falls back)."""
    path = Path(path)
    meta = verify_checkpoint(path)
    warn_if_unsafe_torch(torch.__version__)
    if meta.get("format") == "dcp":  # sharded (torch.distributed.checkpoint), see mhmoe.train.dcp_reader
        return load_dcp_single(path, int(meta["step"]), device, for_resume)
    try:
        run = RunConfig.load(path / "config.yaml")
        model = build_model(run.model)
        missing, unexpected = load_model(model, str(path / "model.safetensors"), strict=False)
        if [m for m in missing if not m.startswith("rope_")] or unexpected:
            raise CheckpointError(f"{path}: weights do not match the config (missing {missing[:3]}, "
                                  f"unexpected {unexpected[:3]})")
        state = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=True)
        if not isinstance(state, dict):
            raise CheckpointError(f"{path}: trainer_state.pt is a {type(state).__name__}, not a dict")
        if for_resume:
            check_trainer_state(path, state, int(meta["step"]), with_optimizer=True)
            check_optimizer_state(path, model, run, state["optimizer"])
        tokenizer = load_tokenizer(path / "tokenizer")
    except CheckpointError:
        raise
    except Exception as exc:  # corrupted content that passed the hash check (e.g. a foreign file)
        raise CheckpointError(f"{path}: cannot be loaded ({exc.__class__.__name__}: {first_line(exc)})") from None
    return Checkpoint(path, int(meta["step"]), run, model.to(device), tokenizer, state)


def load_latest(run_or_ckpt: str | Path, device: str | torch.device = "cpu", warn: bool = True,
                for_resume: bool = False) -> Checkpoint:
    """Load the newest valid checkpoint of a run directory (or the given checkpoint directory).

    A corrupted or truncated checkpoint prints one line to stderr and falls back to the previous one
    (``for_resume``: also one whose trainer state cannot resume, see :func:`load_checkpoint`).
    """
    p = Path(run_or_ckpt)
    if not p.exists():
        raise CheckpointError(f"{p}: no such run or checkpoint directory")
    if (p / "meta.json").is_file() or p.name.startswith(PREFIX):
        return load_checkpoint(p, device, for_resume)
    candidates = list_checkpoints(p)
    if not candidates:
        raise CheckpointError(f"{p}: no checkpoints found (expected {p / CKPT_DIR / 'step_*'})")
    errors = []
    for c in reversed(candidates):
        try:
            return load_checkpoint(c, device, for_resume)
        except CheckpointError as exc:
            errors.append(str(exc))
            if warn:
                print(f"mhmoe: warning: {exc}; falling back to the previous checkpoint", file=sys.stderr)
    raise CheckpointError(f"{p}: no valid checkpoint ({errors[0]})")


__all__ = [
    "CKPT_DIR", "FORMAT_VERSION", "PREFIX", "Checkpoint", "list_checkpoints", "load_checkpoint", "load_latest",
    "first_line", "model_is_finite", "publish_checkpoint", "save_checkpoint", "verify_checkpoint",
]
