"""The decoder language model (:mod:`.lm`), KV-cache sampling (:mod:`.generate`), saving / loading its
weights (:mod:`.pretrained`) and the bidirectional masked-data encoder (:mod:`.encoder`); :func:`build_model`
builds the one ``ModelConfig.arch`` names."""

from mhmoe.config.model import ModelConfig
from mhmoe.model.encoder import Encoder, EncoderOutput
from mhmoe.model.generate import filter_logits, generate
from mhmoe.model.lm import LM, KVCache, LMOutput
from mhmoe.model.pretrained import find_pretrained


def build_model(cfg: ModelConfig) -> LM | Encoder:
    """``cfg.arch``: ``decoder`` -> :class:`LM` (causal), ``encoder`` -> :class:`Encoder` (bidirectional)."""
    return Encoder(cfg) if cfg.arch == "encoder" else LM(cfg)


__all__ = ["LM", "Encoder", "EncoderOutput", "KVCache", "LMOutput", "build_model", "filter_logits", "find_pretrained",
           "generate"]
