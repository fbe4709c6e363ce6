"""Routers: map S (sub-)tokens to expert choices. All router math runs in fp32 but the score GEMM, which runs in
fp32 too (``MoEConfig.router_dtype="float32"``, the default) or in the model's compute dtype (``"model"``).

Shape legend: S routed (sub-)tokens (= B*T*H for MH-MoE), D_in router input width (d_model / H),
E experts, K slots per token (top-k; expert-choice uses K = E, one slot per expert).

Every router returns a :class:`RouterOutput` in *token-major slot form*: ``experts[s, j]`` is the
expert of slot ``j`` of token ``s``, ``weights[s, j]`` its combine weight and ``valid[s, j]`` says
whether the slot is used (padding, capacity drops and expert-choice's unpicked pairs are invalid).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mhmoe.config.moe import MoEConfig
from mhmoe.moe.capacity import expert_capacity, expert_counts


@dataclass
class GateSums:
    """Reductions of a gate over its rows that the router losses read (:mod:`mhmoe.moe.losses`), computed in the
    router's own pass over the scores where it has one (the CPU softmax router's C++ pass,
    :mod:`mhmoe.moe.dispatch.native.router`; the fused GPU router's kernel, :mod:`mhmoe.moe.dispatch.triton.router`);
    differentiable to the logits. The losses compute the same from
    ``logits`` / ``probs`` where a router has none.

    Attributes:
        lse:      [S] fp32 logsumexp of each row's logits (the z-loss).
        entropy:  [S] fp32 ``-sum_e p log p`` of each row's probabilities (the token entropy loss).
        prob_sum: [E] fp32 probabilities summed over the routed tokens (``token_mask``; the balance loss's P_e times
                  their number, the batch entropy loss).
    """

    lse: Tensor
    entropy: Tensor
    prob_sum: Tensor


@dataclass
class RouterOutput:
    """Typed routing decision for S tokens.

    Attributes:
        weights: [S, K] fp32 combine weights (0 on invalid slots).
        experts: [S, K] int64 expert ids.
        valid:   [S, K] bool, slot is dispatched.
        logits:  [S, E] fp32 raw router scores (before any selection bias).
        probs:   [S, E] fp32 gate distribution used by the balance/entropy losses.
        counts:  [E] int64 (token, slot) assignments per expert, before capacity drops.
        token_mask: [S] bool, token takes part in routing (False = padding).
        sums: the losses' reductions of ``logits`` / ``probs`` where the router computed them (:class:`GateSums`),
            else None.
    """

    weights: Tensor
    experts: Tensor
    valid: Tensor
    logits: Tensor
    probs: Tensor
    counts: Tensor
    token_mask: Tensor
    sums: GateSums | None = None

    @property
    def top_k(self) -> int:
        return self.experts.shape[1]


def _top_k(scores: Tensor, k: int) -> Tensor:
    """[S, k] int64 ids of the k largest scores per row, best first: ``torch.topk``'s, from a vectorised C++ kernel
    on a CPU (:func:`mhmoe.moe.dispatch.native.topk_indices`)."""
    try:
        from mhmoe.moe.dispatch.native import topk_indices
    except ImportError:  # the exported model code (trust_remote_code) carries no C++
        return torch.topk(scores, k, dim=-1).indices
    return topk_indices(scores, k)


def _linear(x: Tensor, weight: Tensor) -> Tensor:
    """[S, N] fp32 scores ``x @ weight.t()`` computed in x's dtype (the router's GEMM dtype: :meth:`Router.gemm_input`).
    x: [S, D]; weight: [N, D] (any float dtype: cast to x's)."""
    return (x @ weight.to(x.dtype).t()).float()


def _counts(experts: Tensor, valid: Tensor, n_experts: int) -> Tensor:
    """[E] number of valid (token, slot) pairs per expert (no host sync)."""
    return expert_counts(experts, n_experts, valid)


class Router(nn.Module):
    """Base class: token-choice top-k over a score matrix, with optional aux-loss-free bias.

    Subclasses implement :meth:`scores` returning ``(logits, gate)``: ``logits`` [S, E] are the raw
    scores, ``gate`` [S, E] the positive gate values the combine weights are taken from. A subclass whose
    scores are ``x @ weight.t()`` names its gate in ``fused_gate`` ("softmax" | "sigmoid") to run the fused
    GPU kernel of :meth:`_fused` instead of this reference path where it applies.
    """

    fused_gate: str | None = None
    selection_bias: Tensor  # [E] buffer
    weight: Tensor  # [E, d_in] of the routers whose scores are x @ weight.t() (those with a fused_gate)

    def __init__(self, d_in: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.d_in, self.n_experts, self.top_k = d_in, cfg.n_experts, cfg.top_k
        self.renormalize = cfg.renormalize_weights  # top-k weights sum to one (auto: top_k > 1)
        self.bias_update_rate = cfg.bias_update_rate
        self.aux_free = cfg.aux_free_bias
        self.impl = cfg.impl  # "auto" / "triton": the fused GPU router where it applies (see _fused)
        self.router_dtype = cfg.router_dtype  # the score GEMM's dtype: float32 | model (see gemm_input)
        # DeepSeek-V3 selection bias: a buffer (not trained by the optimizer), updated from counts.
        self.register_buffer("selection_bias", torch.zeros(cfg.n_experts), persistent=cfg.aux_free_bias)

    def scores(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # pragma: no cover - abstract
        """Return (logits [S,E], gate [S,E], probs [S,E]) in fp32; x: [S, D_in] from :meth:`gemm_input`."""
        raise NotImplementedError

    def gemm_input(self, x: Tensor) -> Tensor:
        """x [S, D_in] in the dtype the score GEMM runs in (called where autocast is still as the caller set it):
        fp32 (``router_dtype="float32"``), or the model's compute dtype (``"model"``): autocast's where it is on,
        else x's own."""
        if self.router_dtype == "float32":
            return x.float()
        dev = x.device.type
        return x.to(torch.get_autocast_dtype(dev)) if torch.is_autocast_enabled(dev) else x

    def forward(self, x: Tensor, token_mask: Tensor | None = None) -> RouterOutput:
        """x: [S, D_in] (any float dtype); token_mask: [S] bool or None (all routed)."""
        S = x.shape[0]
        if token_mask is None:
            token_mask = torch.ones(S, dtype=torch.bool, device=x.device)
        fused = self._fused(x, token_mask)
        if fused is not None:
            return fused
        xg = self.gemm_input(x)
        valid = token_mask[:, None].expand(S, self.top_k).clone()
        with torch.autocast(device_type=x.device.type, enabled=False):
            cpu = self._cpu_softmax(xg, token_mask)
            if cpu is not None and cpu[1] is not None:
                probs, weights, experts, sums = cpu[1]
                return RouterOutput(weights, experts, valid, cpu[0], probs, _counts(experts, valid, self.n_experts),
                                    token_mask, GateSums(*sums))
            if cpu is None:
                logits, gate, probs = self.scores(xg)
            else:  # tied scores: the reference ops on the same scores
                logits = cpu[0]
                gate = probs = logits.softmax(-1)
            choice = gate + self.selection_bias if self.aux_free else gate
            experts = _top_k(choice, self.top_k)
            weights = torch.gather(gate, 1, experts)
            if self.renormalize:
                weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-9)
        weights = weights * valid
        return RouterOutput(weights, experts, valid, logits, probs, _counts(experts, valid, self.n_experts),
                            token_mask)

    def _cpu_softmax(self, xg: Tensor, token_mask: Tensor) -> tuple[Tensor, tuple[Any, ...] | None] | None:
        """The CPU path of a softmax router whose scores are ``xg @ weight.t()``: the score GEMM, then the softmax,
        top-k, combine weights and the losses' reductions in one C++ pass per row and their backward in another
        (:mod:`mhmoe.moe.dispatch.native.router`, the same numbers to fp32 rounding). ``(logits, (probs, weights,
        experts, (lse, entropy, prob_sum)))``; ``(logits, None)`` where tied scores leave the top-k to ``torch.topk``'s
        rule; None where it does not apply: the reference ops run."""
        if self.fused_gate != "softmax" or type(self).scores is not SoftmaxRouter.scores:
            return None
        try:
            from mhmoe.moe.dispatch.native import router as cpu_router
        except ImportError:  # the exported model code (trust_remote_code) carries no C++
            return None
        if not cpu_router.applies(xg, self.n_experts, self.top_k):
            return None
        logits = _linear(xg, self.weight)
        bias = self.selection_bias if self.aux_free else None
        return logits, cpu_router.softmax_topk(logits, bias, token_mask, self.top_k, self.renormalize)

    def _fused(self, x: Tensor, token_mask: Tensor) -> RouterOutput | None:
        """The GPU path: the same routing from one fused Triton kernel per block of tokens
        (:mod:`mhmoe.moe.dispatch.triton.router`, exact to fp32 rounding), where it applies: a softmax or
        sigmoid gate (``fused_gate``), ``impl`` auto or triton, CUDA inputs (CPU only under the Triton
        interpreter with ``impl="triton"``: tests), fp32 scores (``router_dtype="float32"``). None: the reference
        path below runs."""
        if self.fused_gate is None or self.router_dtype != "float32" or self.impl not in ("auto", "triton") or not (
                x.is_cuda or (x.device.type == "cpu" and self.impl == "triton")):
            return None
        try:
            from mhmoe.moe.dispatch.triton import router as fused
        except ImportError:  # no triton (or exported model code, which does not carry the kernels)
            return None
        if not fused.supported(x, self.n_experts, self.top_k, self.fused_gate):
            return None
        bias = self.selection_bias if self.aux_free else None
        logits, probs, weights, experts, counts, *sums = fused.fused_route(
            x, self.weight, bias, token_mask, self.top_k, self.fused_gate, self.renormalize)
        valid = token_mask[:, None].expand(x.shape[0], self.top_k).clone()
        return RouterOutput(weights, experts, valid, logits, probs, counts, token_mask, GateSums(*sums))

    @torch.no_grad()
    def update_bias(self, counts: Tensor, apply: Tensor | None = None) -> None:
        """Aux-loss-free balancing step: raise the bias of under-loaded experts, lower over-loaded.
        ``apply`` (0-dim bool, optional): False leaves the bias unchanged, without a host sync."""
        if not self.aux_free:
            return
        load = counts.to(self.selection_bias.dtype)
        delta = self.bias_update_rate * torch.sign(load.mean() - load)
        self.selection_bias.add_(delta if apply is None else delta * apply.to(delta.dtype))


class SoftmaxRouter(Router):
    """Switch/GShard router: linear scores, softmax over experts, top-k of the probabilities."""

    fused_gate = "softmax"

    def __init__(self, d_in: int, cfg: MoEConfig) -> None:
        super().__init__(d_in, cfg)
        self.weight = nn.Parameter(torch.empty(cfg.n_experts, d_in))
        nn.init.normal_(self.weight, std=cfg.init_std)

    def scores(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        logits = _linear(x, self.weight)
        probs = logits.softmax(-1)
        return logits, probs, probs


class SigmoidRouter(SoftmaxRouter):
    """Sigmoid gating (DeepSeek-V3 style): independent per-expert affinities, top-k of them. With
    ``renormalize`` (the default for top_k > 1, as DeepSeek-V3) the selected affinities are divided by
    their sum; ``renormalize=false`` keeps the raw sigmoids (their sum is not one). ``probs`` (for the
    balance loss) are the affinities normalised over all experts."""

    fused_gate = "sigmoid"

    def scores(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        logits = _linear(x, self.weight)
        gate = torch.sigmoid(logits)
        return logits, gate, gate / gate.sum(-1, keepdim=True)


class NoisyTopKRouter(Router):
    """Shazeer et al. (2017): H = xW_g + N(0,1)*softplus(xW_noise) in training; top-k of H;
    the weights are a softmax over the kept logits (== renormalised top-k, whatever ``renormalize``)."""

    def __init__(self, d_in: int, cfg: MoEConfig) -> None:
        super().__init__(d_in, cfg)
        self.weight = nn.Parameter(torch.empty(cfg.n_experts, d_in))
        self.noise_weight = nn.Parameter(torch.zeros(cfg.n_experts, d_in))
        self.noise_std = cfg.noise_std
        self.renormalize = True  # softmax over the kept logits
        nn.init.normal_(self.weight, std=cfg.init_std)

    def scores(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        logits = _linear(x, self.weight)
        if self.training and self.noise_std > 0:
            noise_scale = F.softplus(_linear(x, self.noise_weight))
            logits = logits + self.noise_std * torch.randn_like(logits) * noise_scale
        probs = logits.softmax(-1)
        return logits, probs, probs


class XMoERouter(Router):
    """X-MoE (Chi et al. 2022): project to a low dimension, cosine-style scores against expert embeddings;
    softmax or sigmoid gate. Two readings (``MoEConfig.xmoe_reading``, docs/PAPERS.md):

    - ``paper``: token and expert embeddings L2-normalised, scores divided by a learnable temperature;
      top-k of the gate like every router.
    - ``code`` (torchscale ``xmoe/routing.py``, ``Top2Gate`` with ``use_xmoe``): only the expert
      embeddings are normalised (the stored ones are rescaled to norm 1.5 before each training
      forward), no temperature; see :meth:`forward_code` for the top-2 gate.

    ``generator`` (optional ``torch.Generator`` on the input's device): the source of the code
    reading's second-expert coin flips in training; None = the global RNG. ``recomputing``: True while
    activation checkpointing runs this router's forward again in the backward
    (:mod:`mhmoe.model.recompute`), when the code reading does not rescale its stored embeddings again.
    """

    EMBED_NORM = 1.5  # routing.py Top2Gate.forward: self.wg.mul_(1.5 / wg_norm)

    def __init__(self, d_in: int, cfg: MoEConfig) -> None:
        super().__init__(d_in, cfg)
        self.code = cfg.xmoe_code
        self.proj = nn.Linear(d_in, cfg.router_dim, bias=False)
        self.expert_embed = nn.Parameter(torch.empty(cfg.n_experts, cfg.router_dim))
        self.gate_kind = cfg.xmoe_gate
        self.generator: torch.Generator | None = None
        self.recomputing = False
        if self.code:  # nn.Linear's default init (wg_reduction); no temperature; normalise before drops only
            self.temperature = None
            self.renormalize = False
        else:
            self.temperature = nn.Parameter(torch.tensor(float(cfg.temperature_init)))
            nn.init.normal_(self.proj.weight, std=cfg.init_std)
        nn.init.orthogonal_(self.expert_embed, gain=0.32)

    def scores(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        z = _linear(x, self.proj.weight)  # the low-dimensional scores below are fp32 in either router_dtype
        if self.code:
            if self.training and not self.recomputing:  # keep the stored embeddings at norm 1.5, as the code does
                with torch.no_grad():
                    self.expert_embed.mul_(self.EMBED_NORM / self.expert_embed.norm(dim=1, keepdim=True))
            logits = z @ F.normalize(self.expert_embed.float(), dim=-1, eps=1e-4).t()
            probs = logits.softmax(-1)
            return logits, probs, probs
        z = F.normalize(z, dim=-1)
        e = F.normalize(self.expert_embed.float(), dim=-1)
        assert self.temperature is not None  # the papers' reading learns one (the code's has none)
        logits = (z @ e.t()) / self.temperature.float().clamp_min(1e-2)
        if self.gate_kind == "softmax":
            probs = logits.softmax(-1)
            return logits, probs, probs
        gate = torch.sigmoid(logits)
        return logits, gate, gate / gate.sum(-1, keepdim=True)

    def forward(self, x: Tensor, token_mask: Tensor | None = None) -> RouterOutput:
        return self.forward_code(x, token_mask) if self.code else super().forward(x, token_mask)

    def forward_code(self, x: Tensor, token_mask: Tensor | None = None) -> RouterOutput:
        """The authors' top-2 gate (routing.py ``top2gating``, ``second_expert_policy="random"``,
        ``normalize_gate_prob_before_dropping=True``). x: [S, D_in]; K = 2 slots.

        The two chosen gates are divided by their sum (g1 + g2 = 1); in training the second slot is
        kept where ``2 * g2 > u``, u ~ U[0, 1) per token (dropped slots take no capacity), and the
        kept weights are *not* renormalised afterwards (a token whose second slot is dropped, here or
        by capacity, gets g1 * Expert1). In eval the second slot is always dispatched with weight
        ``g2 * min(1, 2 * g2)``, its expected training weight (the code flips coins in eval too).
        """
        S = x.shape[0]
        if token_mask is None:
            token_mask = torch.ones(S, dtype=torch.bool, device=x.device)
        xg = self.gemm_input(x)
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits, gate, probs = self.scores(xg)
            top, experts = torch.topk(gate, 2, dim=-1)
            weights = top / top.sum(-1, keepdim=True).clamp_min(torch.finfo(top.dtype).eps)
            keep2 = (2 * weights[:, 1]).clamp_max(1.0)  # probability of keeping the second expert
            valid = token_mask[:, None].expand(S, 2).clone()
            if self.training:
                u = torch.rand(S, generator=self.generator, device=x.device)
                valid[:, 1] &= 2 * weights[:, 1] > u
            else:
                weights = torch.stack([weights[:, 0], weights[:, 1] * keep2], dim=-1)
        weights = weights * valid
        return RouterOutput(weights, experts, valid, logits, probs, _counts(experts, valid, self.n_experts),
                            token_mask)


class ExpertChoiceRouter(SoftmaxRouter):
    """Expert choice (Zhou et al. 2022): every expert picks its top-C tokens by softmax score,
    C = ceil(capacity_factor * S * K / E) (capacity_factor defaults to 1). Tokens may get 0..E experts;
    the weights are the softmax probabilities (never renormalised). Output uses K = E slots per token
    (slot e = expert e). A token's experts depend on every other token of the batch, later ones
    included, so the causal decoder LM refuses this router (bidirectional models may use it)."""

    def __init__(self, d_in: int, cfg: MoEConfig) -> None:
        super().__init__(d_in, cfg)
        self.capacity_factor = cfg.capacity_factor or 1.0
        self.eval_capacity_factor = cfg.eval_capacity_factor or self.capacity_factor

    def forward(self, x: Tensor, token_mask: Tensor | None = None) -> RouterOutput:
        S, E = x.shape[0], self.n_experts
        # the capacity is a Python int (topk's k): known without a sync unless padding is masked out
        n_real = S if token_mask is None else int(token_mask.sum())
        if token_mask is None:
            token_mask = torch.ones(S, dtype=torch.bool, device=x.device)
        cf = self.capacity_factor if self.training else self.eval_capacity_factor
        xg = self.gemm_input(x)
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits, probs, _ = self.scores(xg)
            cap = min(n_real, expert_capacity(n_real, self.top_k, E, cf))
            masked = probs.masked_fill(~token_mask[:, None], -1.0)  # padding is never picked
            experts = torch.arange(E, device=x.device).expand(S, E)
            valid = torch.zeros(S, E, dtype=torch.bool, device=x.device)
            if cap > 0:
                _, picked = torch.topk(masked.t(), cap, dim=-1)  # [E, C] token ids
                valid[picked, torch.arange(E, device=x.device)[:, None].expand(E, cap)] = True
            weights = probs * valid
        return RouterOutput(weights, experts.contiguous(), valid, logits, probs, valid.sum(0), token_mask)


ROUTER_CLASSES: dict[str, type[Router]] = {
    "softmax": SoftmaxRouter,
    "sigmoid": SigmoidRouter,
    "noisy": NoisyTopKRouter,
    "xmoe": XMoERouter,
    "expert_choice": ExpertChoiceRouter,
}


def build_router(d_in: int, cfg: MoEConfig) -> Router:
    """Router named by ``cfg.router`` for inputs of width ``d_in``."""
    return ROUTER_CLASSES[cfg.router](d_in, cfg)
