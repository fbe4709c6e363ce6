"""Tiny models and checkpoints for the transformers / lm-eval integration tests."""

from __future__ import annotations

from pathlib import Path

import torch

from mhmoe.checkpoint.write import save_checkpoint
from mhmoe.config.data import DataConfig
from mhmoe.config.model import ModelConfig
from mhmoe.config.moe import MoEConfig
from mhmoe.config.run import RunConfig
from mhmoe.config.train import TrainConfig
from mhmoe.data import ByteTokenizer
from mhmoe.model.lm import LM

TINY = dict(vocab_size=257, d_model=32, n_layers=2, n_heads=2, d_ff=48, moe_every=1, max_seq_len=64)
MOE = {
    "dense": MoEConfig(kind="dense", d_expert=48),
    "smoe": MoEConfig(n_experts=4, top_k=1, d_expert=32),
    "mhmoe": MoEConfig(n_experts=4, top_k=2, d_expert=16, heads=2, head_layer=True, merge_layer=True),
    "shared": MoEConfig(n_experts=4, top_k=2, d_expert=16, heads=2, head_layer=True, merge_layer=True, n_shared=1,
                        d_shared=32),
}
KINDS = (*MOE, "bitnet")


def tiny_config(kind: str | MoEConfig, **over) -> ModelConfig:
    """A 2-layer d=32 model of ``kind``: dense | smoe | mhmoe | shared | bitnet (MH-MoE, BitNet b1.58), or the FFN
    layer a MoEConfig describes."""
    if isinstance(kind, MoEConfig):
        return ModelConfig(**{**TINY, **over}, moe=kind)
    if kind == "bitnet":
        moe = MoEConfig(n_experts=4, top_k=2, d_expert=16, heads=2, head_layer=True, merge_layer=True, proj_bias=False)
        return ModelConfig(**{**TINY, **over}, moe=moe, quant="bitnet158")
    return ModelConfig(**{**TINY, **over}, moe=MOE[kind])


def trained_lm(kind: str | MoEConfig = "mhmoe", steps: int = 3, seed: int = 0, **over) -> LM:
    """A tiny model after a few AdamW steps on byte-tokenized text (so weights are not at init)."""
    torch.manual_seed(seed)
    lm = LM(tiny_config(kind, **over))
    opt = torch.optim.AdamW(lm.parameters(), lr=3e-3)
    ids = torch.tensor([list(b"In the beginning God created the heaven and the earth. " * 4)[:33]])
    for _ in range(steps):
        opt.zero_grad()
        lm(ids[:, :-1], ids[:, 1:]).total_loss.backward()
        opt.step()
    return lm.eval()


def tiny_checkpoint(run_dir: Path, kind: str | MoEConfig = "mhmoe", **over) -> Path:
    """A real training checkpoint (``save_checkpoint``) of a briefly trained tiny model (``over``: ModelConfig
    fields), byte tokenizer."""
    lm = trained_lm(kind, **over)
    run = RunConfig(name=f"tiny-{kind if isinstance(kind, str) else 'custom'}", model=lm.cfg,
                    train=TrainConfig(max_steps=3, batch_size=1, seq_len=32, dtype="float32", device="cpu"),
                    data=DataConfig(tokenizer="byte"))
    return save_checkpoint(run_dir, 3, lm, run, ByteTokenizer(), {"step": 3})
