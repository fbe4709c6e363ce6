"""Bidirectional (MH-)MoE encoder for masked multi-modal modelling (the ICML paper's BEiT-3 setting at
small scale), readable top to bottom.

Shape legend: B batch, T positions, D model dim (d_model), NH attention heads, HD = D / NH head dim,
V joint vocabulary (text ids, visual codes, ``[PAD] [MASK] [CLS] [SEP]``:
:class:`mhmoe.data.multimodal.MultimodalVocab`). The FFN of every ``moe_every``-th block is the layer
``ModelConfig.moe`` describes (dense, SMoE or MH-MoE, :mod:`mhmoe.moe`), exactly as in the decoder.

    x = embed(ids) + modality(m) + row(r) + col(c)   [B, T, D]   (row/col only on image patches)
    for block: x = x + attn(rmsnorm(x))              bidirectional SDPA with RoPE; padding keys masked
               x = x + ffn(rmsnorm(x), mask)         dense SwiGLU or (MH-)MoE; padding is not routed
    logits = head(rmsnorm(x))                        [B, T, V]   (tied to embed)
    loss = cross-entropy(logits, targets) over the masked positions (loss_mask)

Everything but the attention mask and the input embeddings is the decoder's
(:mod:`mhmoe.model.lm`): the same :class:`~mhmoe.model.lm.Block` (built with ``causal=False``: its
attention masks padding keys only), block loop (:func:`~mhmoe.model.lm.run_blocks`), fp32 loss
(:func:`~mhmoe.model.lm.token_loss`), RMSNorm, initialisation and aux-loss-free balancing step. BEiT-3
differs in two places, both deliberate: one tied softmax over the joint vocabulary (BEiT-3 has a vision
and a language head; a single head makes the masked perplexity of both modalities comparable across
models with one number), and RoPE plus learned modality and patch row/column embeddings in place of
BEiT-3's learned absolute positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from mhmoe.config.model import ModelConfig
from mhmoe.errors import ConfigError
from mhmoe.model.lm import LM, Block, RMSNorm, rope_tables, run_blocks
from mhmoe.model.lm_loss import chunked_token_loss, token_loss, use_chunks
from mhmoe.moe.layers import FFNOutput, RoutingStats

N_MODALITIES = 2  # 0 text, 1 image (mhmoe.data.multimodal.MODALITY_TEXT / MODALITY_IMAGE)


@dataclass
class EncoderOutput:
    """logits [B, T, V] (None when asked for the loss only); loss = mean cross-entropy over the masked positions
    (None without targets);
    aux_loss = summed weighted router losses of all MoE layers (0-dim fp32); routing = one
    RoutingStats per MoE layer; layer_outputs = full routing decisions when return_routing=True."""

    logits: Tensor | None
    loss: Tensor | None
    aux_loss: Tensor
    routing: list[RoutingStats] = field(default_factory=list)
    layer_outputs: list[FFNOutput] | None = None

    @property
    def total_loss(self) -> Tensor:
        assert self.loss is not None, "no targets were given"
        return self.loss + self.aux_loss


class Encoder(nn.Module):
    """The masked-data encoder. forward(input_ids [B, T], modality, patch_pos, attention_mask, targets,
    loss_mask) -> :class:`EncoderOutput` (see :meth:`forward`)."""

    rope_cos: Tensor  # [max_seq_len, HD/2] buffers (not saved)
    rope_sin: Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.arch != "encoder":
            raise ConfigError("model.arch", cfg.arch, "encoder for mhmoe.model.encoder.Encoder")
        if cfg.vocab_size < 1:
            raise ConfigError("vocab_size", cfg.vocab_size, "an integer >= 1 (set it from the data's vocabulary)")
        self.cfg = cfg
        d = cfg.d_model
        self.embed = nn.Embedding(cfg.vocab_size, d)
        self.modality_embed = nn.Embedding(N_MODALITIES, d)
        # patch grid coordinates are below the sequence length, so max_seq_len rows always suffice
        self.patch_row = nn.Embedding(cfg.max_seq_len, d)
        self.patch_col = nn.Embedding(cfg.max_seq_len, d)
        self.blocks = nn.ModuleList(Block(cfg, i, causal=False) for i in range(cfg.n_layers))
        self.norm = RMSNorm(d, cfg.norm_eps)
        self.lm_head = nn.Linear(d, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        cos, sin = rope_tables(cfg.max_seq_len, d // cfg.n_heads, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The decoder's scheme (:meth:`mhmoe.model.lm.LM.reset_parameters`: N(0, init_std), output
        projections scaled by 1/sqrt(2 L), MH-MoE projections Xavier) and N(0, init_std) for the
        modality and patch-position tables."""
        LM.reset_parameters(self)  # type: ignore[arg-type]  # the attributes it uses: embed, lm_head, blocks
        for table in (self.modality_embed, self.patch_row, self.patch_col):
            nn.init.normal_(table.weight, std=self.cfg.init_std)

    def embed_inputs(self, input_ids: Tensor, modality: Tensor, patch_pos: Tensor) -> Tensor:
        """Token + modality embeddings, plus row and column embeddings on image patches: [B, T, D].
        Row gathers (index_select) as in the decoder: no host sync in their CUDA backward."""
        B, T = input_ids.shape

        def rows(table: nn.Embedding, idx: Tensor) -> Tensor:
            return table.weight.index_select(0, idx.reshape(-1)).view(B, T, -1)

        x = rows(self.embed, input_ids) + rows(self.modality_embed, modality)
        is_patch = (patch_pos[..., 0] >= 0).unsqueeze(-1)  # [B, T, 1]
        grid = patch_pos.clamp_min(0)
        pos = rows(self.patch_row, grid[..., 0]) + rows(self.patch_col, grid[..., 1])
        return x + pos * is_patch.to(pos.dtype)

    def forward(self, input_ids: Tensor, modality: Tensor | None = None, patch_pos: Tensor | None = None,
                attention_mask: Tensor | None = None, targets: Tensor | None = None, loss_mask: Tensor | None = None,
                return_routing: bool = False, return_logits: bool = True) -> EncoderOutput:
        """input_ids/modality/attention_mask/targets/loss_mask [B, T]; patch_pos [B, T, 2] (grid row and
        column of image patches, -1 elsewhere). Defaults: text everywhere, no patches, no padding, and
        the loss over every real position. ``loss`` = mean cross-entropy over ``loss_mask`` (fp32);
        ``return_logits=False`` with targets: the head and the loss in row chunks, no logits (as
        :meth:`mhmoe.model.lm.LM.forward`)."""
        if input_ids.dim() != 2:
            raise ValueError(f"invalid input_ids shape {tuple(input_ids.shape)}: allowed [B, T]")
        B, T = input_ids.shape
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds model.max_seq_len={self.cfg.max_seq_len}")
        if modality is None:
            modality = torch.zeros_like(input_ids)
        if patch_pos is None:
            patch_pos = torch.full((B, T, 2), -1, dtype=torch.long, device=input_ids.device)
        x = self.embed_inputs(input_ids, modality, patch_pos)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x, aux, routing, outputs = run_blocks(self.blocks, x, cos, sin, attention_mask, key_mask=attention_mask,
                                              return_routing=return_routing)
        h, layers = self.norm(x), outputs if return_routing else None
        keep = loss_mask if loss_mask is not None else attention_mask
        if targets is not None and not return_logits and use_chunks(h, self.cfg.vocab_size):
            return EncoderOutput(None, chunked_token_loss(h, self.lm_head.weight, targets, keep), aux, routing, layers)
        logits = self.lm_head(h)
        loss = None if targets is None else token_loss(logits, targets, keep)
        return EncoderOutput(logits, loss, aux, routing, layers)

    @torch.no_grad()
    def balance_step(self, routing: list[RoutingStats], apply: Tensor | None = None) -> None:
        """Aux-loss-free balancing, as :meth:`mhmoe.model.lm.LM.balance_step`."""
        LM.balance_step(self, routing, apply)  # type: ignore[arg-type]

    def num_params(self, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed.weight.numel() if exclude_embeddings else n
