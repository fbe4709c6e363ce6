"""The decoder language model (:mod:`.lm`), KV-cache sampling (:mod:`.generate`) and saving / loading its
weights (:mod:`.pretrained`)."""

from mhmoe.model.generate import filter_logits, generate
from mhmoe.model.lm import LM, KVCache, LMOutput
from mhmoe.model.pretrained import find_pretrained

__all__ = ["LM", "KVCache", "LMOutput", "filter_logits", "find_pretrained", "generate"]
