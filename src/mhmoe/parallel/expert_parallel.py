"""Expert parallelism: the experts of every MoE / MH-MoE layer split over an expert-parallel group.

Shape legend: S routed (sub-)tokens on this rank (B*T, or B*T*H for MH-MoE), K slots per token,
E experts (global), P = ep group size, E_l = E / P local experts, D_in expert width, N = valid
(token, slot) pairs on this rank, R = rows this rank receives.

Rank ``p`` of the group owns experts ``[p*E_l, (p+1)*E_l)`` as a :class:`GroupedExperts` of E_l
experts sliced from the full stack. Every rank routes its own tokens (the router, shared experts
and MH-MoE head/merge projections are replicated, i.e. data parallel)::

    route = router(x)                        local, slot form [S, K]
    order = sort_slots(route)                valid slots by global expert -> grouped by owner rank
    counts [E] --all_to_all_single--> recv [P, E_l]      (how many rows each rank sends me, per expert)
    rows  [N, D_in] --all_to_all_single (autograd, uneven splits)--> [R, D_in]
    regroup by local expert (stable sort), GroupedExperts.forward_sorted / forward_grouped
    results --all_to_all_single (autograd)--> back to the senders, [N, D_in] in ``order``
    combine: sum_k w[s, k] * y[s, k]         (mhmoe.moe.dispatch.common.combine, as on one device)

Router losses and RoutingStats (semantics): with a ``stats_group`` (all ranks of the mesh during
training) the balance, z and entropy losses and the expert counts are those of the *global* batch
-- the union of every rank's tokens -- exactly what one process would compute on that batch (up
to floating-point summation order). The per-token sums go through a differentiable all-reduce, so
each rank's copy of the aux loss back-propagates into every rank's router: with gradients averaged
over the ``W`` ranks (DDP/FSDP), the router gradient is that of the single-process loss. Capacity
(``capacity_factor``) and expert-choice routing stay per rank (GShard's local groups), so they are
the only configurations whose outputs differ from one process on the global batch.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn

from mhmoe.errors import ConfigError
from mhmoe.moe.dispatch.common import combine as _combine
from mhmoe.moe.dispatch.common import sort_slots
from mhmoe.moe.dispatch.grouped import grouped_mm_supported
from mhmoe.moe.experts import GroupedExperts
from mhmoe.moe.layers import MoELayer, RoutingStats
from mhmoe.moe.losses import gate_reductions
from mhmoe.moe.routers import RouterOutput

_EXPERT_TENSORS = ("w1", "w2", "w3", "b1", "b2", "b3", "sub_norm")


def _all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> Tensor:
    """Autograd-aware ``all_to_all_single`` with uneven splits: rows x [sum(in_splits), D] ->
    [sum(out_splits), D]; the backward sends the gradients back along the reverse splits.
    (``torch.distributed.nn.functional.all_to_all_single`` is deprecated in favour of this one.)"""
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, group))


class AllReduceSum(torch.autograd.Function):
    """Differentiable SUM all-reduce: the gradient of every rank's copy of the result flows back to every
    rank's input (backward = SUM all-reduce of the incoming gradients)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup | None) -> Tensor:  # type: ignore[override]
        ctx.group = group
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def local_experts(full: GroupedExperts, ep_rank: int, ep_size: int) -> GroupedExperts:
    """A GroupedExperts holding experts ``[ep_rank*E_l, (ep_rank+1)*E_l)`` of ``full`` (copies)."""
    E = full.n_experts
    if E % ep_size:
        raise ConfigError("train.ep", ep_size, f"a divisor of model.moe.n_experts={E}")
    n = E // ep_size
    lo = ep_rank * n
    local = GroupedExperts(n, full.d_in, full.d_hidden, full.ffn, full.b1 is not None, full.init_std, full.quant)
    local.to(device=full.w1.device, dtype=full.w1.dtype)
    with torch.no_grad():
        for name in _EXPERT_TENSORS:
            src, dst = getattr(full, name), getattr(local, name)
            if src is not None:
                dst.copy_(src[lo:lo + n])
    local.prequantized, local.reduce_gamma = full.prequantized, full.reduce_gamma
    return local


class ExpertParallelMoE(MoELayer):
    """A :class:`MoELayer` whose experts are split over ``ep_group`` (``ep_size`` ranks) and whose
    router losses / statistics are reduced over ``stats_group`` (None: this rank's tokens only).

    Built with :meth:`from_layer`; parameter names are those of the layer it replaces, so state
    dicts keep their keys (the expert tensors hold E_l rows instead of E).
    """

    ep_group: dist.ProcessGroup | None
    stats_group: dist.ProcessGroup | None

    @classmethod
    def from_layer(cls, layer: MoELayer, ep_group: dist.ProcessGroup | None,
                   stats_group: dist.ProcessGroup | None) -> ExpertParallelMoE:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.cfg, new.d_in = layer.cfg, layer.d_in
        new.router, new.shared = layer.router, layer.shared
        new.ep_group, new.stats_group = ep_group, stats_group
        new.ep_size = 1 if ep_group is None else dist.get_world_size(ep_group)
        new.ep_rank = 0 if ep_group is None else dist.get_rank(ep_group)
        new.experts = layer.experts if new.ep_size == 1 else local_experts(layer.experts, new.ep_rank, new.ep_size)
        new.a2a_bytes = 0  # bytes this rank sent to other ranks in forward all-to-alls (the backward mirrors it)
        new._global: Tensor | None = None
        return new

    # ---- dispatch -------------------------------------------------------------------------------------
    def dispatch(self, xs: Tensor, route: RouterOutput) -> Tensor:
        """xs [S, D_in] -> [S, D_in]; local dispatch when the group has one rank."""
        if self.ep_size == 1:
            return super().dispatch(xs, route)
        S, K = route.experts.shape
        P, El, D = self.ep_size, self.experts.n_experts, xs.shape[1]
        order, counts, counts_list = sort_slots(route.experts, route.valid, P * El)
        rows = xs[order // K]  # [N, D_in], grouped by expert, hence by owner rank
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.ep_group)  # E_l counts to each rank
        recv = recv_counts.view(P, El)
        recv_list = recv.tolist()  # one host sync: the split sizes
        send_splits = [sum(counts_list[p * El:(p + 1) * El]) for p in range(P)]
        recv_splits = [sum(r) for r in recv_list]
        got = _all_to_all(rows, recv_splits, send_splits, self.ep_group)  # [R, D_in] by source rank, then expert
        expert_of_row = torch.repeat_interleave(torch.arange(El, device=xs.device).repeat(P), recv.reshape(-1))
        perm = torch.argsort(expert_of_row, stable=True)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel(), device=perm.device)
        local_counts = recv.sum(0)
        x_sorted = got.index_select(0, perm)
        if xs.is_cuda and self.cfg.impl in ("auto", "grouped_mm") and grouped_mm_supported(x_sorted, self.experts):
            offsets = torch.cumsum(local_counts, 0).to(torch.int32)
            y_sorted = self.experts.forward_grouped(x_sorted, offsets, expert_of_row.index_select(0, perm))
        elif x_sorted.shape[0]:
            y_sorted = self.experts.forward_sorted(x_sorted, local_counts.tolist())
        else:  # nothing to compute, but the reverse all-to-all must stay in the autograd graph on every rank
            y_sorted = x_sorted.clone()
        y = y_sorted.index_select(0, inv)  # back to (source rank, expert) order
        back = _all_to_all(y, send_splits, recv_splits, self.ep_group)  # [N, D_in] in ``order``
        me = self.ep_rank
        self.a2a_bytes += (sum(send_splits) - send_splits[me] + sum(recv_splits) - recv_splits[me]) * D * \
            xs.element_size() + 2 * counts.numel() * counts.element_size()
        return _combine(back, order, route)

    # ---- global router losses and statistics ------------------------------------------------------------
    def router_losses(self, route: RouterOutput, chosen: Tensor) -> dict[str, Tensor]:
        """The unweighted aux losses of the global batch (see the module docstring)."""
        if self.stats_group is None:
            return super().router_losses(route, chosen)
        probs, mask = route.probs, route.token_mask
        E = probs.shape[-1]
        m = mask.to(probs.dtype)
        eps = torch.finfo(probs.dtype).tiny
        sel = chosen & mask[:, None]
        counts = torch.bincount(route.experts[sel], minlength=E).to(probs.dtype)
        sums = route.sums  # the router's own reductions of the scores, else the same from logits / probs
        lse, ent, p_local = ((sums.lse, sums.entropy, sums.prob_sum) if sums is not None
                             else gate_reductions(route.logits, probs, mask))
        dropped = (chosen & ~route.valid).sum().to(probs.dtype)
        local = torch.cat([p_local, (lse ** 2 * m).sum()[None], (ent * m).sum()[None], counts, m.sum()[None],
                           dropped[None]])
        g = AllReduceSum.apply(local, self.stats_group)  # differentiable: SUM forward and backward
        p_sum, z_sum, h_sum = g[:E], g[E], g[E + 1]
        counts_g, n_g = g[E + 2:2 * E + 2].detach(), g[2 * E + 2].detach()
        self._global = g[E + 2:].detach()  # counts [E], tokens, dropped -> routing_stats
        p = p_sum / n_g.clamp_min(1.0)
        f = counts_g / counts_g.sum().clamp_min(1.0)
        if self.cfg.entropy_mode == "batch":
            entropy = math.log(E) + (p * (p + eps).log()).sum()
        else:
            entropy = h_sum / n_g.clamp_min(1.0)
        return {"balance": E * (f * p).sum(), "z": z_sum / n_g.clamp_min(1.0), "entropy": entropy}

    def routing_stats(self, route: RouterOutput, chosen: Tensor, losses: dict[str, Tensor]) -> RoutingStats:
        if self.stats_group is None or self._global is None:
            return super().routing_stats(route, chosen, losses)
        E = route.probs.shape[-1]
        glob, self._global = self._global.round().long(), None
        return RoutingStats(counts=glob[:E], tokens=glob[E], dropped=glob[E + 1],
                            losses={k: v.detach().float() for k, v in losses.items()})


def apply_expert_parallel(model: nn.Module, ep_group: dist.ProcessGroup | None,
                          stats_group: dist.ProcessGroup | None) -> list[ExpertParallelMoE]:
    """Replace every :class:`MoELayer` of ``model`` (including the inner MoE of each MH-MoE layer)
    by an :class:`ExpertParallelMoE`, in place. All ranks must hold identical full weights.

    ``ep_group`` None (or of size 1) keeps all experts local; ``stats_group`` None keeps the router
    losses per rank. Returns the new layers.
    """
    if type(model) is MoELayer:
        raise ValueError("apply_expert_parallel replaces MoE layers inside a model: wrap the layer in a module")
    layers = []
    for name, module in list(model.named_modules()):
        if type(module) is MoELayer:
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            new = ExpertParallelMoE.from_layer(module, ep_group, stats_group)
            setattr(parent, attr, new)
            layers.append(new)
    return layers


def expert_param_names(model: nn.Module) -> list[str]:
    """Fully qualified names of the parameters sharded over the ep group (E_l rows each)."""
    names = []
    for mname, m in model.named_modules():
        if isinstance(m, ExpertParallelMoE) and m.ep_size > 1:
            names += [f"{mname}.experts.{n}" for n, _ in m.experts.named_parameters()]
    return names


def a2a_bytes(model: nn.Module, reset: bool = False) -> int:
    """Forward all-to-all bytes this rank sent to other ranks since the last reset (all EP layers)."""
    total = 0
    for m in model.modules():
        if isinstance(m, ExpertParallelMoE):
            total += m.a2a_bytes
            if reset:
                m.a2a_bytes = 0
    return total
