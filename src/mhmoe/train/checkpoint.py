"""What training writes, loaded back: a :class:`Checkpoint` (model, tokenizer, trainer state) for a
resume, ``eval`` or an export (:func:`load_checkpoint`, :func:`load_latest`), conversions between the
single-file and the sharded DCP format, and ``mhmoe.load`` (:func:`load`): a model with its tokenizer,
ready to generate from Python.

The files themselves are read and written by :mod:`mhmoe.checkpoint` (format, verification, the
restricted DCP reader, atomic and durable saving); this module builds the model (:mod:`mhmoe.model`),
the tokenizer (:mod:`mhmoe.data`) and, for a resume, checks the optimizer state against the model.
Loading never executes code from the files and never reads outside the directory. A corrupted,
truncated or unusable checkpoint of a run directory is reported in one line and the previous one is
used (:func:`mhmoe.checkpoint.newest_valid`); for a resume (``for_resume=True``) the trainer state must
also hold counters, scheduler and RNG state of the checkpoint's step and an optimizer state that fits
the model, else it falls back the same way.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mhmoe.checkpoint import (
    CKPT_DIR,
    FORMAT_VERSION,
    PREFIX,
    CheckpointFiles,
    is_checkpoint_dir,
    list_checkpoints,
    model_is_finite,
    newest_valid,
    open_checkpoint,
    read_trainer_state,
    read_weights,
    save_checkpoint,
    save_dcp_checkpoint_alone,
    verify_checkpoint,
)
from mhmoe.config.run import RunConfig
from mhmoe.data.tokenizer import load_tokenizer
from mhmoe.data.tokenizer_base import Tokenizer
from mhmoe.errors import CheckpointError, ConfigError, one_line
from mhmoe.model import build_model
from mhmoe.model.encoder import Encoder
from mhmoe.model.generate import generate
from mhmoe.model.lm import LM
from mhmoe.model.pretrained import CONFIG_FILE, load_state, saved_dir_files
from mhmoe.runtime.device import resolve_device
from mhmoe.train.optim import build_optimizer

# sampling defaults of `mhmoe generate` and Pretrained.generate
MAX_NEW_TOKENS, TEMPERATURE, TOP_K, TOP_P, SEED = 100, 0.8, 50, 0.95, 0


@dataclass
class Checkpoint:
    path: Path
    step: int
    run: RunConfig
    model: LM | Encoder  # ModelConfig.arch: decoder | encoder
    tokenizer: Tokenizer
    trainer_state: dict[str, Any]


# ---- loading ---------------------------------------------------------------------------------------------
def _bad_optimizer(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"{path}: trainer_state.pt {what}")


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


def _load(files: CheckpointFiles, device: str | torch.device, for_resume: bool) -> Checkpoint:
    path, run = files.path, files.run
    model = build_model(run.model)
    if files.format == "dcp":  # sharded: model and FQN-keyed optimizer gathered in this process
        from mhmoe.checkpoint.dcp_reader import read_dcp

        full = read_dcp(path)
        load_state(model, full["model"], path)
        state = read_trainer_state(path, files.step, for_resume, with_optimizer=False)
        state["optimizer"] = index_optimizer_state(model, build_optimizer(model, run.train), full["optim"])
    else:
        load_state(model, read_weights(files), path)
        state = read_trainer_state(path, files.step, for_resume, with_optimizer=True)
    if for_resume:
        check_optimizer_state(path, model, run, state["optimizer"])
    tokenizer = load_tokenizer(files.tokenizer_dir)
    return Checkpoint(path, files.step, run, model.to(device), tokenizer, state)


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu", for_resume: bool = False) -> Checkpoint:
    """Load one verified checkpoint directory (single-file or DCP). ``for_resume``: also check that the
    trainer state holds everything a resume needs (counters at the checkpoint's step, scheduler, RNG, an
    optimizer state that fits the model), so a damaged one is refused here (and :func:`load_latest`
    falls back)."""
    path = Path(path)
    files = open_checkpoint(path)
    try:
        return _load(files, device, for_resume)
    except CheckpointError:
        raise
    except Exception as exc:  # corrupted content that passed the hash check (e.g. a foreign file)
        raise CheckpointError(f"{path}: cannot be loaded ({exc.__class__.__name__}: {one_line(exc)})") from None


def load_latest(run_or_ckpt: str | Path, device: str | torch.device = "cpu", warn: bool = True,
                for_resume: bool = False) -> Checkpoint:
    """Load the newest valid checkpoint of a run directory (or the given checkpoint directory).

    A corrupted or truncated checkpoint prints one line to stderr and falls back to the previous one
    (``for_resume``: also one whose trainer state cannot resume, see :func:`load_checkpoint`).
    """
    return newest_valid(run_or_ckpt, lambda c: load_checkpoint(c, device, for_resume), warn=warn)


# ---- conversion (one process) ------------------------------------------------------------------------------
def dcp_to_safetensors(src: str | Path, out_run_dir: str | Path) -> Path:
    """Convert DCP checkpoint ``src`` into a single-file checkpoint ``OUT/checkpoints/step_N``."""
    ck = load_checkpoint(src)
    return save_checkpoint(out_run_dir, ck.step, ck.model, ck.run, ck.tokenizer, ck.trainer_state)


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
    if not model_is_finite(ck.model):
        raise CheckpointError(f"refusing to save step {ck.step}: the model has non-finite parameters")
    optimizer = build_optimizer(ck.model, ck.run.train)
    if "optimizer" in ck.trainer_state:
        optimizer.load_state_dict(ck.trainer_state["optimizer"])
    msd, osd = get_state_dict(ck.model, optimizer)
    return save_dcp_checkpoint_alone(out_run_dir, ck.step, {"model": msd, "optim": osd}, ck.run, ck.tokenizer,
                                     ck.trainer_state)


# ---- mhmoe.load ------------------------------------------------------------------------------------------
@dataclass
class Pretrained:
    """A loaded model: ``model`` (eval mode), ``tokenizer`` (None if the directory has none), the training
    ``step`` and ``run`` config (None for a saved directory) and the directory it came from."""

    model: LM
    tokenizer: Tokenizer | None
    path: Path
    step: int | None = None
    run: RunConfig | None = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def generate(self, prompt: str, max_new_tokens: int = MAX_NEW_TOKENS, temperature: float = TEMPERATURE,
                 top_k: int = TOP_K, top_p: float = TOP_P, seed: int = SEED) -> str:
        """Continue ``prompt`` (KV cache; temperature 0 = greedy; stops at end-of-text) and return prompt +
        continuation as text. The same seed gives the same text as ``mhmoe generate --seed``."""
        if self.tokenizer is None:
            raise ConfigError("tokenizer", str(self.path), "a directory with a tokenizer (save_pretrained(dir, "
                              "tokenizer=...)); without one, call mhmoe.generate on token ids")
        check_sampling(max_new_tokens, temperature, top_k, top_p)
        ids = self.tokenizer.encode(prompt)
        if not ids:
            raise ConfigError("prompt", prompt, "a non-empty text")
        if len(ids) >= self.model.cfg.max_seq_len:
            raise ConfigError("prompt", f"{len(ids)} tokens", f"fewer than max_seq_len={self.model.cfg.max_seq_len}")
        n = min(max_new_tokens, self.model.cfg.max_seq_len - len(ids))
        g = torch.Generator(device=self.device).manual_seed(seed)
        out = generate(self.model, torch.tensor([ids], device=self.device), n, temperature, top_k, top_p,
                       eos_id=self.tokenizer.eos_id, generator=g)
        return self.tokenizer.decode(out[0].tolist())

    def save_pretrained(self, directory: str | os.PathLike[str], overwrite: bool = False) -> Path:
        """The model and its tokenizer as a saved directory (:meth:`mhmoe.model.LM.save_pretrained`)."""
        return self.model.save_pretrained(directory, tokenizer=self.tokenizer, overwrite=overwrite)


def check_sampling(max_new_tokens: int, temperature: float, top_k: int, top_p: float) -> None:
    """ConfigError unless max_new_tokens >= 1, temperature >= 0, top_k >= 0 and 0 < top_p <= 1."""
    for name, value, ok, allowed in (("max_new_tokens", max_new_tokens, max_new_tokens >= 1, ">= 1"),
                                     ("temperature", temperature, temperature >= 0, ">= 0 (0 = greedy)"),
                                     ("top_k", top_k, top_k >= 0, ">= 0 (0 = off)"),
                                     ("top_p", top_p, 0 < top_p <= 1, "0 < top_p <= 1 (1 = off)")):
        if not ok:
            raise ConfigError(name, value, allowed)


def load(path: str | os.PathLike[str], device: str | torch.device = "auto") -> Pretrained:
    """The model (eval mode) and tokenizer stored at ``path``: a run directory, a checkpoint directory
    (single-file or DCP), a save_pretrained directory or an export --hf directory. ``device``: auto | cpu
    | cuda | a torch.device. Errors are one-line CheckpointError / ConfigError."""
    p = Path(path)
    dev = device if isinstance(device, torch.device) else resolve_device(str(device), "device")
    if (p / CONFIG_FILE).is_file() and not is_checkpoint_dir(p):
        files = saved_dir_files(p)
        model = LM.from_pretrained(p, device=dev)
        tokenizer = load_tokenizer(files.tokenizer) if files.tokenizer is not None else None
        return Pretrained(model, tokenizer, p)
    ck = load_latest(p, dev)
    return Pretrained(ck.model.eval(), ck.tokenizer, ck.path, ck.step, ck.run)


__all__ = [
    "CKPT_DIR", "FORMAT_VERSION", "PREFIX", "Checkpoint", "Pretrained", "check_optimizer_state", "check_sampling",
    "dcp_to_safetensors", "list_checkpoints", "load", "load_checkpoint", "load_latest", "model_is_finite",
    "safetensors_to_dcp", "save_checkpoint", "verify_checkpoint",
]
