"""How a training run is spread over processes, as the trainer sees it.

The trainer (:mod:`mhmoe.train.loop`) calls only the methods of :class:`SingleProcess`; a torchrun
launch passes :class:`mhmoe.parallel.launch.Distributed` instead, which implements them with
collectives (DDP / FSDP2, expert parallelism, sharded DCP checkpoints). Parallelism is applied from
outside: nothing in ``mhmoe.train`` imports ``mhmoe.parallel``.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from mhmoe.checkpoint.write import save_checkpoint
from mhmoe.config.run import RunConfig
from mhmoe.data.tokenizer_base import Tokenizer
from mhmoe.loading.checkpoint import Checkpoint
from mhmoe.model.lm import LM
from mhmoe.train.resume import load_latest_for_resume


class SingleProcess:
    """One process on one device (the default)."""

    rank = 0
    world_size = 1
    #: every rank must run every micro-step (collectives inside the forward/backward), even after a
    #: non-finite loss; a single process stops the step at the first non-finite micro-batch instead
    lockstep = False
    #: a checkpoint can be written by this process alone (an interrupted sharded run cannot)
    saves_alone = True
    #: fused AdamW (one kernel per parameter group; skips non-finite steps on the device)
    fused_optimizer = True

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        """Wait for every rank (no-op here)."""

    def parallelize(self, model: LM) -> nn.Module:
        """Move ``model`` to the device; return the module the training forward calls."""
        return model.to(self.device)

    def micro_step(self, last: bool) -> AbstractContextManager:
        """Context of one micro-step's forward and backward (``last``: gradients are reduced)."""
        return contextlib.nullcontext()

    def finish_grads(self, model: LM, max_norm: float, loss_finite: Tensor) -> Tensor:
        """Reduce the step's gradients and clip them to ``max_norm``; return the global gradient norm, a
        0-dim device tensor (NaN when the loss of any rank was non-finite: ``loss_finite`` False)."""
        norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        return torch.where(loss_finite, norm, torch.nan)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, finite: Tensor) -> None:
        """``optimizer.step()`` unless ``finite`` (0-dim bool) is False. A fused AdamW skips on the device
        (its ``found_inf``, as under a GradScaler): no host synchronisation."""
        if all(g.get("fused") for g in optimizer.param_groups):
            optimizer.found_inf = (~finite).float()
            optimizer.step()
        elif bool(finite):
            optimizer.step()

    def mean(self, values: list[float]) -> list[float]:
        """Mean over ranks of a few floats (logged losses)."""
        return values

    def num_params(self, model: LM) -> int:
        """Parameters of the whole model (all ranks' shards)."""
        return model.num_params()

    def load_checkpoint(self, run_dir: Path) -> Checkpoint:
        """The newest valid checkpoint of ``run_dir`` to resume from."""
        return load_latest_for_resume(run_dir)

    def restore(self, ckpt: Checkpoint, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Load the optimizer state of ``ckpt`` (the model came with it); return its trainer state. The
        optimizer keeps its own implementation (fused or not), whatever wrote the checkpoint."""
        saved = ckpt.trainer_state["optimizer"]
        fused = [g.get("fused") for g in optimizer.param_groups]
        groups = [{**g, "fused": f} for g, f in zip(saved["param_groups"], fused, strict=True)]
        optimizer.load_state_dict({**saved, "param_groups": groups})
        return ckpt.trainer_state

    def save_checkpoint(self, run_dir: Path, step: int, model: LM, optimizer: torch.optim.Optimizer,
                        run: RunConfig, tokenizer: Tokenizer, state: dict[str, Any], keep_last: int) -> None:
        """Write checkpoint ``step`` (``state``: the trainer state without the optimizer)."""
        save_checkpoint(run_dir, step, model, run, tokenizer, {**state, "optimizer": optimizer.state_dict()},
                        keep_last)

    def summary(self) -> dict[str, Any]:
        """Extra fields of results.json describing the parallel layout."""
        return {}
