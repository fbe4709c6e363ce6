"""The decoder language model (:mod:`.lm`) and KV-cache sampling (:mod:`.generate`)."""

from mhmoe.model.generate import filter_logits, generate
from mhmoe.model.lm import LM, KVCache, LMOutput

__all__ = ["LM", "KVCache", "LMOutput", "filter_logits", "generate"]
