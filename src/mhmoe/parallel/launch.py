"""Training under torchrun: the :class:`Distributed` parallelism the trainer calls (DDP / FSDP2, expert
parallelism, sharded DCP checkpoints) and :func:`train_parallel`, which sets up the process group,
runs :func:`mhmoe.train.train` with it and tears the group down.

The trainer knows only the :class:`~mhmoe.train.parallelism.SingleProcess` interface; this module
implements it with collectives, so ``mhmoe.train`` never imports ``mhmoe.parallel``.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from mhmoe.checkpoint.format import list_checkpoints
from mhmoe.config.run import RunConfig
from mhmoe.config.train import DataParallel, ParallelMode, TrainConfig
from mhmoe.data.tokenizer_base import Tokenizer
from mhmoe.errors import ConfigError, TrainingStopped
from mhmoe.loading.checkpoint import Checkpoint
from mhmoe.model.lm import LM
from mhmoe.parallel.checkpoint import load_dcp_into, open_latest_dcp, save_dcp_checkpoint
from mhmoe.parallel.data_parallel import ParallelModel, parallelize
from mhmoe.parallel.env import DistEnv, env_world_size, init_distributed, teardown
from mhmoe.train.loop import TrainResult, train
from mhmoe.train.parallelism import SingleProcess
from mhmoe.train.resume import LAUNCH_FIELDS


def parallel_mode(cfg: TrainConfig) -> ParallelMode:
    """none | ddp | fsdp: ``train.parallel`` with ``auto`` resolved from the torchrun WORLD_SIZE."""
    world = env_world_size()
    mode: ParallelMode = ("ddp" if world > 1 else "none") if cfg.parallel == "auto" else cfg.parallel
    if mode == "none" and world > 1:
        raise ConfigError("train.parallel", cfg.parallel, f"ddp | fsdp (launched with WORLD_SIZE={world})")
    if mode == "none" and cfg.ep > 1:
        raise ConfigError("train.ep", cfg.ep, "1 without torchrun (expert parallelism needs several processes)")
    return mode


class Distributed(SingleProcess):
    """One rank of a torchrun job: the model wrapped by DDP or FSDP2 (+ expert parallelism), DCP checkpoints."""

    lockstep = True
    saves_alone = False  # a sharded checkpoint needs every rank

    def __init__(self, env: DistEnv, mode: DataParallel) -> None:
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
                   stop_after: int | None = None, launch_fields: tuple[str, ...] = LAUNCH_FIELDS,
                   branch_from: str | Path | None = None) -> TrainResult:
    """:func:`mhmoe.train.train` on every rank of a torchrun job (``train.parallel`` ddp | fsdp | auto,
    ``train.ep``); a run whose mode resolves to ``none`` trains in this process alone (the only one that
    branches: ``branch_from``)."""
    mode = parallel_mode(run.train)
    if mode == "none":
        return train(run, run_dir, resume, progress, stop_after, launch_fields=launch_fields, branch_from=branch_from)
    if branch_from is not None:
        raise ConfigError("--branch-from", str(branch_from), "a single-process training (branch in one process "
                          "with --max-steps at the branch step, which only writes the new run's first checkpoint, then "
                          "--resume the new run under torchrun)")
    owns_pg = not dist.is_initialized()
    env = init_distributed(run.train.device, run.train.ep)
    lost = False
    try:
        return train(run, run_dir, resume, progress, stop_after, parallelism=Distributed(env, mode),
                     launch_fields=launch_fields)
    except RuntimeError as exc:
        if not is_peer_loss(exc):
            raise
        lost = True
        raise PeerLost(peer_loss_message(env.rank, env.world_size, Path(run_dir))) from None
    finally:
        if owns_pg and not lost:  # after a lost peer the group is broken: the process exit releases it
            teardown()


# ---- a rank that loses a peer --------------------------------------------------------------------------------
#: what gloo / NCCL / the store say when the other end of a collective is gone (killed, out of memory, network)
PEER_LOSS = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused",
             "no route to host", "timed out", "socket closed", "remote worker", "nccl communicator was aborted")


class PeerLost(TrainingStopped):
    """This rank lost a peer of its torchrun job; the message (one line) names the peer and the last
    checkpoint. The CLI prints it and exits with status 1, without a traceback."""


def is_peer_loss(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from) is a collective failing because a peer is gone."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, RuntimeError) and any(s in str(exc)[:2000].lower() for s in PEER_LOSS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def lost_peers(rank: int, world: int, wait_s: float = 5.0) -> list[int] | None:
    """The ranks that are gone, by a roll call in the rendezvous store: every rank that lost a peer
    answers within ``wait_s`` seconds; None when the store is unreachable (its host is gone)."""
    if world == 2:
        return [1 - rank]
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"mhmoe/alive/{rank}", b"1")
        deadline = time.monotonic() + wait_s
        missing = [r for r in range(world) if r != rank]
        while missing and time.monotonic() < deadline:
            missing = [r for r in missing if not store.check([f"mhmoe/alive/{r}"])]
            time.sleep(0.1)
        return missing
    except Exception:  # noqa: BLE001 -- the store's host (rank 0 outside torchrun's agent) is gone too
        return None


def peer_loss_message(rank: int, world: int, run_dir: Path) -> str:
    """``rank R: lost rank P of W (killed, out of memory or a network failure); the last checkpoint is step
    N (PATH): continue with --resume``."""
    lost = lost_peers(rank, world)
    who = (f"rank {', '.join(map(str, lost))}" if lost else "a peer") + f" of {world}"
    ckpts = list_checkpoints(run_dir)
    last = (f"the last checkpoint is step {int(ckpts[-1].name.split('_')[-1])} ({ckpts[-1]}): continue with "
            "--resume" if ckpts else f"no checkpoint of {run_dir} was saved yet")
    return f"rank {rank}: lost {who} (killed, out of memory or a network failure); {last}"
