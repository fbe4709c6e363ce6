"""Peer MoE layers from PyPI for ``mhmoe bench moe --peers`` (the optional ``bench`` extra).

- ``st_moe`` -- ``st-moe-pytorch`` (lucidrains' ST-MoE): ``TopNGating`` (top-n >= 2) with GShard
  capacity (train factor 1.25) and one-hot dispatch/combine einsums; GEGLU experts in a ModuleList,
  hidden width ``int(dim * mult * 2/3)`` -- we pick ``mult`` so it equals our expert width F.
- ``moe`` -- ``mixture-of-experts`` (lucidrains' port of tensor2tensor's MoE): ``Top2Gating`` only,
  capacity factor 1.25, one-hot dispatch; its experts are replaced by a stacked SwiGLU of our shape
  (the package accepts an ``experts`` module), so only its routing/dispatch machinery is measured.

Both peers use their library defaults except: every top-n slot is dispatched (second-expert
threshold 0 / policy ``all``) so they do the same expert work as our dropless layer, up to their
capacity drops. MH-MoE configs wrap the peer in our head/merge projections and token split.
Tokens are grouped into sequences of ``group`` tokens (their capacity is per sequence). In bfloat16
the peers keep fp32 weights and run under ``torch.autocast`` (both build fp32 dispatch tensors and
fail on bf16 inputs otherwise), as a user of those libraries would.
A peer that cannot express a config (top-1, or top-3 for ``moe``) is skipped for it.

- ``hf_eager`` / ``hf_grouped_mm`` / ``hf_batched_mm`` -- Hugging Face transformers' Qwen3-MoE sparse
  block (``Qwen3MoeSparseMoeBlock``: softmax top-k router, stacked SwiGLU experts, dropless) with each
  of its experts backends (``config._experts_implementation``: the per-expert loop, ``grouped_mm``,
  ``batched_mm``), sized like our layer (hidden ``d/h``, expert width F, E experts, top-k; top-k
  weights not renormalised, as in our configs), router and experts initialised N(0, 0.02). It returns
  no auxiliary loss. In bfloat16 its weights are cast to bf16 (transformers runs models in the model
  dtype), so it gets the same inputs as our layer.

Memory: ``hf_batched_mm`` gathers the expert weights for every (token, slot) pair before its batched
GEMVs (``gate_up_proj[expert_ids]``: [N, 2F, d], then ``down_proj[expert_ids]``: [N, d, F], N = routed
sub-tokens x top-k), all kept for the backward, and the backward materialises each one's gradient
(while it is still saved) before scattering it to the experts: a peak of about 3 N d F elements in the
forward and 4 N d F in forward + backward (:func:`peer_predicted_bytes`; in bf16 at 16k tokens 116-155 GB
forward for the four parity configs). The benchmark skips a peer
whose prediction exceeds the free memory, with a note in the JSON, rather than letting it fail or
fragment the allocator mid-run.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

PEERS = {"st_moe": "st_moe_pytorch", "moe": "mixture_of_experts", "hf_eager": "transformers",
         "hf_grouped_mm": "transformers", "hf_batched_mm": "transformers"}
NATIVE_DTYPE = ("hf_eager", "hf_grouped_mm", "hf_batched_mm")  # peers run in the benchmark dtype (no autocast)


def installed_peers() -> list[str]:
    """Names of the peers whose package is importable."""
    return [name for name, module in PEERS.items() if importlib.util.find_spec(module) is not None]


@dataclass
class PeerOutput:
    out: Tensor
    aux_loss: Tensor


class _SwiGLUExperts(nn.Module):
    """E stacked SwiGLU experts on [E, ..., D] inputs (the ``experts=`` module for ``mixture-of-experts``)."""

    def __init__(self, n_experts: int, d_in: int, d_hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n_experts, d_in, d_hidden) * 0.02)
        self.w3 = nn.Parameter(torch.randn(n_experts, d_in, d_hidden) * 0.02)
        self.w2 = nn.Parameter(torch.randn(n_experts, d_hidden, d_in) * 0.02)

    def forward(self, x: Tensor) -> Tensor:  # x [E, N, D]
        return torch.bmm(F.silu(torch.bmm(x, self.w1)) * torch.bmm(x, self.w3), self.w2)


class PeerLayer(nn.Module):
    """A peer MoE over (sub-)tokens, with MH-MoE's head/merge projections when ``heads > 1``.

    forward(x [N, D]) -> PeerOutput(out [N, D], aux_loss []); N must be a multiple of ``group``.
    """

    def __init__(self, peer: nn.Module, d_model: int, heads: int, group: int) -> None:
        super().__init__()
        self.peer, self.heads, self.group = peer, heads, group
        self.head = nn.Linear(d_model, d_model, bias=False) if heads > 1 else nn.Identity()
        self.merge = nn.Linear(d_model, d_model, bias=False) if heads > 1 else nn.Identity()

    def forward(self, x: Tensor) -> PeerOutput:
        n, d = x.shape
        sub = self.head(x).reshape(n // self.group, self.group * self.heads, d // self.heads)  # [G, n_g*H, D/H]
        res = self.peer(sub)
        out, aux = (res, x.new_zeros((), dtype=torch.float32)) if isinstance(res, Tensor) else (res[0], res[1])
        return PeerOutput(self.merge(out.reshape(n, d)), aux)


def _hf_block(backend: str, d_in: int, experts: int, d_expert: int, top_k: int) -> nn.Module:
    """transformers' Qwen3-MoE sparse block with the experts backend ``backend`` (eager | grouped_mm | batched_mm)."""
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=d_in, moe_intermediate_size=d_expert, num_experts=experts,
                         num_experts_per_tok=top_k, norm_topk_prob=False, hidden_act="silu",
                         experts_implementation=backend)
    block = Qwen3MoeSparseMoeBlock(cfg)
    for p in block.parameters():
        nn.init.normal_(p, std=0.02)
    return block


def build_peer(name: str, d_model: int, experts: int, d_expert: int, top_k: int, heads: int,
               group: int) -> PeerLayer | None:
    """The peer ``name`` configured like our layer, or None when it cannot express the config."""
    d_in = d_model // heads
    if name == "st_moe":
        from st_moe_pytorch import MoE

        if top_k < 2:
            return None
        mult = d_expert * 3 / (2 * d_in)  # their hidden = int(dim * mult * 2 / 3)
        peer = MoE(d_in, num_experts=experts, gating_top_n=top_k, expert_hidden_mult=mult,
                   threshold_train=0.0, threshold_eval=0.0, router_z_loss_coef=0.0)
        assert int(d_in * mult * 2 / 3) == d_expert
    elif name == "moe":
        from mixture_of_experts import MoE

        if top_k != 2:
            return None
        peer = MoE(d_in, num_experts=experts, second_policy_train="all", second_policy_eval="all",
                   experts=_SwiGLUExperts(experts, d_in, d_expert))
    elif name in NATIVE_DTYPE:
        peer = _hf_block(name[3:], d_in, experts, d_expert, top_k)
    else:
        raise ValueError(f"unknown peer {name!r}: allowed {', '.join(PEERS)}")
    return PeerLayer(peer, d_model, heads, group)


def peer_predicted_bytes(name: str, d_model: int, experts: int, d_expert: int, top_k: int, heads: int,
                         tokens: int, dtype: torch.dtype, backward: bool) -> int | None:
    """Predicted peak memory (bytes above the inputs and weights) of peer ``name`` on ``tokens`` tokens, for
    the peers whose memory grows with tokens x expert size (``hf_batched_mm``); None for the others, whose
    memory is that of their activations (like our layer's)."""
    if name != "hf_batched_mm":
        return None
    n, d_in = tokens * heads * top_k, d_model // heads
    item = torch.empty((), dtype=dtype).element_size()
    return (4 if backward else 3) * n * d_in * d_expert * item


def peer_info() -> dict[str, Any]:
    """Installed peer versions (for the benchmark's machine record)."""
    from importlib.metadata import version

    return {name: version(PEERS[name].replace("_", "-")) for name in installed_peers()}


def default_peers(device_type: str) -> list[str]:
    """The peers ``mhmoe bench moe`` times by default: on CUDA, the transformers block with its three
    experts backends (when installed); on CPU, every installed peer except transformers' per-expert loop
    (``hf_eager``, as slow as our loop oracle)."""
    names = installed_peers()
    if device_type == "cuda":
        return [n for n in names if n in NATIVE_DTYPE]
    return [n for n in names if n != "hf_eager"]
