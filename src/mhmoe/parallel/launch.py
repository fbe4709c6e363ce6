"""Training under torchrun: the :class:`Distributed` parallelism the trainer calls (DDP / FSDP2, expert
parallelism, sharded DCP checkpoints) and :func:`train_parallel`, which sets up the process group,
runs :func:`mhmoe.train.train` with it and tears the group down.

The trainer knows only the :class:`~mhmoe.train.parallelism.SingleProcess` interface; this module
implements it with collectives, so ``mhmoe.train`` never imports ``mhmoe.parallel``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from mhmoe.config.run import RunConfig
from mhmoe.config.train import TrainConfig
from mhmoe.data.tokenizer_base import Tokenizer
from mhmoe.errors import ConfigError
from mhmoe.loading.checkpoint import Checkpoint
from mhmoe.model.lm import LM
from mhmoe.parallel.checkpoint import load_dcp_into, open_latest_dcp, save_dcp_checkpoint
from mhmoe.parallel.data_parallel import ParallelModel, parallelize
from mhmoe.parallel.env import DistEnv, env_world_size, init_distributed, teardown
from mhmoe.train.loop import TrainResult, train
from mhmoe.train.parallelism import SingleProcess
from mhmoe.train.resume import LAUNCH_FIELDS


def parallel_mode(cfg: TrainConfig) -> str:
    """none | ddp | fsdp: ``train.parallel`` with ``auto`` resolved from the torchrun WORLD_SIZE."""
    world = env_world_size()
    mode = cfg.parallel if cfg.parallel != "auto" else ("ddp" if world > 1 else "none")
    if mode == "none" and world > 1:
        raise ConfigError("train.parallel", cfg.parallel, f"ddp | fsdp (launched with WORLD_SIZE={world})")
    if mode == "none" and cfg.ep > 1:
        raise ConfigError("train.ep", cfg.ep, "1 without torchrun (expert parallelism needs several processes)")
    return mode


class Distributed(SingleProcess):
    """One rank of a torchrun job: the model wrapped by DDP or FSDP2 (+ expert parallelism), DCP checkpoints."""

    lockstep = True
    saves_alone = False  # a sharded checkpoint needs every rank

    def __init__(self, env: DistEnv, mode: str) -> None:
        super().__init__(env.device)
        self.env, self.mode = env, mode
        self.rank, self.world_size = env.rank, env.world_size
        self.fused_optimizer = env.device.type == "cuda"  # DTensor parameters on gloo: the foreach AdamW
        self.par: ParallelModel | None = None

    def barrier(self) -> None:
        self.env.barrier()

    def parallelize(self, model: LM) -> nn.Module:
        self.par = parallelize(model, self.env, self.mode)
        return self.par.module

    def micro_step(self, last: bool) -> AbstractContextManager:
        return self.par.sync(last)

    def finish_grads(self, model: LM, max_norm: float, loss_finite: Tensor) -> Tensor:
        self.par.finish_grads()
        return self.par.clip_grad_norm(max_norm, extra_nonfinite=not bool(loss_finite))  # ranks agree (collective)

    def mean(self, values: list[float]) -> list[float]:
        return self.par.all_mean(values)

    def num_params(self, model: LM) -> int:
        return model.num_params() + (self.env.ep - 1) * sum(p.numel() for p in self.par.expert_params)

    def load_checkpoint(self, run_dir: Path) -> Checkpoint:
        return open_latest_dcp(run_dir)

    def restore(self, ckpt: Checkpoint, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return load_dcp_into(ckpt.path, model, optimizer, self.par)

    def save_checkpoint(self, run_dir: Path, step: int, model: LM, optimizer: torch.optim.Optimizer,
                        run: RunConfig, tokenizer: Tokenizer, state: dict[str, Any], keep_last: int) -> None:
        save_dcp_checkpoint(run_dir, step, model, optimizer, run, tokenizer, state, keep_last, self.par)

    def summary(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "parallel": self.mode, "ep": self.env.ep}


def train_parallel(run: RunConfig, run_dir: str | Path, resume: bool = False, progress: bool = True,
                   stop_after: int | None = None, launch_fields: tuple[str, ...] = LAUNCH_FIELDS) -> TrainResult:
    """:func:`mhmoe.train.train` on every rank of a torchrun job (``train.parallel`` ddp | fsdp | auto,
    ``train.ep``); a run whose mode resolves to ``none`` trains in this process alone."""
    mode = parallel_mode(run.train)
    if mode == "none":
        return train(run, run_dir, resume, progress, stop_after, launch_fields=launch_fields)
    owns_pg = not dist.is_initialized()
    env = init_distributed(run.train.device, run.train.ep)
    try:
        return train(run, run_dir, resume, progress, stop_after, parallelism=Distributed(env, mode),
                     launch_fields=launch_fields)
    finally:
        if owns_pg:
            teardown()
