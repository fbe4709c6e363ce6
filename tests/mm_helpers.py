"""Masked multi-modal test runs: a tiny encoder on scikit-learn's digits (4x4 patches, 64-code codebook,
fit in < 1 s) with a generated text corpus, byte tokenizer."""

from pathlib import Path

from helpers import write_corpus

from mhmoe.config.data import DataConfig
from mhmoe.config.model import ModelConfig
from mhmoe.config.moe import MoEConfig
from mhmoe.config.run import RunConfig
from mhmoe.config.train import TrainConfig

DIGITS_SEQ = 16 + 8 + 3  # 4x4 patches + text_len 8 + [CLS] [SEP] [SEP]
XMOE_MH = MoEConfig(n_experts=4, top_k=2, d_expert=32, heads=2, head_layer=True, merge_layer=True, router="xmoe",
                    ffn="relu")


def mm_run(tmp_path: Path, moe: MoEConfig = XMOE_MH, **train_kw) -> RunConfig:
    corpus = tmp_path / "corpus"
    if not corpus.exists():
        write_corpus(corpus, n_docs=20)
    t = dict(max_steps=6, batch_size=6, seq_len=DIGITS_SEQ, log_every=1, eval_batches=3, warmup_steps=2, lr=2e-3,
             schedule="cosine", weight_decay=0.05, dtype="float32", device="cpu", threads=1)
    t.update(train_kw)
    return RunConfig(
        name="mm-test",
        model=ModelConfig(arch="encoder", vocab_size=0, d_model=48, n_layers=2, n_heads=4, d_ff=64, max_seq_len=32,
                          moe=moe),
        train=TrainConfig(**t),
        data=DataConfig(task="masked_mm", corpus=str(corpus), tokenizer="byte", image_set="digits", text_len=8,
                        val_sets=(), val_tokens=512, cache_dir=str(tmp_path / "cache")),
    )
