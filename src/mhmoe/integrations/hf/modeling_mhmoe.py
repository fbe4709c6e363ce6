"""``MHMoEForCausalLM``: our :class:`mhmoe.model.LM` as a Hugging Face ``PreTrainedModel``.

The module wraps the model (``self.model`` is an :class:`~mhmoe.model.LM`; nothing is reimplemented),
so weights, routing and BitNet b1.58 fake quantization are exactly those of training. It adds:

- the ``transformers`` calling convention: ``forward(input_ids, attention_mask, cache, labels,
  use_cache)`` -> :class:`MHMoECausalLMOutput` (``loss`` = shifted LM cross-entropy + the router
  auxiliary loss when ``labels`` are given; ``aux_loss`` separately). The KV cache is read under
  either name transformers has used for it (``cache`` from 5.24 on, ``past_key_values`` before) and
  returned in the output field the installed version declares (:data:`CACHE_FIELD`);
- KV-cache generation through ``GenerationMixin.generate``: the transformers ``Cache``
  (a ``DynamicCache`` by default) is seen by our attention through :class:`CacheView`;
- left-padded batches: ``attention_mask`` zeros become padding keys no query attends to, and pad
  tokens are excluded from routing. RoPE depends only on relative positions, so a row's padding
  offset does not change its logits (up to float rounding of the masked attention path);
- transformers' activation checkpointing switch (``gradient_checkpointing_enable()``, the Trainer's
  ``gradient_checkpointing=True``), which recomputes every block as ``train.activation_checkpointing=blocks``.

Sampling with ``generate(do_sample=True, temperature=t, top_k=k)`` draws the same tokens as
:func:`mhmoe.model.generate.generate` seeded with the same seed (both call ``torch.multinomial`` once per
step on bit-identical probabilities; transformers uses the global generator, so seed it with
``torch.manual_seed(seed)``). transformers' top-p warper cuts the nucleus with a different (but
mathematically equivalent except at exact ties) rule than :func:`mhmoe.model.generate.filter_logits`, and
custom processors run after transformers' temperature warper; for our exact step pass
``logits_processor=[MHMoESamplingFilter(t, k, p)]`` with ``temperature=1.0, top_k=0, top_p=1.0``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import DynamicCache, GenerationMixin, LogitsProcessor, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from mhmoe.integrations.hf.configuration_mhmoe import MHMoEConfig
from mhmoe.model.generate import filter_logits
from mhmoe.model.lm import LM, Block, rope_tables
from mhmoe.model.recompute import set_activation_checkpointing

#: the output field that holds the KV cache in the installed transformers ("cache" from 5.24 on)
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def output_cache(out: CausalLMOutputWithPast) -> Cache | None:
    """The KV cache of a model output, whichever transformers version made it."""
    return getattr(out, CACHE_FIELD)


@dataclass
class MHMoECausalLMOutput(CausalLMOutputWithPast):
    """``CausalLMOutputWithPast`` plus ``aux_loss`` (summed weighted router losses, 0-dim fp32)."""

    aux_loss: Tensor | None = None


class CacheView:
    """Our attention's cache protocol (``length``, ``layer_length``, ``update``) over a transformers
    ``Cache``; k, v [B, NH, T, HD] as in :class:`mhmoe.model.KVCache`."""

    def __init__(self, cache: Cache) -> None:
        self.cache = cache

    @property
    def length(self) -> int:
        return int(self.cache.get_seq_length())

    def layer_length(self, layer: int) -> int:
        return int(self.cache.get_seq_length(layer))

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return self.cache.update(k, v, layer)


class MHMoESamplingFilter(LogitsProcessor):
    """Our temperature + top-k + nucleus step (:func:`mhmoe.model.generate.filter_logits` on logits / t) as a
    transformers logits processor; use it with ``temperature=1.0, top_k=0, top_p=1.0`` so that no
    transformers warper runs before or after it (custom processors run after the built-in ones)."""

    def __init__(self, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> None:
        if temperature <= 0:
            raise ValueError(f"invalid temperature={temperature}: allowed > 0 (greedy: do_sample=False)")
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        """scores [B, V] -> filtered scores [B, V] (-inf outside the kept set)."""
        return filter_logits(scores / self.temperature, self.top_k, self.top_p)


class MHMoEPreTrainedModel(PreTrainedModel):
    config_class = MHMoEConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    _supports_cache_class = True
    supports_gradient_checkpointing = True
    gradient_checkpointing = False  # what transformers' is_gradient_checkpointing reads

    def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func: Any = None,
                                    every_n_layers: int = 1, **kwargs: Any) -> None:
        """transformers' activation checkpointing (``model.gradient_checkpointing_enable()``,
        ``TrainingArguments(gradient_checkpointing=True)``) as mhmoe's: every ``every_n_layers``-th block runs again
        in the backward (:mod:`mhmoe.model.recompute`: non-reentrant ``torch.utils.checkpoint`` in a training
        forward without a KV cache; the checkpoint function and arguments transformers passes are not used)."""
        self.gradient_checkpointing = enable
        set_activation_checkpointing(self, "none")
        for i, block in enumerate(m for m in self.modules() if isinstance(m, Block)):
            if enable and i % every_n_layers == 0:
                block.recompute = "block"

    def _init_weights(self, module: torch.nn.Module) -> None:
        """Weights are initialised by :class:`~mhmoe.model.LM` itself (or loaded); only the
        non-persistent RoPE tables need recomputing after a meta-device construction."""
        if isinstance(module, LM):
            cfg = module.cfg
            cos, sin = rope_tables(cfg.max_seq_len, cfg.d_model // cfg.n_heads, cfg.rope_theta)
            with torch.no_grad():
                module.rope_cos.copy_(cos)
                module.rope_sin.copy_(sin)


class MHMoEForCausalLM(MHMoEPreTrainedModel, GenerationMixin):
    """Hugging Face causal LM around :class:`mhmoe.model.LM` (``self.model``)."""

    def __init__(self, config: MHMoEConfig) -> None:
        super().__init__(config)
        mcfg = config.model_config()
        self.model = LM(mcfg)
        # transformers >= 5 takes a {target: source} dict of tied checkpoint keys
        self._tied_weights_keys = {"model.lm_head.weight": "model.embed.weight"} if mcfg.tie_embeddings else {}
        self.post_init()

    @classmethod
    def from_lm(cls, lm: LM, eos_token_id: int | None = None) -> MHMoEForCausalLM:
        """Wrap a trained :class:`~mhmoe.model.LM` (its weights are copied, the original is untouched)."""
        model = cls(MHMoEConfig(mhmoe=lm.cfg.to_dict(), eos_token_id=eos_token_id))
        missing, unexpected = model.model.load_state_dict(lm.state_dict(), strict=False)
        if [m for m in missing if not m.startswith("rope_")] or unexpected:
            raise ValueError(f"weights do not match the config (missing {missing[:3]}, unexpected {unexpected[:3]})")
        return model.eval()

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embed

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.model.lm_head

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                cache: Cache | None = None, labels: Tensor | None = None, use_cache: bool | None = None,
                inputs_embeds: Tensor | None = None, return_dict: bool | None = None,
                past_key_values: Cache | None = None, **kwargs: Any) -> MHMoECausalLMOutput:
        """input_ids [B, T]; attention_mask [B, T_past + T] (1 = token, 0 = padding); ``cache`` (or its
        older name ``past_key_values``): a transformers ``Cache``; labels [B, T] (-100 = ignore; shifted
        inside, as in transformers) -> logits [B, T, V]."""
        if inputs_embeds is not None or input_ids is None:
            raise ValueError("MHMoEForCausalLM takes input_ids (inputs_embeds are not supported)")
        if cache is not None and past_key_values is not None and cache is not past_key_values:
            raise ValueError("pass the KV cache once: as cache= or as past_key_values=, not both")
        cache = cache if cache is not None else past_key_values
        if use_cache is None:
            use_cache = bool(getattr(self.config, "use_cache", True)) and not self.training
        if use_cache and cache is None:
            cache = DynamicCache()
        view = CacheView(cache) if use_cache and cache is not None else None
        key_mask = ffn_mask = None
        T = input_ids.shape[1]
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            past = view.length if view is not None else 0
            if attention_mask.shape != (input_ids.shape[0], past + T):
                raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)}: expected "
                                 f"[{input_ids.shape[0]}, {past + T}] (cached + new positions)")
            key_mask = attention_mask.bool()
            ffn_mask = key_mask[:, -T:]
        targets = None
        if labels is not None:
            targets = F.pad(labels[:, 1:], (0, 1), value=-100)  # padded inputs are ignored by the LM itself
        out = self.model(input_ids, targets, mask=ffn_mask, cache=view, key_mask=key_mask)
        loss = None if out.loss is None else out.loss + out.aux_loss
        return MHMoECausalLMOutput(loss=loss, logits=out.logits, aux_loss=out.aux_loss,
                                   **{CACHE_FIELD: cache if use_cache else None})
