"""Auxiliary router losses as pure functions of a routing decision.

All functions take fp32 router tensors and a token mask ([S] bool; padding excluded) and return a
0-dim fp32 tensor. For MH-MoE every statistic is counted over *sub-tokens* (ICML Eq.10: |X| is
the number of sub-tokens).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mhmoe.moe.capacity import expert_counts


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x [S, ...] over rows where mask [S] is True (0 when no row is)."""
    m = mask.to(x.dtype).reshape(-1, *([1] * (x.dim() - 1)))
    return (x * m).sum(0) / m.sum().clamp_min(1.0)


def load_balancing_loss(probs: Tensor, experts: Tensor, valid: Tensor, token_mask: Tensor,
                        prob_sum: Tensor | None = None) -> Tensor:
    """Switch / GShard load-balancing loss, ICML MH-MoE Eq.10.

    ``L = E * sum_e f_e * P_e`` where ``f_e`` is the fraction of the routed (sub-token, slot) pairs
    sent to expert e (the paper's t_p, normalised by |X|*K so it is a frequency) and ``P_e`` the mean
    gate probability of expert e over the sub-tokens. Equals 1 for a perfectly uniform router.

    Args:
        probs: [S, E] gate distribution. experts: [S, K] chosen expert ids.
        valid: [S, K] chosen slots (the choice before capacity drops). token_mask: [S].
        prob_sum: [E] probs summed over the rows of token_mask where the router computed it
            (:class:`~mhmoe.moe.routers.GateSums`), else None (summed here).
    """
    E = probs.shape[-1]
    counts = expert_counts(experts, E, valid & token_mask[:, None]).to(probs.dtype)
    f = counts / counts.sum().clamp_min(1.0)
    p = _masked_mean(probs, token_mask) if prob_sum is None else _mean_of_sum(prob_sum, token_mask)
    return E * (f * p).sum()


def _row_entropy(probs: Tensor) -> Tensor:
    """Each row's gate entropy ``-sum_e p log p`` [S] of probs [S, E] (``log(p + tiny)``: finite at p = 0)."""
    return -(probs * (probs + torch.finfo(probs.dtype).tiny).log()).sum(-1)


def gate_reductions(logits: Tensor, probs: Tensor, token_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """What the router losses read, from the scores, where a router did not compute it in its own pass
    (:class:`~mhmoe.moe.routers.GateSums`' fields): each row's logsumexp [S] and entropy [S], and probs [S, E]
    summed over the rows of token_mask [S] ([E])."""
    return (torch.logsumexp(logits, dim=-1), _row_entropy(probs),
            (probs * token_mask.to(probs.dtype)[:, None]).sum(0))


def _mean_of_sum(total: Tensor, mask: Tensor) -> Tensor:
    """A masked sum over the rows of mask [S] divided by their number, as :func:`_masked_mean` (0 when none)."""
    return total / mask.sum().to(total.dtype).clamp_min(1.0)


def router_z_loss(logits: Tensor, token_mask: Tensor, lse: Tensor | None = None) -> Tensor:
    """ST-MoE router z-loss: mean over tokens of logsumexp(logits)^2. logits: [S, E]; lse: [S] each row's logsumexp
    where the router computed it (:class:`~mhmoe.moe.routers.GateSums`), else None (computed here)."""
    return _masked_mean((torch.logsumexp(logits, dim=-1) if lse is None else lse) ** 2, token_mask)


def entropy_loss(probs: Tensor, token_mask: Tensor, mode: str = "token", row_entropy: Tensor | None = None,
                 prob_sum: Tensor | None = None) -> Tensor:
    """Survey Eq.3, ``-sum_i p_i log p_i``, in one of two readings (the survey does not say over what).

    - ``token``: mean over tokens of each token's gate entropy; minimising it sharpens decisions.
    - ``batch``: ``log E - H(mean_s p_s)``, >= 0 and zero when the batch-average gate is uniform;
      minimising it balances the load.

    ``row_entropy`` [S] (each row's ``-sum p log p``) and ``prob_sum`` [E] (probs summed over token_mask's rows): the
    router's own reductions where it computed them (:class:`~mhmoe.moe.routers.GateSums`), else None (computed here).
    """
    eps = torch.finfo(probs.dtype).tiny
    if mode == "token":
        return _masked_mean(_row_entropy(probs) if row_entropy is None else row_entropy, token_mask)
    if mode == "batch":
        p = _masked_mean(probs, token_mask) if prob_sum is None else _mean_of_sum(prob_sum, token_mask)
        return math.log(probs.shape[-1]) + (p * (p + eps).log()).sum()
    raise ValueError(f"invalid entropy mode={mode!r}: allowed token | batch")
