"""Reading a sharded ``torch.distributed.checkpoint`` (DCP) checkpoint in one process, without a process
group, through the restricted reader of :mod:`mhmoe.train.dcp_safe` (loading never runs code from the
checkpoint): ``eval``, ``generate`` and a single-process ``train --resume`` accept the checkpoints torchrun runs
write (:mod:`mhmoe.parallel.checkpoint` writes them and loads them into sharded models).

Layout: see :mod:`mhmoe.parallel.checkpoint`. The optimizer state is stored FQN-keyed; here it is
turned back into ``optimizer.state_dict()`` form for a single-process AdamW.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from mhmoe.config.run import RunConfig
from mhmoe.data.tokenizer import load_tokenizer
from mhmoe.errors import CheckpointError
from mhmoe.model import build_model
from mhmoe.train.checkpoint_format import Checkpoint, check_optimizer_state, check_trainer_state, first_line
from mhmoe.train.dcp_safe import read_dcp_full as safe_read_dcp_full
from mhmoe.train.optim import build_optimizer

DCP_DIR = "dcp"


def read_dcp_full(path: str | Path) -> dict[str, Any]:
    """All of a DCP checkpoint's tensors as full (unsharded) tensors, in this process (no process
    group needed): ``{"model": {...}, "optim": {...}}``. Read with :func:`mhmoe.train.dcp_safe.read_dcp_full`
    (restricted unpickling only)."""
    full = safe_read_dcp_full(Path(path) / DCP_DIR)
    if not isinstance(full.get("model"), dict) or not isinstance(full.get("optim"), dict):
        raise CheckpointError(f"{path}: the DCP checkpoint holds no model and optimizer state")
    return full


def load_trainer_state(path: Path, step: int | None = None, for_resume: bool = True) -> dict[str, Any]:
    """``trainer_state.pt`` with ``weights_only=True`` (tensors and plain values; nothing else is unpickled);
    ``for_resume``: checked for what a resume of step ``step`` needs
    (:func:`~mhmoe.train.checkpoint_format.check_trainer_state`; default step: the one the file records)."""
    try:
        state = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 -- UnpicklingError for a crafted file, OSError, ...
        raise CheckpointError(f"{path}: trainer_state.pt cannot be loaded ({exc.__class__.__name__}: "
                              f"{first_line(exc)})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: trainer_state.pt is a {type(state).__name__}, not a dict")
    if not for_resume:
        return state
    return check_trainer_state(path, state, state.get("step") if step is None else step, with_optimizer=False)


def _index_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> dict:
    """An FQN-keyed AdamW state dict (as saved) -> ``optimizer.state_dict()`` form (integer ids)."""
    fqns: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        fqns.setdefault(id(p), []).append(n)
    state, groups, i = {}, [], 0
    for g, g_saved in zip(optimizer.param_groups, saved["param_groups"], strict=True):
        ids = []
        for p in g["params"]:
            hit = [n for n in fqns[id(p)] if n in saved["state"]]
            if hit:
                state[i] = saved["state"][hit[0]]
            ids.append(i)
            i += 1
        groups.append({**{k: v for k, v in g_saved.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": groups}


def load_dcp_single(path: str | Path, step: int, device: str | torch.device = "cpu",
                    for_resume: bool = False) -> Checkpoint:
    """A DCP checkpoint as a single-process :class:`~mhmoe.train.checkpoint.Checkpoint` (full model; the
    trainer state carries the optimizer state in ``optimizer.state_dict()`` form, checked ``for_resume``)."""
    path = Path(path)
    try:
        run = RunConfig.load(path / "config.yaml")
        model = build_model(run.model)
        full = read_dcp_full(path)
        missing, unexpected = model.load_state_dict(full["model"], strict=False)
        if [m for m in missing if not m.startswith("rope_")] or unexpected:
            raise CheckpointError(f"{path}: weights do not match the config (missing {missing[:3]}, "
                                  f"unexpected {unexpected[:3]})")
        state = load_trainer_state(path, step, for_resume)
        state["optimizer"] = _index_optimizer_state(model, build_optimizer(model, run.train), full["optim"])
        if for_resume:
            check_optimizer_state(path, model, run, state["optimizer"])
        tokenizer = load_tokenizer(path / "tokenizer")
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot be loaded ({exc.__class__.__name__}: {first_line(exc)})") from None
    return Checkpoint(path, step, run, model.to(device), tokenizer, state)
