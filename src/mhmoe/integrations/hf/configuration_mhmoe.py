"""``MHMoEConfig``: the Hugging Face configuration of an mhmoe language model.

The full :class:`mhmoe.model.ModelConfig` travels as a nested dict (``config.mhmoe``), so every preset
(dense, SMoE, MH-MoE, shared experts, BitNet b1.58) round-trips through ``config.json`` exactly. The
usual Hugging Face field names (``vocab_size``, ``hidden_size``, ...) are derived from it for tools
that read them; ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` are the tokenizer's EOS id.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from mhmoe.config.model import ModelConfig


class MHMoEConfig(PretrainedConfig):
    """``MHMoEConfig(mhmoe=ModelConfig(...).to_dict(), eos_token_id=...)``; ``model_config()`` rebuilds
    (and validates) the :class:`~mhmoe.model.ModelConfig`."""

    model_type = "mhmoe"

    def __init__(self, mhmoe: dict[str, Any] | None = None, **kwargs: Any) -> None:
        cfg = ModelConfig.from_dict(dict(mhmoe)) if mhmoe else ModelConfig(vocab_size=257, d_model=64, n_layers=2,
                                                                           n_heads=2, d_ff=128, max_seq_len=128)
        self.mhmoe = cfg.to_dict()
        # read-only mirrors of the nested config under the names other tools look for
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                    "max_position_embeddings", "tie_word_embeddings"):
            kwargs.pop(key, None)
        self.vocab_size = cfg.vocab_size
        self.hidden_size = cfg.d_model
        self.num_hidden_layers = cfg.n_layers
        self.num_attention_heads = cfg.n_heads
        self.num_key_value_heads = cfg.kv_heads
        self.max_position_embeddings = cfg.max_seq_len
        eos = kwargs.pop("eos_token_id", None)
        kwargs.setdefault("bos_token_id", eos)
        kwargs.setdefault("pad_token_id", eos)
        super().__init__(eos_token_id=eos, tie_word_embeddings=cfg.tie_embeddings, **kwargs)

    def model_config(self) -> ModelConfig:
        """The nested :class:`~mhmoe.model.ModelConfig` (ConfigError if ``config.json`` was edited badly)."""
        return ModelConfig.from_dict(dict(self.mhmoe))
