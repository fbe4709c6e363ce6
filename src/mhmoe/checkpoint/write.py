"""Writing checkpoints: single-file (:func:`save_checkpoint`) and, in one process, sharded DCP
(:func:`save_dcp_checkpoint_alone`; the collective writer of torchrun jobs is
:func:`mhmoe.parallel.checkpoint.save_dcp_checkpoint`, built from the same pieces).

Every checkpoint is written into a fresh hidden ``checkpoints/.tmp-step_N-*`` directory, then
:func:`~mhmoe.checkpoint.format.publish_checkpoint` adds ``meta.json``, fsyncs the files and directories
and renames it into place; a failure removes the temporary directory and leaves the older checkpoints
as they were. Running out of space (ENOSPC, the file-size limit, the quota) raises
:class:`~mhmoe.errors.NoSpaceError`: ``"No space left on device while saving step N to PATH; the previous
checkpoint step M is intact"``.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from mhmoe.checkpoint.format import list_checkpoints, publish_checkpoint
from mhmoe.checkpoint.layout import (
    CONFIG_FILE,
    DCP,
    DCP_DIR,
    FORMAT_VERSION,
    TOKENIZER_DIR,
    TRAINER_STATE_FILE,
    WEIGHTS_FILE,
    checkpoint_path,
    step_of,
)
from mhmoe.errors import CheckpointError
from mhmoe.runtime.files import atomic_write, new_staging_dir, no_space_error, remove_tree


def model_is_finite(model: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def stage_checkpoint(run_dir: str | Path, step: int, tag: str) -> tuple[Path, Path]:
    """``(tmp, final)``: a fresh staging directory ``RUN/checkpoints/.tmp-step_N-TAG`` and the name it is
    published under. Symlinks at ``checkpoints`` (or the staging name) are refused, never followed."""
    final = checkpoint_path(run_dir, step)
    return new_staging_dir(final, root=run_dir, tag=tag), final


def write_common_files(tmp: Path, run: Any, tokenizer: Any, trainer_state: dict[str, Any]) -> None:
    """``config.yaml`` (``run``: a RunConfig), ``trainer_state.pt`` and ``tokenizer/`` (``tokenizer``: a
    :class:`mhmoe.data.Tokenizer`) into the staging directory ``tmp``."""
    atomic_write(tmp / CONFIG_FILE, run.to_yaml(), durable=False)  # fsync'd when published
    with open(tmp / TRAINER_STATE_FILE, "wb") as f:  # a file object: a write error surfaces as OSError
        torch.save(trainer_state, f)
    tokenizer.save(tmp / TOKENIZER_DIR)


@contextlib.contextmanager
def saving(run_dir: str | Path, step: int, final: Path | None = None) -> Iterator[None]:
    """Context of one checkpoint save: running out of space becomes a one-line NoSpaceError naming the
    step, the path and the newest checkpoint that stays intact."""
    before = list_checkpoints(run_dir)
    try:
        yield
    except BaseException as exc:
        where = final or checkpoint_path(run_dir, step)
        kept = (f"the previous checkpoint step {step_of(before[-1].name)} is intact" if before
                else "no earlier checkpoint exists")
        err = no_space_error(exc, f"while saving step {step} to {where}; {kept}")
        if err is not None:
            raise err from None
        raise


def _save(run_dir: str | Path, step: int, tag: str, write: Callable[[Path], None], meta: dict[str, Any],
          keep_last: int) -> Path:
    with saving(run_dir, step):
        tmp, final = stage_checkpoint(run_dir, step, tag)
        try:
            write(tmp)
            publish_checkpoint(tmp, final, run_dir, {"format_version": FORMAT_VERSION, **meta, "step": step},
                               keep_last)
        finally:
            remove_tree(tmp)  # gone after a successful publish; a half-written one after a failure
    return final


def save_checkpoint(run_dir: str | Path, step: int, model: torch.nn.Module, run: Any, tokenizer: Any,
                    trainer_state: dict[str, Any], keep_last: int = 2) -> Path:
    """Write single-file checkpoint ``step`` of ``run_dir`` atomically and durably and prune all but the
    newest ``keep_last``: ``model.safetensors`` (tied tensors once), ``config.yaml``, ``trainer_state.pt``
    (optimizer, scheduler, RNG, counters), ``tokenizer/``, ``meta.json`` last.

    Raises CheckpointError (and writes nothing) when the model holds NaN/Inf values, NoSpaceError when
    the disk fills up (the older checkpoints stay as they were)."""
    if not model_is_finite(model):
        raise CheckpointError(f"refusing to save step {step}: the model has non-finite parameters")
    from safetensors.torch import save_model

    def write(tmp: Path) -> None:
        save_model(model, str(tmp / WEIGHTS_FILE))
        write_common_files(tmp, run, tokenizer, trainer_state)

    return _save(run_dir, step, str(os.getpid()), write, {}, keep_last)


def save_dcp_checkpoint_alone(run_dir: str | Path, step: int, state: dict[str, Any], run: Any, tokenizer: Any,
                              trainer_state: dict[str, Any], keep_last: int = 2) -> Path:
    """Write DCP checkpoint ``step`` from this process alone (no process group): ``state`` is
    ``{"model": FQN -> tensor, "optim": FQN-keyed optimizer state}`` (full tensors); the trainer state
    is written without its optimizer (which is in ``state``)."""
    import torch.distributed.checkpoint as dcp

    def write(tmp: Path) -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to")  # single process: intended
            dcp.save(state, checkpoint_id=str(tmp / DCP_DIR), no_dist=True)
        write_common_files(tmp, run, tokenizer, {k: v for k, v in trainer_state.items() if k != "optimizer"})

    return _save(run_dir, step, DCP, write, {"format": DCP, "world_size": 1, "ep": 1}, keep_last)
