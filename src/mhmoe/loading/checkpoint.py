"""A training checkpoint loaded back: the model (built by ``ModelConfig.arch``), its tokenizer and the
trainer state as stored, for ``eval``, ``export``, ``analyze`` and conversions (:func:`load_checkpoint`,
:func:`load_latest`).

The files are read by :mod:`mhmoe.checkpoint` (verified meta.json, safetensors or the restricted DCP
reader, ``weights_only`` trainer state) and the weights loaded by :func:`mhmoe.model.pretrained.load_model`,
the loader of ``LM.from_pretrained``. Nothing here checks the trainer state for a resume: that is
:mod:`mhmoe.train.resume`. A corrupted, truncated or unusable checkpoint of a run directory is reported in
one line and the previous one is used (:func:`mhmoe.checkpoint.format.newest_valid`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mhmoe.checkpoint.format import newest_valid
from mhmoe.checkpoint.layout import SAFETENSORS, CheckpointFormat
from mhmoe.checkpoint.read import open_checkpoint, read_trainer_state, unloadable
from mhmoe.config.run import RunConfig
from mhmoe.data.tokenizer import load_tokenizer
from mhmoe.data.tokenizer_base import Tokenizer
from mhmoe.model import build_model
from mhmoe.model.encoder import Encoder
from mhmoe.model.lm import LM
from mhmoe.model.pretrained import checkpoint_model_files, load_model


@dataclass
class Checkpoint:
    """A loaded checkpoint directory: its step, run config, model (``ModelConfig.arch``: an :class:`LM` or an
    :class:`Encoder`; None while a torchrun resume has not loaded it), tokenizer, trainer state (as stored:
    counters, scheduler, RNG and, single-file format, the optimizer; None until loaded) and format."""

    path: Path
    step: int
    run: RunConfig
    model: LM | Encoder | None
    tokenizer: Tokenizer
    trainer_state: dict[str, Any] | None
    format: CheckpointFormat = SAFETENSORS


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> Checkpoint:
    """Load one verified checkpoint directory (single-file or DCP): model, tokenizer and trainer state.
    CheckpointError (one line) for anything unloadable."""
    files = open_checkpoint(Path(path))
    model = load_model(checkpoint_model_files(files), build_model)
    with unloadable(files.path):
        state = read_trainer_state(files.path)
        tokenizer = load_tokenizer(files.tokenizer_dir)
    return Checkpoint(files.path, files.step, files.run, model.to(device), tokenizer, state, files.format)


def load_latest(run_or_ckpt: str | Path, device: str | torch.device = "cpu", warn: bool = True) -> Checkpoint:
    """Load the newest valid checkpoint of a run directory (or the given checkpoint directory): a
    corrupted or truncated one prints one line to stderr (``warn``) and the previous one is loaded."""
    return newest_valid(run_or_ckpt, lambda c: load_checkpoint(c, device), warn=warn)
