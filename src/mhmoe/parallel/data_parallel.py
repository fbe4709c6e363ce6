"""Data parallelism for an :class:`~mhmoe.model.LM`: DDP or FSDP2 (``fully_shard``), optionally
combined with expert parallelism over the ``ep`` dimension of the ``("dp", "ep")`` mesh.

Every one of the W = dp x ep ranks reads its own micro-batch, so the global batch is W micro-batches
and the objective is the mean of the ranks' losses (= the loss of one process on the union batch).

Gradient reduction:

- non-expert parameters (embeddings, attention, routers, dense/shared FFNs, MH-MoE projections):
  averaged over all W ranks (DDP all-reduce, or FSDP2 reduce-scatter over a 1-D mesh of all ranks);
- expert parameters with ``ep > 1``: each rank holds E/ep experts whose gradient already sums the
  contributions of every token routed to them from its ep group (the all-to-all backward), so they
  are excluded from DDP / FSDP and all-reduced (SUM) over the ``dp`` group only, then divided by W.

Gradient accumulation: DDP ``no_sync`` (FSDP2 ``set_requires_gradient_sync(False)``) on every micro-step
but the last; the expert all-reduce runs once per optimizer step in :meth:`ParallelModel.finish_grads`.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from mhmoe.config.train import DataParallel
from mhmoe.errors import ConfigError
from mhmoe.model.lm import LM
from mhmoe.parallel.env import DistEnv
from mhmoe.parallel.expert_parallel import ExpertParallelMoE, apply_expert_parallel, expert_param_names

MODES = ("ddp", "fsdp")


@dataclass
class ParallelModel:
    """The parallelised model: ``module`` is what the training loop calls (DDP wrapper or the
    FSDP2-sharded LM), ``model`` the LM itself (EP layers swapped in; for FSDP2 the same object)."""

    module: nn.Module
    model: LM
    env: DistEnv
    mode: DataParallel
    stats_group: dist.ProcessGroup
    expert_names: list[str] = field(default_factory=list)
    ep_dp_mesh: DeviceMesh | None = None  # FSDP2 + EP: ("ep", "dp") mesh describing the expert shards

    @property
    def expert_params(self) -> list[nn.Parameter]:
        params = dict(self.model.named_parameters())
        return [params[n] for n in self.expert_names]

    @contextlib.contextmanager
    def sync(self, last_micro: bool) -> Iterator[None]:
        """Context for one micro-step: gradient reduction only on the last one (accumulation)."""
        if self.mode == "ddp" and not last_micro:
            with self.module.no_sync():
                yield
        elif self.mode == "fsdp":
            self.module.set_requires_gradient_sync(last_micro)
            yield
        else:
            yield

    def finish_grads(self) -> None:
        """After the last micro-step's backward: expert gradients = SUM over dp / W. DDP: all-reduce
        here; FSDP2 already reduce-scattered the mean over dp, so only the 1/ep factor remains (a
        custom FSDP2 divide factor would need NCCL's PREMUL_SUM, which gloo lacks)."""
        params = self.expert_params
        if not params:
            return
        if self.mode == "fsdp":
            grads = [p.grad.to_local() for p in params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, 1.0 / self.env.ep)
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self.env.dp > 1:
            dist.all_reduce(flat, group=self.env.dp_group)
        flat /= self.env.world_size
        for p, chunk in zip(params, flat.split([g.numel() for g in grads]), strict=True):
            p.grad = chunk.view_as(p).clone()

    def clip_grad_norm(self, max_norm: float, extra_nonfinite: bool = False) -> Tensor:
        """Global L2 norm of all gradients (every parameter counted once), then in-place clipping as
        ``torch.nn.utils.clip_grad_norm_`` does. ``extra_nonfinite`` (this rank saw a non-finite
        loss) makes the returned norm NaN on every rank, so that all ranks skip the step together."""
        expert = {id(p) for p in self.expert_params}
        replicated = torch.zeros((), dtype=torch.float32, device=self.env.device)
        reduced = torch.zeros((), dtype=torch.float32, device=self.env.device)
        grads = []
        for p in self.model.parameters():
            if p.grad is None:
                continue
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            grads.append(g)
            sq = g.detach().float().pow(2).sum()
            if isinstance(p.grad, DTensor):  # FSDP2 shard: disjoint pieces over all ranks
                reduced += sq
            elif id(p) in expert:  # E/ep experts, identical over dp
                reduced += sq / self.env.dp
            else:  # DDP: identical on every rank
                replicated += sq
        if extra_nonfinite:
            reduced += float("nan")
        dist.all_reduce(reduced, group=self.stats_group)
        total = (replicated + reduced).sqrt()
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        if grads and torch.isfinite(total):
            torch._foreach_mul_(grads, coef.to(grads[0].device))
        return total

    def all_mean(self, values: list[float]) -> list[float]:
        """Mean over all ranks of a few python floats (loss logging)."""
        t = torch.tensor(values, dtype=torch.float64, device=self.env.device)
        dist.all_reduce(t, group=self.stats_group)
        return (t / self.env.world_size).tolist()


def check_parallel(model: LM, mode: str, ep: int, world_size: int) -> None:
    """Validate the mode / ep combination for this model (one-line ConfigError)."""
    if mode not in MODES:
        raise ConfigError("train.parallel", mode, " | ".join(("auto", "none") + MODES))
    if ep > 1:
        if model.cfg.moe.kind == "dense":
            raise ConfigError("train.ep", ep, "1 (the model has no MoE layers)")
        if model.cfg.moe.n_experts % ep:
            raise ConfigError("train.ep", ep, f"a divisor of model.moe.n_experts={model.cfg.moe.n_experts}")
    if world_size % ep:
        raise ConfigError("train.ep", ep, f"a divisor of the world size {world_size}")
    if ep > 1 and model.cfg.moe.n_experts % ep == 0 and mode == "fsdp":
        local, dp = model.cfg.moe.n_experts // ep, world_size // ep
        if local % dp:
            raise ConfigError("train.ep", ep, f"a value for which the {local} experts per rank divide evenly over "
                                              f"the {dp} data-parallel ranks (FSDP2 shards them over dp)")


def parallelize(model: LM, env: DistEnv, mode: DataParallel) -> ParallelModel:
    """Apply EP (when ``env.ep > 1``), global router statistics and DDP / FSDP2 to ``model``, in place.

    All ranks must pass models with identical weights (same seed, or the same checkpoint); the
    full weights are broadcast from rank 0 first to make sure before the experts are sliced.
    """
    check_parallel(model, mode, env.ep, env.world_size)
    model.to(env.device)
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t, 0)
    stats_group = dist.new_group(list(range(env.world_size)))  # own group: never interleaves with DDP's
    apply_expert_parallel(model, env.ep_group if env.ep > 1 else None, stats_group)
    names = expert_param_names(model)
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        if names:
            DDP._set_params_and_buffers_to_ignore_for_model(model, names)
        ids = [env.device.index] if env.device.type == "cuda" else None
        # buffers (aux-free selection biases) stay identical on every rank: they are updated from the
        # all-reduced expert counts, so no per-forward buffer broadcast
        sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters \
            else {"broadcast_buffers": False}
        module: nn.Module = DDP(model, device_ids=ids, **sync)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

        world_mesh = init_device_mesh(env.device.type, (env.world_size,), mesh_dim_names=("world",))
        if names:  # EP: each rank's E/ep experts sharded over its dp group only; SUM over dp, / W
            for m in model.modules():
                if isinstance(m, ExpertParallelMoE) and m.ep_size > 1:
                    fully_shard(m.experts, mesh=env.mesh["dp"])  # mean over dp; finish_grads: / ep
                    for method in ("forward_sorted", "forward_grouped"):  # called directly by the EP dispatch
                        register_fsdp_forward_method(m.experts, method)
            # checkpoint layout of those shards: dim 0 split by ep (outer), then by dp
            ep_dp_mesh = DeviceMesh(env.device.type, env.mesh.mesh.t().contiguous(), mesh_dim_names=("ep", "dp"))
        for block in model.blocks:  # parameters of already-sharded expert modules are left out
            fully_shard(block, mesh=world_mesh)
        fully_shard(model, mesh=world_mesh)
        module = model
    return ParallelModel(module, model, env, mode, stats_group, names, ep_dp_mesh if names and mode == "fsdp" else None)
