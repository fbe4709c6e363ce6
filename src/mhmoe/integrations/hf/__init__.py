"""Hugging Face ``transformers`` integration (optional extra: ``pip install 'mhmoe[hf]'``).

Importing this package registers ``model_type = "mhmoe"`` with ``AutoConfig`` and
``AutoModelForCausalLM`` (the only global state; :func:`register` is idempotent)::

    import mhmoe.integrations.hf
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("exported/")      # written by `mhmoe export --hf`
    tok = AutoTokenizer.from_pretrained("exported/")
"""

from __future__ import annotations

from mhmoe.integrations.hf.configuration_mhmoe import MHMoEConfig
from mhmoe.integrations.hf.modeling_mhmoe import CacheView, MHMoECausalLMOutput, MHMoEForCausalLM, MHMoESamplingFilter
from mhmoe.integrations.hf.tokenization import to_hf_tokenizer


def register() -> None:
    """Register MHMoEConfig / MHMoEForCausalLM with the transformers Auto classes (idempotent)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoConfig.register(MHMoEConfig.model_type, MHMoEConfig, exist_ok=True)
    AutoModelForCausalLM.register(MHMoEConfig, MHMoEForCausalLM, exist_ok=True)


register()

__all__ = ["CacheView", "MHMoECausalLMOutput", "MHMoEConfig", "MHMoEForCausalLM", "MHMoESamplingFilter",
           "register", "to_hf_tokenizer"]
