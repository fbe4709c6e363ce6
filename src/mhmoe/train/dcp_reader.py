"""Reading a sharded ``torch.distributed.checkpoint`` (DCP) checkpoint in one process, without a process
group: ``eval``, ``generate`` and a single-process ``train --resume`` accept the checkpoints torchrun runs
write (:mod:`mhmoe.parallel.checkpoint` writes them and loads them into sharded models).

Layout: see :mod:`mhmoe.parallel.checkpoint`. The optimizer state is stored FQN-keyed; here it is
turned back into ``optimizer.state_dict()`` form for a single-process AdamW.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mhmoe.config.run import RunConfig
from mhmoe.data.tokenizer import load_tokenizer
from mhmoe.errors import CheckpointError
from mhmoe.model.lm import LM
from mhmoe.train.checkpoint_format import Checkpoint
from mhmoe.train.optim import build_optimizer

DCP_DIR = "dcp"


def read_dcp_full(path: str | Path) -> dict[str, Any]:
    """All of a DCP checkpoint's tensors as full (unsharded) tensors, in this process (no process
    group needed): ``{"model": {...}, "optim": {...}}``. Uses ``format_utils.dcp_to_torch_save``."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory(prefix="mhmoe-dcp-") as td, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")  # single process: intended
        out = Path(td) / "full.pt"
        dcp_to_torch_save(str(Path(path) / DCP_DIR), str(out))
        return torch.load(out, map_location="cpu", weights_only=True)


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


def load_dcp_single(path: str | Path, step: int, device: str | torch.device = "cpu") -> Checkpoint:
    """A DCP checkpoint as a single-process :class:`~mhmoe.train.checkpoint.Checkpoint` (full model; the
    trainer state carries the optimizer state in ``optimizer.state_dict()`` form)."""
    path = Path(path)
    try:
        run = RunConfig.load(path / "config.yaml")
        model = LM(run.model)
        full = read_dcp_full(path)
        missing, unexpected = model.load_state_dict(full["model"], strict=False)
        if [m for m in missing if not m.startswith("rope_")] or unexpected:
            raise CheckpointError(f"{path}: weights do not match the config (missing {missing[:3]}, "
                                  f"unexpected {unexpected[:3]})")
        state = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=True)
        state["optimizer"] = _index_optimizer_state(model, build_optimizer(model, run.train), full["optim"])
        tokenizer = load_tokenizer(path / "tokenizer")
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot be loaded ({exc.__class__.__name__}: {exc})") from None
    return Checkpoint(path, step, run, model.to(device), tokenizer, state)
