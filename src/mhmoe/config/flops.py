"""Analytic forward FLOPs of a whole model, per token, from its :class:`ModelConfig` alone.

The count is a property of the model, not of the kernels that run it: every execution path (sorted,
grouped, padded, fused, Triton) reports the same number. Convention: 2 FLOPs per multiply-add (what
``torch.utils.flop_counter`` and MFU use; the parity planner in :mod:`mhmoe.config.planner` uses the
papers' ``2n - 1`` instead). Matmuls only; attention scores (QK^T and the weighted sum of V) count the
full ``T x T`` products, as PaLM's MFU convention and PyTorch's FLOP counter on CUDA do (its CPU
attention kernel is not counted, so on CPU the counter reports the total without ``scores``). A routed
expert is charged for the (sub-)tokens it actually processes: ``heads * top_k`` per token (expert choice:
``capacity_factor * top_k`` on average; capacity drops are not subtracted).

Shape legend: d model width, h heads, a = d/h expert width, F expert hidden, E experts, k top-k,
T sequence length, V vocabulary.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mhmoe.config.model import ModelConfig
from mhmoe.config.moe import MoEConfig


def _ffn(d_in: float, hidden: float, ffn: str) -> float:
    """One FFN row: (2 or 3) matrices of d_in x hidden, 2 FLOPs per multiply-add."""
    return 2 * (3 if ffn == "swiglu" else 2) * d_in * hidden


def router_flops(moe: MoEConfig, d_in: float) -> float:
    """Router matmuls per routed (sub-)token (evaluation: noisy gating's noise branch is off)."""
    if moe.router == "xmoe":
        return 2 * d_in * moe.router_dim + 2 * moe.router_dim * moe.n_experts
    return 2 * d_in * moe.n_experts


def moe_layer_flops(moe: MoEConfig, d: int) -> dict[str, float]:
    """FLOPs per token of one FFN layer described by ``moe`` (dense, SMoE or MH-MoE), by part."""
    if moe.kind == "dense":
        return {"experts": _ffn(d, moe.d_expert, moe.ffn), "head_merge": 0.0, "router": 0.0, "shared": 0.0}
    h = moe.heads if moe.token_split else 1
    a = d / h
    per_token = moe.top_k * ((moe.capacity_factor or 1.0) if moe.router == "expert_choice" else 1.0)
    mats = moe.mlp_layers * (int(moe.head_layer) + int(moe.merge_layer))
    return {
        "experts": h * per_token * _ffn(a, moe.d_expert, moe.ffn),
        "head_merge": mats * 2 * d * d,
        "router": h * router_flops(moe, a),
        "shared": _ffn(d, moe.n_shared * moe.shared_width, moe.ffn) if moe.n_shared else 0.0,
    }


@dataclass
class ModelFlops:
    """Forward FLOPs per token of a whole model, by part (``total`` = their sum)."""

    attention: float  # q, k, v and output projections
    scores: float  # QK^T and attention-weighted V
    ffn: float  # the dense FFN blocks
    moe: float
    lm_head: float
    total: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def model_flops_per_token(cfg: ModelConfig, seq_len: int) -> ModelFlops:
    """Analytic forward FLOPs per token of :class:`mhmoe.model.LM` on sequences of ``seq_len`` tokens.
    A training step (forward + backward) costs about 3x this."""
    d = cfg.d_model
    kv = 2 * cfg.kv_heads * (d // cfg.n_heads)  # key and value widths (2d without grouped-query attention)
    attention = cfg.n_layers * (2 * d * (d + kv) + 2 * d * d)
    scores = cfg.n_layers * 2 * 2 * seq_len * d
    n_moe = sum(cfg.is_moe_block(i) for i in range(cfg.n_layers))
    dense = (cfg.n_layers - n_moe) * _ffn(d, cfg.d_ff, "swiglu")
    moe = n_moe * sum(moe_layer_flops(cfg.moe, d).values()) if n_moe else 0.0
    lm_head = 2 * d * cfg.vocab_size
    return ModelFlops(attention, scores, dense, moe, lm_head, attention + scores + dense + moe + lm_head)
