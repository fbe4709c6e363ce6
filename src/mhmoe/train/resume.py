"""What a resume needs beyond loading a checkpoint: the trainer state checked for the checkpoint's step,
the optimizer state in ``optimizer.state_dict()`` form checked against the model (:func:`load_for_resume`,
:func:`load_latest_for_resume`), and the launch properties a resumed run takes from the command
(:data:`LAUNCH_FIELDS`, :func:`resumed_run`).

A checkpoint whose trainer state cannot resume (counters, scheduler, RNG or optimizer missing, of the
wrong type or shape) is refused with one line, so the resume falls back to the previous checkpoint
(:func:`mhmoe.checkpoint.format.newest_valid`) instead of failing half-way.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mhmoe.checkpoint.format import newest_valid
from mhmoe.checkpoint.layout import DCP, SAFETENSORS, TRAINER_STATE_FILE
from mhmoe.checkpoint.read import check_trainer_state, read_dcp_part, unloadable
from mhmoe.config.run import RunConfig
from mhmoe.errors import CheckpointError, one_line
from mhmoe.loading.checkpoint import Checkpoint, load_checkpoint
from mhmoe.train.optim import build_optimizer

#: taken from the command on --resume (properties of this launch and machine, not of the run); the CLI
#: leaves max_steps out unless --max-steps (or --set train.max_steps) is given, so the run keeps its schedule
LAUNCH_FIELDS = ("max_steps", "threads", "parallel", "ep", "activation_checkpointing")
#: what a branch (``mhmoe train --branch-from``) may change besides the launch fields: the learning-rate schedule's
#: shape from the branch point on (a wsd cooldown branched from the stable phase), never what the optimizer state,
#: the data order or the model depend on
BRANCH_FIELDS = ("schedule", "min_lr_ratio", "cooldown_fraction", "cooldown_shape")
# where this machine caches tokens or keeps a data bundle: never a checkpoint's choice
LAUNCH_DATA_FIELDS = ("cache_dir", "bundle")


def resumed_run(ckpt: Checkpoint, launch: RunConfig, launch_fields: tuple[str, ...] = LAUNCH_FIELDS) -> RunConfig:
    """The checkpoint's run config, with the launch properties (``launch_fields`` of ``train``,
    :data:`LAUNCH_DATA_FIELDS` of ``data``) of this command."""
    d = ckpt.run.to_dict()
    d["train"].update({k: getattr(launch.train, k) for k in launch_fields})
    d["data"].update({k: getattr(launch.data, k) for k in LAUNCH_DATA_FIELDS})
    return RunConfig.from_dict(d)


def _bad_optimizer(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"{path}: {TRAINER_STATE_FILE} {what}")


def check_optimizer_state(path: Path, model: nn.Module, run: RunConfig, saved: dict[str, Any]) -> None:
    """``saved`` (an AdamW ``state_dict``) fits ``model``: it loads into the run's optimizer and every
    moment tensor has its parameter's shape; CheckpointError otherwise."""
    opt = build_optimizer(model, run.train)
    try:
        opt.load_state_dict(saved)
    except (ValueError, KeyError, TypeError, IndexError, RuntimeError) as exc:
        raise _bad_optimizer(path, f"holds an optimizer state that does not fit the model "
                                   f"({exc.__class__.__name__}: {one_line(exc)})") from None
    for p in (q for g in opt.param_groups for q in g["params"]):
        for k, v in opt.state.get(p, {}).items():
            if k != "step" and (not isinstance(v, torch.Tensor) or v.shape != p.shape):
                raise _bad_optimizer(path, f"holds an optimizer {k!r} of the wrong shape for a "
                                           f"{tuple(p.shape)} parameter")


def index_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> dict:
    """An FQN-keyed AdamW state dict (as a DCP checkpoint stores it) -> ``optimizer.state_dict()`` form."""
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


def optimizer_state(ck: Checkpoint) -> dict[str, Any] | None:
    """The optimizer state of a loaded checkpoint in ``optimizer.state_dict()`` form: the trainer state's
    (single-file format), or the DCP checkpoint's FQN-keyed one indexed for the run's optimizer (None
    when a single-file trainer state holds none)."""
    assert ck.model is not None and ck.trainer_state is not None
    if ck.format == DCP:
        with unloadable(ck.path):
            saved = read_dcp_part(ck.path, "optim")
            return index_optimizer_state(ck.model, build_optimizer(ck.model, ck.run.train), saved)
    return ck.trainer_state.get("optimizer")


def load_for_resume(path: str | Path, device: str | torch.device = "cpu") -> Checkpoint:
    """:func:`mhmoe.loading.checkpoint.load_checkpoint` with a trainer state that can resume: counters at
    the checkpoint's step, scheduler, RNG (:func:`mhmoe.checkpoint.read.check_trainer_state`) and, under
    ``"optimizer"``, an optimizer state that fits the model. CheckpointError (one line) otherwise."""
    ck = load_checkpoint(path, "cpu")  # checked on the CPU, then moved
    assert ck.model is not None
    with unloadable(ck.path):
        state = check_trainer_state(ck.path, ck.trainer_state, ck.step, with_optimizer=ck.format == SAFETENSORS)
        state = {**state, "optimizer": optimizer_state(ck)}
        check_optimizer_state(ck.path, ck.model, ck.run, state["optimizer"])
    return dataclasses.replace(ck, model=ck.model.to(device), trainer_state=state)


def load_latest_for_resume(run_dir: str | Path, device: str | torch.device = "cpu", warn: bool = True) -> Checkpoint:
    """The newest checkpoint of ``run_dir`` that can resume (:func:`load_for_resume`); a damaged one is
    reported in one line (``warn``) and the previous one is tried."""
    return newest_valid(run_dir, lambda c: load_for_resume(c, device), warn=warn)
