"""FFN layers with one interface: dense FFN, sparse MoE and Multi-Head MoE.

Shape legend: B batch, T time, D model dim, H heads, S = B*T*H routed sub-tokens, E experts,
K top-k, F expert hidden width. Every layer maps x [..., D] (+ optional padding mask [...] bool,
True = real token) to a :class:`FFNOutput` whose ``out`` has the shape of x.

MH-MoE (Wu et al. 2024; Huang et al. 2024), :class:`MHMoELayer`::

    x_hat = x W_head                                 # ICML Eq.3 / v2 Eq.2   [B,T,D]
    sub   = split(x_hat)  -> [B*T*H, D/H]            # ICML Eq.4 (token-major: token 0's H
                                                     #  sub-tokens, then token 1's, ...)
    o     = MoE(sub)       (+ sub if residual="subtoken", ICML Eq.6)
    y     = merge(o) W_merge                         # ICML Eq.8-9 / v2 Eq.4
    (+ shared experts on x, when n_shared > 0)

``residual="block"`` is the official code (App. E): the layer returns the merged output and the
transformer block adds the usual residual. ``residual="subtoken"`` follows ICML Eq.6 literally:
each sub-token's expert mixture is added to the sub-token itself before the merge, so the layer
output is W_merge(merge(x_hat + MoE(x_hat))) and the block's residual comes on top.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from mhmoe.config.moe import MoEConfig
from mhmoe.errors import ConfigError
from mhmoe.moe.capacity import apply_capacity, expert_capacity
from mhmoe.moe.dispatch import choose_impl
from mhmoe.moe.dispatch.gathered import fits as gathered_fits
from mhmoe.moe.dispatch.gathered import gathered_moe
from mhmoe.moe.experts import DenseFFN, GroupedExperts, SharedExperts
from mhmoe.moe.losses import entropy_loss, load_balancing_loss, router_z_loss
from mhmoe.moe.routers import RouterOutput, build_router
from mhmoe.quant.bitnet import QUANT_NONE, BitLinear, SubNorm


@dataclass
class RoutingStats:
    """Detached per-layer routing statistics, kept as device tensors (no host synchronisation in the
    forward; read them at logging time).

    counts: [E] int64 assignments per expert (before drops); tokens: 0-dim int64 routed (sub-)tokens;
    dropped: 0-dim int64 slots dropped by capacity; losses: unweighted aux losses (0-dim fp32).
    """

    counts: Tensor
    tokens: Tensor
    dropped: Tensor
    losses: dict[str, Tensor] = field(default_factory=dict)

    def __add__(self, other: RoutingStats) -> RoutingStats:
        """Sum of two forwards' statistics (e.g. the micro-batches of one optimizer step)."""
        losses = {k: self.losses[k] + other.losses[k] for k in self.losses}
        return RoutingStats(self.counts + other.counts, self.tokens + other.tokens, self.dropped + other.dropped,
                            losses)

    @property
    def load_imbalance(self) -> float:
        """max / mean expert load (1.0 = perfectly balanced). Reads the device (a host sync)."""
        c = self.counts.float()
        return float(c.max() / c.mean().clamp_min(1e-9)) if c.numel() else 1.0


@dataclass
class FFNOutput:
    """Output of every FFN layer. ``aux_loss`` is the weighted sum of the router losses (0-dim fp32);
    ``losses`` holds the unweighted terms; ``route`` the raw routing decision (None for dense)."""

    out: Tensor
    aux_loss: Tensor
    losses: dict[str, Tensor] = field(default_factory=dict)
    stats: RoutingStats | None = None
    route: RouterOutput | None = None


def seq_shape_of(lead: tuple[int, ...]) -> tuple[int, int]:
    """(B, T) of tokens with leading dims ``lead``: ``[N]`` is one sequence of N positions;
    ``[B, T, ...]`` has the batch in dim 0 and time in dim 1 (later dims share a position)."""
    return (1, lead[0]) if len(lead) == 1 else (lead[0], lead[1])


def _check_input(x: Tensor, width: int, mask: Tensor | None, name: str) -> None:
    if x.dim() < 2 or x.shape[-1] != width:
        raise ValueError(f"invalid {name} input shape {tuple(x.shape)}: allowed [..., {width}] with rank >= 2")
    if mask is not None and tuple(mask.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"invalid mask shape {tuple(mask.shape)}: allowed {tuple(x.shape[:-1])} (x.shape[:-1])")


class DenseLayer(nn.Module):
    """Dense FFN baseline with the MoE interface (zero aux loss, no routing)."""

    def __init__(self, d_model: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.d_model = d_model
        self.ffn = DenseFFN(d_model, cfg.d_expert, cfg.ffn, cfg.expert_bias, cfg.init_std, cfg.quant)

    def forward(self, x: Tensor, mask: Tensor | None = None, stats: bool = True) -> FFNOutput:
        _check_input(x, self.d_model, mask, "dense FFN")
        return FFNOutput(self.ffn(x), x.new_zeros((), dtype=torch.float32))


class MoELayer(nn.Module):
    """Router + dispatch + grouped experts (+ shared experts) on vectors of width ``d_in``.

    forward(x [..., d_in], mask [...] | None) -> FFNOutput. Padding (mask False) is not routed, gets
    zero routed output, and is excluded from counts and losses.
    """

    def __init__(self, d_in: int, cfg: MoEConfig, shared: bool = True) -> None:
        super().__init__()
        self.cfg, self.d_in = cfg, d_in
        self.router = build_router(d_in, cfg)
        self.experts = GroupedExperts(cfg.n_experts, d_in, cfg.d_expert, cfg.ffn, cfg.expert_bias, cfg.init_std,
                                      cfg.quant)
        self.shared = (SharedExperts(d_in, cfg.n_shared, cfg.shared_width, cfg.ffn, cfg.expert_bias, cfg.init_std,
                                     cfg.quant) if shared and cfg.n_shared > 0 else None)

    def capacity(self, n_tokens: Tensor) -> Tensor | None:
        """Per-expert capacity for this forward, a 0-dim device tensor (None = dropless; no host sync).
        ``n_tokens``: 0-dim count of routed (sub-)tokens. Expert choice handles its own. The X-MoE code
        reading trains with ``top_k * ceil(S / E)`` (S = routed (sub-)tokens)."""
        if self.cfg.xmoe_code and self.training:  # routing.py top2gating: capacity = 2 * ceil(S / E)
            return torch.ceil(n_tokens.double() / self.cfg.n_experts).long() * self.cfg.top_k
        cf = self.cfg.capacity_factor if self.training else self.cfg.eval_capacity_factor
        if cf is None or self.cfg.router == "expert_choice":
            return None
        return expert_capacity(n_tokens, self.cfg.top_k, self.cfg.n_experts, cf)

    def forward(self, x: Tensor, mask: Tensor | None = None, seq_shape: tuple[int, int] | None = None,
                stats: bool = True) -> FFNOutput:
        """x [..., d_in], mask [...] | None. ``seq_shape`` (B, T) says how x's tokens lie in sequences for
        the causal capacity priority (default :func:`seq_shape_of` ``x.shape[:-1]``). ``stats=False``: no router
        losses and no routing statistics (generation: ``aux_loss`` zero, ``losses`` empty, ``stats`` None)."""
        _check_input(x, self.d_in, mask, "MoE")
        shape = x.shape
        xs = x.reshape(-1, self.d_in)
        tmask = None if mask is None else mask.reshape(-1).to(torch.bool)
        route = self.router(xs, tmask)
        chosen = route.valid
        cap = self.capacity(route.token_mask.sum())
        if cap is not None:
            causal = self.cfg.capacity_priority == "causal"
            seq = (seq_shape or seq_shape_of(shape[:-1])) if causal else None
            route.valid = apply_capacity(route.experts, route.valid, cap, self.cfg.n_experts, seq)
            route.weights = route.weights * route.valid
            if self.router.renormalize:  # GShard / X-MoE: normalise over the slots kept after the drops
                route.weights = route.weights / route.weights.sum(-1, keepdim=True).clamp_min(1e-9)
        out = self.dispatch(xs, route)
        if self.shared is not None:
            sh = self.shared(xs)
            out = out + (sh if tmask is None else sh * tmask[:, None].to(sh.dtype))
        if not stats:
            return FFNOutput(out.reshape(shape), xs.new_zeros((), dtype=torch.float32), route=route)
        losses = self.router_losses(route, chosen)
        aux = weighted_aux(losses, self.loss_weights(), xs)
        return FFNOutput(out.reshape(shape), aux, losses, self.routing_stats(route, chosen, losses), route)

    def loss_weights(self) -> dict[str, float]:
        """The weight of each router loss in the aux loss (a loss of weight 0 is logged, not trained)."""
        return {"balance": self.cfg.balance_loss_weight, "z": self.cfg.z_loss_weight,
                "entropy": self.cfg.entropy_loss_weight}

    def dispatch(self, xs: Tensor, route: RouterOutput) -> Tensor:
        """Routed expert output xs [S, d_in] -> [S, d_in] (the ``cfg.impl`` path; ``auto`` runs generation's few
        rows on gathered weights, :mod:`mhmoe.moe.dispatch.gathered`; expert parallelism overrides this, see
        :mod:`mhmoe.parallel.expert_parallel`)."""
        if self.cfg.impl == "auto" and gathered_fits(route, self.experts):
            return gathered_moe(xs, route, self.experts)
        return choose_impl(self.cfg.impl, xs, self.experts)(xs, route, self.experts)

    def routing_stats(self, route: RouterOutput, chosen: Tensor, losses: dict[str, Tensor]) -> RoutingStats:
        """Detached statistics of this forward (``chosen`` = slots before capacity drops)."""
        return RoutingStats(
            counts=route.counts.detach(), tokens=route.token_mask.sum(), dropped=(chosen & ~route.valid).sum(),
            losses={k: v.detach().float() for k, v in losses.items()},
        )

    def router_losses(self, route: RouterOutput, chosen: Tensor) -> dict[str, Tensor]:
        """Unweighted aux losses over the routed (sub-)tokens; ``chosen`` = slots before drops. The X-MoE
        code reading counts first choices only in the balance loss (routing.py: ``ce = mean(mask1)``)."""
        experts = route.experts[:, :1] if self.cfg.xmoe_code else route.experts
        chosen = chosen[:, :1] if self.cfg.xmoe_code else chosen
        w, sums = self.loss_weights(), route.sums  # sums: the router's own reductions of the scores, or None
        lse, row_entropy, prob_sum = (None, None, None) if sums is None else (sums.lse, sums.entropy, sums.prob_sum)
        with torch.set_grad_enabled(torch.is_grad_enabled() and w["balance"] != 0):
            balance = load_balancing_loss(route.probs, experts, chosen, route.token_mask, prob_sum)
        with torch.set_grad_enabled(torch.is_grad_enabled() and w["z"] != 0):  # weight 0: logged, no graph
            z = router_z_loss(route.logits, route.token_mask, lse)
        with torch.set_grad_enabled(torch.is_grad_enabled() and w["entropy"] != 0):
            entropy = entropy_loss(route.probs, route.token_mask, self.cfg.entropy_mode, row_entropy, prob_sum)
        return {"balance": balance, "z": z, "entropy": entropy}


def weighted_aux(losses: dict[str, Tensor], weights: dict[str, float], like: Tensor) -> Tensor:
    """Σ weight · loss over the losses of non-zero weight (a scalar; zero, on ``like``'s device, when every
    weight is 0). A loss of weight 0 takes no part: neither its backward nor a non-finite value of it reaches
    the aux loss."""
    terms = [w * losses[k] for k, w in weights.items() if w != 0]
    return sum(terms[1:], terms[0]) if terms else torch.zeros((), device=like.device)


def _projection_mlp(d: int, n_layers: int, bias: bool, gain: float, quant: str = QUANT_NONE,
                    norm_in: bool = False, norm_out: bool = False, zero_bias: bool = True) -> nn.Module:
    """n Linear(d, d) layers with ReLU between (ICML Table 7); n=0 is the identity. Weights Xavier-uniform
    with ``gain``; biases zero when ``zero_bias``, else nn.Linear's default U(-1/sqrt(d), 1/sqrt(d)).

    Quantized (bitnet158): BitLinear layers, and an RMSNorm (eps 1e-5) in front of every BitLinear
    whose input is not already normalised -- the first layer when ``norm_in`` (the merge
    projection reads the merged expert outputs) and every layer after a ReLU -- plus one after the
    last layer when ``norm_out`` (the head projection's output feeds the quantized experts).
    """
    quantized = quant != QUANT_NONE
    layers: list[nn.Module] = []
    for i in range(n_layers):
        if i:
            layers.append(nn.ReLU())
        if quantized and (i or norm_in):
            layers.append(SubNorm(d))
        lin = BitLinear(d, d, bias=bias) if quantized else nn.Linear(d, d, bias=bias)
        nn.init.xavier_uniform_(lin.weight, gain=gain)
        if bias and zero_bias:
            nn.init.zeros_(lin.bias)
        layers.append(lin)
    if quantized and norm_out and layers:
        layers.append(SubNorm(d))
    return nn.Sequential(*layers) if layers else nn.Identity()


class MHMoELayer(nn.Module):
    """Multi-Head MoE: head projection, token split into H sub-tokens, MoE over sub-tokens with
    experts of width D/H, merge, merge projection (see the module docstring for the equations).

    Ablation switches (``MoEConfig``): ``head_layer`` / ``merge_layer`` (v2 Tables 4-5),
    ``mlp_layers`` n = 0..3 (ICML Table 7), ``token_split`` (ICML Table 6), ``residual``.
    """

    def __init__(self, d_model: int, cfg: MoEConfig) -> None:
        super().__init__()
        cfg.check_d_model(d_model)
        self.cfg, self.d_model = cfg, d_model
        self.heads = cfg.heads if cfg.token_split else 1
        self.d_sub = d_model // self.heads
        n = cfg.mlp_layers
        # W_head: Xavier-uniform gain 1/sqrt(2), nn.Linear's default bias (head_bias_init="torch");
        # W_merge: Xavier-uniform, bias 0 (ICML App. E).
        # bitnet158: BitLinear projections; sub-norms where a BitLinear or the experts would read
        # an un-normalised input (after W_head, before W_merge, between MLP layers; docs/BITNET.md)
        self.head = _projection_mlp(d_model, n if cfg.head_layer else 0, cfg.proj_bias, 2 ** -0.5, cfg.quant,
                                    norm_out=True, zero_bias=cfg.head_bias_init == "zero")
        self.merge = _projection_mlp(d_model, n if cfg.merge_layer else 0, cfg.proj_bias, 1.0, cfg.quant,
                                     norm_in=True)
        self.moe = MoELayer(self.d_sub, cfg, shared=False)
        self.shared = (SharedExperts(d_model, cfg.n_shared, cfg.shared_width, cfg.ffn, cfg.expert_bias,
                                     cfg.init_std, cfg.quant) if cfg.n_shared > 0 else None)

    def forward(self, x: Tensor, mask: Tensor | None = None, stats: bool = True) -> FFNOutput:
        _check_input(x, self.d_model, mask, "MH-MoE")
        lead = x.shape[:-1]
        x_hat = self.head(x)
        sub = x_hat.reshape(-1, self.d_sub)  # [S, D/H], token-major (ICML Eq.4 / App. E)
        sub_mask = None if mask is None else mask.reshape(-1, 1).expand(-1, self.heads).reshape(-1)
        res = self.moe(sub, sub_mask, seq_shape_of(tuple(lead)), stats)
        o = res.out + sub if self.cfg.residual == "subtoken" else res.out
        y = self.merge(o.reshape(*lead, self.d_model))
        if self.shared is not None:
            y = y + self.shared(x)
        res.out = y
        return res


def build_ffn_layer(d_model: int, cfg: MoEConfig) -> nn.Module:
    """The FFN layer that ``cfg`` describes: DenseLayer, MoELayer (plain SMoE) or MHMoELayer."""
    if not isinstance(cfg, MoEConfig):
        raise ConfigError("moe", type(cfg).__name__, "a MoEConfig")
    cfg.check_d_model(d_model)
    if cfg.kind == "dense":
        return DenseLayer(d_model, cfg)
    if cfg.is_multihead or not cfg.token_split:
        return MHMoELayer(d_model, cfg)
    return MoELayer(d_model, cfg)
