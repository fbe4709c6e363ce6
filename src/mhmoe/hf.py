"""Deprecated location: use :mod:`mhmoe.integrations.hf` (this alias re-exports its public names and,
like it, registers ``model_type = "mhmoe"`` with the transformers Auto classes; it warns once)."""

from __future__ import annotations

import warnings

from mhmoe.integrations.hf import (
    CacheView,
    MHMoECausalLMOutput,
    MHMoEConfig,
    MHMoEForCausalLM,
    MHMoESamplingFilter,
    register,
    to_hf_tokenizer,
)

warnings.warn("mhmoe.hf moved to mhmoe.integrations.hf", DeprecationWarning, stacklevel=2)

__all__ = ["CacheView", "MHMoECausalLMOutput", "MHMoEConfig", "MHMoEForCausalLM", "MHMoESamplingFilter",
           "register", "to_hf_tokenizer"]
