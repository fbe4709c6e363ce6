"""Conversions between the single-file and the sharded DCP checkpoint format, in one process
(``mhmoe convert-checkpoint``; a torchrun resume of a single-file checkpoint converts with :func:`to_dcp`).
Both keep the step, run config, tokenizer, trainer state and optimizer state."""

from __future__ import annotations

from pathlib import Path

from mhmoe.checkpoint.write import model_is_finite, save_checkpoint, save_dcp_checkpoint_alone
from mhmoe.errors import CheckpointError
from mhmoe.loading.checkpoint import load_checkpoint
from mhmoe.train.optim import build_optimizer
from mhmoe.train.resume import optimizer_state


def dcp_to_safetensors(src: str | Path, out_run_dir: str | Path) -> Path:
    """Convert DCP checkpoint ``src`` into a single-file checkpoint ``OUT/checkpoints/step_N``."""
    ck = load_checkpoint(src)
    assert ck.model is not None and ck.trainer_state is not None
    state = {**ck.trainer_state, "optimizer": optimizer_state(ck)}
    return save_checkpoint(out_run_dir, ck.step, ck.model, ck.run, ck.tokenizer, state)


def safetensors_to_dcp(src: str | Path, out_run_dir: str | Path) -> Path:
    """Convert a checkpoint (single-file or DCP) into a DCP checkpoint ``OUT/checkpoints/step_N``, in this
    process (``train --resume`` under torchrun does this by itself for a single-file one)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        raise CheckpointError("safetensors_to_dcp runs in a single process (no process group)")
    return to_dcp(src, out_run_dir)


def to_dcp(src: str | Path, out_run_dir: str | Path) -> Path:
    """:func:`safetensors_to_dcp` by this process alone, also inside a process group (rank 0 of a torchrun
    resume converts a single-file checkpoint with it)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    ck = load_checkpoint(src)
    assert ck.model is not None and ck.trainer_state is not None
    if not model_is_finite(ck.model):
        raise CheckpointError(f"refusing to save step {ck.step}: the model has non-finite parameters")
    optimizer = build_optimizer(ck.model, ck.run.train)
    saved = optimizer_state(ck)
    if saved is not None:
        optimizer.load_state_dict(saved)
    msd, osd = get_state_dict(ck.model, optimizer)
    return save_dcp_checkpoint_alone(out_run_dir, ck.step, {"model": msd, "optim": osd}, ck.run, ck.tokenizer,
                                     ck.trainer_state)
