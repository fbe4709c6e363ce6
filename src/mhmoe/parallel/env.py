"""Process-group setup from the torchrun environment, and the 2-D ``("dp", "ep")`` device mesh.

torchrun (``--nproc_per_node``, ``--nnodes``, ``--rdzv_*``) exports ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``; :func:`init_distributed` reads them, picks the
backend (NCCL when the run's device is CUDA, gloo on CPU) and builds a mesh of shape
``[world / ep, ep]``: rank ``r`` is at ``(dp=r // ep, ep=r % ep)``, so an expert-parallel group is
``ep`` consecutive ranks (one node, when ``ep`` divides the GPUs per node).

Every rank of the mesh is a *data* rank for the non-expert parameters (each reads its own shard of
the token stream); the ``ep`` dimension additionally splits the experts of every MoE layer.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from mhmoe.errors import ConfigError


@dataclass
class DistEnv:
    """One rank's view of the job: global rank/size, device, the mesh and its 1-D groups."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    mesh: DeviceMesh  # ("dp", "ep")
    ep: int

    @property
    def dp(self) -> int:
        return self.world_size // self.ep

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @property
    def ep_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("ep")

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("dp")

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep

    @property
    def dp_rank(self) -> int:
        return self.rank // self.ep

    def barrier(self) -> None:
        dist.barrier(device_ids=[self.device.index] if self.device.type == "cuda" else None)

    def log0(self, msg: str) -> None:
        """Print ``msg`` to stderr on rank 0 only."""
        if self.is_rank0:
            print(msg, file=sys.stderr, flush=True)


def env_world_size() -> int:
    """WORLD_SIZE from the torchrun environment (1 when not launched by torchrun)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ConfigError("WORLD_SIZE", os.environ.get("WORLD_SIZE"), "an integer >= 1 (set by torchrun)") from None


def choose_backend(device: torch.device) -> str:
    """nccl for CUDA devices, gloo otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def build_mesh(device_type: str, world_size: int, ep: int) -> DeviceMesh:
    """The ``[world/ep, ep]`` mesh named ``("dp", "ep")``; ``ep`` must divide the world size."""
    if ep < 1 or world_size % ep:
        raise ConfigError("train.ep", ep, f"a divisor of the world size {world_size} (1 = no expert parallelism)")
    return init_device_mesh(device_type, (world_size // ep, ep), mesh_dim_names=("dp", "ep"))


def init_distributed(device_name: str, ep: int = 1, timeout_s: float = 600.0) -> DistEnv:
    """Initialise the default process group from the torchrun environment and build the mesh.

    ``device_name``: auto | cpu | cuda (``train.device``); on CUDA each rank takes ``cuda:LOCAL_RANK``.
    Requires the torchrun variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).
    """
    if not dist.is_available():
        raise ConfigError("train.parallel", "ddp/fsdp", "none (this torch build has no torch.distributed)")
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ConfigError("train.parallel", missing[0], "a run launched by torchrun (e.g. torchrun "
                          "--nproc_per_node=2 -m mhmoe train ...), or train.parallel=none")
    rank, world = int(os.environ["RANK"]), env_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = device_name == "cuda" or (device_name == "auto" and torch.cuda.is_available())
    if use_cuda:
        if not torch.cuda.is_available():
            raise ConfigError("train.device", device_name, "cpu | auto (no CUDA device is available)")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    backend = choose_backend(device)
    if backend == "gloo" and not dist.is_gloo_available():
        raise ConfigError("train.device", device_name, "cuda (this torch build has no gloo backend for CPU)")
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s),
                                device_id=device if use_cuda else None)
    if ep < 1 or world % ep:
        raise ConfigError("train.ep", ep, f"a divisor of the world size {world} (1 = no expert parallelism)")
    mesh = build_mesh(device.type, world, ep)
    return DistEnv(rank, world, local_rank, device, backend, mesh, ep)


def teardown() -> None:
    """Destroy the default process group (no-op when none is initialised)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
