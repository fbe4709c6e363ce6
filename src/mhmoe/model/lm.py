"""Decoder-only MH-MoE language model, readable top to bottom.

Shape legend: B batch, T time, D model dim (d_model), NH attention heads, KV key/value heads (n_kv_heads;
= NH without grouped-query attention), HD = D / NH head dim, V vocabulary. The FFN of every ``moe_every``-th
block is the layer ``ModelConfig.moe`` describes (dense, SMoE or MH-MoE, see :mod:`mhmoe.moe`); the others are
dense SwiGLU FFNs of width ``d_ff``.

    x = embed(idx)                                   [B, T, D]
    for block: x = x + attn(rmsnorm(x))              causal SDPA with RoPE
               x = x + ffn(rmsnorm(x))               dense SwiGLU or (MH-)MoE
    logits = lm_head(rmsnorm(x))                     [B, T, V]

The forward returns a :class:`LMOutput` with logits, the LM loss, the total auxiliary router loss
and per-MoE-layer :class:`~mhmoe.moe.RoutingStats`. Model code is single-device; parallelism is
applied from outside.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mhmoe.config.model import ModelConfig
from mhmoe.config.moe import MoEConfig
from mhmoe.errors import ConfigError
from mhmoe.model.lm_loss import chunked_token_loss, token_loss, use_chunks
from mhmoe.model.pretrained import PretrainedMixin
from mhmoe.model.recompute import Recomputable, run_part
from mhmoe.moe.experts import GroupedExperts
from mhmoe.moe.layers import FFNOutput, RoutingStats, build_ffn_layer
from mhmoe.quant.bitnet import BitLinear, SubNorm


@dataclass
class LMOutput:
    """logits [B, T, V] (None when the forward was asked for the loss only); loss = LM cross-entropy (None
    without targets); aux_loss = summed weighted router losses of all MoE layers (0-dim fp32); routing = one
    RoutingStats per MoE layer."""

    logits: Tensor | None
    loss: Tensor | None
    aux_loss: Tensor
    routing: list[RoutingStats] = field(default_factory=list)
    layer_outputs: list[FFNOutput] | None = None  # full routing decisions when return_routing=True

    @property
    def total_loss(self) -> Tensor:
        assert self.loss is not None, "no targets were given"
        return self.loss + self.aux_loss


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(d))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos, sin tables [seq_len, head_dim/2] (fp32)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    ang = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)
    return ang.cos(), ang.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, NH, T, HD]; cos/sin [T, HD/2]. Rotates pairs (first half, second half)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.to(x.dtype)


class KVCache:
    """Per-layer key/value cache for incremental decoding: the keys and values of every cached position,
    ``k[layer]`` / ``v[layer]`` [B, KV, T_cached, HD]. They live in buffers with room for ``capacity`` positions
    (grown by doubling when a forward needs more), so a decoding step writes its one new position instead of
    copying the whole cache (a copy per layer and token that grows with the context)."""

    def __init__(self, n_layers: int, capacity: int = 0) -> None:
        self.capacity = capacity
        self._k: list[Tensor | None] = [None] * n_layers
        self._v: list[Tensor | None] = [None] * n_layers
        self._len = [0] * n_layers

    @property
    def k(self) -> list[Tensor | None]:
        return [None if b is None else b[:, :, :n] for b, n in zip(self._k, self._len, strict=True)]

    @property
    def v(self) -> list[Tensor | None]:
        return [None if b is None else b[:, :, :n] for b, n in zip(self._v, self._len, strict=True)]

    @property
    def length(self) -> int:
        return self.layer_length(0)

    def layer_length(self, layer: int) -> int:
        """Cached positions of ``layer`` (layers fill one after another within a forward)."""
        return self._len[layer]

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append k, v [B, KV, T, HD] to ``layer``'s cache; returns all its keys and values [B, KV, T_cached, HD]."""
        n, end = self._len[layer], self._len[layer] + k.shape[2]
        kb, vb = self._k[layer], self._v[layer]
        if kb is None or vb is None or end > kb.shape[2]:
            room = max(end, self.capacity, 2 * (0 if kb is None else kb.shape[2]))
            grown = [t.new_empty(*t.shape[:2], room, t.shape[3]) for t in (k, v)]
            if kb is not None and vb is not None:
                grown[0][:, :, :n], grown[1][:, :, :n] = kb[:, :, :n], vb[:, :, :n]
            kb, vb = self._k[layer], self._v[layer] = grown
        kb[:, :, n:end], vb[:, :, n:end] = k, v
        self._len[layer] = end
        return kb[:, :, :end], vb[:, :, :end]


class Attention(nn.Module):
    """Multi-head (or grouped-query) self-attention with RoPE: causal (the decoder; KV cache for decoding) or
    bidirectional (the encoder: every query attends to every key that is not padding). ``qkv`` maps D to the
    queries, keys and values, in that order: [D + 2 KV HD, D]."""

    def __init__(self, cfg: ModelConfig, causal: bool = True) -> None:
        super().__init__()
        self.causal = causal
        self.n_heads, self.n_kv, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.d_model // cfg.n_heads
        quantized = cfg.quant != "none"
        linear = BitLinear if quantized else nn.Linear
        self.qkv = linear(cfg.d_model, cfg.d_model + 2 * self.n_kv * self.head_dim, bias=False)
        self.proj = linear(cfg.d_model, cfg.d_model, bias=False)
        # qk_norm: one RMSNorm over every query head, one over every key head (before RoPE)
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        # bitnet158: sub-norm before the output projection (the released BitNet models' scheme); the
        # qkv input is already normalised by the block's pre-norm
        self.sub_norm = SubNorm(cfg.d_model, cfg.norm_eps) if quantized else None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache | None = None, layer: int = 0,
                key_mask: Tensor | None = None) -> Tensor:
        """x [B, T, D]; cos/sin [T, HD/2]; key_mask [B, T_past + T] bool (False = padding key, never
        attended to); ``cache`` (causal only) holds the keys and values of earlier positions."""
        B, T, D = x.shape
        if self.n_kv == self.n_heads:
            q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        else:  # grouped-query attention: q [B, NH, T, HD], k and v [B, KV, T, HD]
            q, k, v = self.qkv(x).split([D, self.n_kv * self.head_dim, self.n_kv * self.head_dim], -1)
            q, k, v = (t.reshape(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        gqa = self.n_kv != self.n_heads  # SDPA pairs query head i with key/value head i // (NH / KV)
        if not self.causal:
            mask = None if key_mask is None else key_mask[:, None, None, :].bool()  # [B, 1, 1, T]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        else:
            y = self._causal(q, k, v, cache, layer, key_mask, gqa)
        y = y.transpose(1, 2).reshape(B, T, D)
        return self.proj(y if self.sub_norm is None else self.sub_norm(y))

    @staticmethod
    def _causal(q: Tensor, k: Tensor, v: Tensor, cache: KVCache | None, layer: int,
                key_mask: Tensor | None, gqa: bool = False) -> Tensor:
        """q [B, NH, T, HD], k/v [B, KV, T, HD] -> [B, NH, T, HD]: each query sees its own and earlier positions."""
        T, past = q.shape[2], 0
        if cache is not None:
            past = cache.layer_length(layer)
            k, v = cache.update(layer, k, v)
        if key_mask is not None or (past and T > 1):  # padding, or chunked prefill after a prefix
            S = k.shape[2]
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=S - T)
            if key_mask is not None:  # every query keeps its own key, so padded rows stay finite
                diag = torch.zeros(T, S, dtype=torch.bool, device=q.device)
                diag[:, S - T:] = torch.eye(T, dtype=torch.bool, device=q.device)
                mask = (mask & key_mask[:, None, None, :].bool()) | diag
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, is_causal=T > 1 and not past, enable_gqa=gqa)


class Block(Recomputable):
    """Pre-norm transformer block: attention (causal or bidirectional), then the dense or (MH-)MoE FFN
    (every ``moe_every``-th block) on the real positions (``mask``). ``recompute`` (set from outside by
    :func:`mhmoe.model.recompute.set_activation_checkpointing`): the part a training forward runs under
    activation checkpointing, ``none`` | ``block`` | ``ffn``."""

    def __init__(self, cfg: ModelConfig, index: int, causal: bool = True) -> None:
        super().__init__()
        self.is_moe = cfg.is_moe_block(index)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, causal)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        ffn_cfg = cfg.moe if self.is_moe else MoEConfig(kind="dense", d_expert=cfg.d_ff, init_std=cfg.init_std,
                                                        quant=cfg.quant)
        self.ffn = build_ffn_layer(cfg.d_model, ffn_cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None = None, cache: KVCache | None = None,
                layer: int = 0, key_mask: Tensor | None = None, stats: bool = True) -> tuple[Tensor, FFNOutput]:
        """x [B, T, D]; mask [B, T] (True = a real position, routed); key_mask: see :class:`Attention`;
        ``stats=False``: the MoE FFN computes no router losses or statistics (generation)."""
        return run_part(self, self.recompute == "block" and cache is None, self._forward, x, cos, sin, mask, cache,
                        layer, key_mask, stats)  # a KV cache is appended to: never run twice

    def _forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, cache: KVCache | None, layer: int,
                 key_mask: Tensor | None, stats: bool) -> tuple[Tensor, FFNOutput]:
        x = x + self.attn(self.attn_norm(x), cos, sin, cache, layer, key_mask)
        f = run_part(self.ffn, self.recompute == "ffn", self._ffn, x, mask, stats)
        return x + f.out, f

    def _ffn(self, x: Tensor, mask: Tensor | None, stats: bool) -> FFNOutput:
        return self.ffn(self.ffn_norm(x), mask, stats=stats)


def run_blocks(blocks: nn.ModuleList, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None = None,
               cache: KVCache | None = None, key_mask: Tensor | None = None, return_routing: bool = False,
               stats: bool = True) -> tuple[Tensor, Tensor, list[RoutingStats], list[FFNOutput]]:
    """``x`` [B, T, D] through every :class:`Block` (the decoder's and the encoder's loop): returns the
    output [B, T, D], the summed weighted router losses of the MoE blocks (0-dim fp32), one RoutingStats
    per MoE block and, with ``return_routing``, the MoE blocks' full FFNOutputs. ``stats=False``: no router
    losses or statistics (the aux loss 0, no RoutingStats)."""
    aux = torch.zeros((), dtype=torch.float32, device=x.device)
    routing: list[RoutingStats] = []
    outputs: list[FFNOutput] = []
    for i, block in enumerate(blocks):
        x, f = block(x, cos, sin, mask, cache, i, key_mask, stats)
        if block.is_moe:
            aux = aux + f.aux_loss
            if f.stats is not None:
                routing.append(f.stats)
            if return_routing:
                outputs.append(f)
    return x, aux, routing, outputs


class LM(nn.Module, PretrainedMixin):
    """The language model. forward(idx [B, T], targets [B, T] | None, mask [B, T] | None).

    ``LM.from_pretrained(path)`` / ``model.save_pretrained(dir, tokenizer=...)``: :mod:`mhmoe.model.pretrained`."""

    rope_cos: Tensor  # [max_seq_len, HD/2] buffers (not saved)
    rope_sin: Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.vocab_size < 1:
            raise ConfigError("vocab_size", cfg.vocab_size, "an integer >= 1 (set it from the tokenizer)")
        if cfg.arch != "decoder":
            raise ConfigError("model.arch", cfg.arch, "decoder for the causal LM (mhmoe.model.build_model)")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        cos, sin = rope_tables(cfg.max_seq_len, cfg.d_model // cfg.n_heads, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 style: N(0, init_std) everywhere, output projections scaled by 1/sqrt(2 L).
        MH-MoE head/merge projections keep their Xavier init (ICML App. E)."""
        std, out_std = self.cfg.init_std, self.cfg.init_std / math.sqrt(2 * self.cfg.n_layers)
        nn.init.normal_(self.embed.weight, std=std)
        if not self.cfg.tie_embeddings:
            nn.init.normal_(self.lm_head.weight, std=std)
        for block in cast("list[Block]", self.blocks):
            nn.init.normal_(block.attn.qkv.weight, std=std)
            nn.init.normal_(block.attn.proj.weight, std=out_std)
            for m in block.ffn.modules():
                if isinstance(m, GroupedExperts):  # routed, shared and dense experts
                    m.reset_parameters(std, out_std)

    def forward(self, idx: Tensor, targets: Tensor | None = None, mask: Tensor | None = None,
                cache: KVCache | None = None, return_routing: bool = False,
                key_mask: Tensor | None = None, return_logits: bool = True) -> LMOutput:
        """idx/targets/mask [B, T]; key_mask [B, T_cached + T] bool marks padding keys (False) that no
        query attends to (left-padded batches; RoPE is relative, so a row's pad offset cancels). With a ``cache``
        and no ``targets`` (generation) the router losses and routing statistics are not computed: ``aux_loss``
        is 0 and ``routing`` empty unless ``return_routing``. ``return_logits=False`` with ``targets`` (training,
        evaluation): the loss is computed with the LM head in row chunks
        (:func:`~mhmoe.model.lm_loss.chunked_token_loss`) and ``logits`` is None, on a CPU, and elsewhere when the
        batch's logits are large (:func:`~mhmoe.model.lm_loss.use_chunks`); otherwise, and in compiled graphs, the
        plain head and loss run (``logits`` returned)."""
        if idx.dim() != 2:
            raise ValueError(f"invalid idx shape {tuple(idx.shape)}: allowed [B, T]")
        B, T = idx.shape
        start = cache.length if cache is not None else 0
        if start + T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {start + T} exceeds model.max_seq_len={self.cfg.max_seq_len}")
        cos, sin = self.rope_cos[start:start + T], self.rope_sin[start:start + T]
        # a row gather whose backward is index_add: nn.Embedding's CUDA backward reads a segment count on
        # the host (a device sync in every training step); on CPU both are the same computation
        x = self.embed.weight.index_select(0, idx.reshape(-1)).view(B, T, -1)
        stats = cache is None or targets is not None or return_routing
        x, aux, routing, outputs = run_blocks(self.blocks, x, cos, sin, mask, cache, key_mask, return_routing, stats)
        h, layers = self.norm(x), outputs if return_routing else None
        if targets is not None and not return_logits and use_chunks(h, self.cfg.vocab_size):
            return LMOutput(None, chunked_token_loss(h, self.lm_head.weight, targets, mask), aux, routing, layers)
        logits = self.lm_head(h)
        loss = None if targets is None else token_loss(logits, targets, mask)
        return LMOutput(logits, loss, aux, routing, layers)

    @torch.no_grad()
    def balance_step(self, routing: list[RoutingStats], apply: Tensor | None = None) -> None:
        """Aux-loss-free balancing: update each MoE router's selection bias from its counts (call once
        per optimizer step with the step's summed counts; ``apply`` a 0-dim bool, False = a skipped step)."""
        moe_routers = [m for m in self.modules() if hasattr(m, "update_bias")]
        for router, stats in zip(moe_routers, routing, strict=False):
            cast(Any, router).update_bias(stats.counts, apply)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed.weight.numel() if exclude_embeddings else n
