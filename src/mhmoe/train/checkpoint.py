"""Old import path of the loaders, kept while their importers move (removed afterwards): loading is
:mod:`mhmoe.loading` (``Checkpoint``, ``load_checkpoint``, ``load_latest``, ``mhmoe.load``, ``Pretrained``,
sampling defaults), a resume's checks :mod:`mhmoe.train.resume`, the conversions :mod:`mhmoe.train.convert`."""

from __future__ import annotations

from pathlib import Path

import torch

from mhmoe.checkpoint.format import list_checkpoints, verify_checkpoint
from mhmoe.checkpoint.layout import CKPT_DIR, FORMAT_VERSION, PREFIX
from mhmoe.checkpoint.write import model_is_finite, save_checkpoint
from mhmoe.loading.checkpoint import Checkpoint
from mhmoe.loading.checkpoint import load_checkpoint as _load_checkpoint
from mhmoe.loading.checkpoint import load_latest as _load_latest
from mhmoe.loading.pretrained import (
    MAX_NEW_TOKENS,
    SEED,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    Pretrained,
    check_sampling,
    load,
)
from mhmoe.train.convert import dcp_to_safetensors, safetensors_to_dcp, to_dcp
from mhmoe.train.resume import (
    check_optimizer_state,
    index_optimizer_state,
    load_for_resume,
    load_latest_for_resume,
)


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu", for_resume: bool = False) -> Checkpoint:
    return load_for_resume(path, device) if for_resume else _load_checkpoint(path, device)


def load_latest(run_or_ckpt: str | Path, device: str | torch.device = "cpu", warn: bool = True,
                for_resume: bool = False) -> Checkpoint:
    if for_resume:
        return load_latest_for_resume(run_or_ckpt, device, warn)
    return _load_latest(run_or_ckpt, device, warn)


__all__ = [
    "CKPT_DIR", "FORMAT_VERSION", "MAX_NEW_TOKENS", "PREFIX", "SEED", "TEMPERATURE", "TOP_K", "TOP_P", "Checkpoint",
    "Pretrained", "check_optimizer_state", "check_sampling", "dcp_to_safetensors", "index_optimizer_state",
    "list_checkpoints", "load", "load_checkpoint", "load_latest", "model_is_finite", "safetensors_to_dcp",
    "save_checkpoint", "to_dcp", "verify_checkpoint",
]
