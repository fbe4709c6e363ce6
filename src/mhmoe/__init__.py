"""mhmoe: Multi-Head Mixture-of-Experts layers, parity planner and language models.

    import mhmoe
    cfg = mhmoe.get_preset("tiny-mh3").model           # a ModelConfig (vocab_size from the tokenizer)
    model = mhmoe.LM(cfg)                              # or mhmoe.LM.from_pretrained("runs/mh3")
    model.save_pretrained("saved/mh3")                 # config.json + model.safetensors
    lm = mhmoe.load("runs/mh3")                        # model + tokenizer of a run / checkpoint / saved dir
    print(lm.generate("In the beginning", max_new_tokens=20))

Layers, bottom up (each imports only the ones below it; docs/ARCHITECTURE.md):
``config`` (dataclasses, planner, presets) -> ``checkpoint`` (the files) -> ``quant`` -> ``moe`` (layers, routers,
dispatch) -> ``model`` / ``data`` -> ``loading`` (``mhmoe.load``) -> ``train`` -> ``parallel`` -> ``research`` /
``integrations`` -> ``cli``.

The names below are loaded on first use, so ``import mhmoe.config`` (pure Python) does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mhmoe.runtime.lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "mhmoe.errors": ("CheckpointError", "ConfigError", "DataError"),
    "mhmoe.config": ("DataConfig", "ModelConfig", "MoEConfig", "Plan", "RunConfig", "TrainConfig", "count_layer",
                     "get_preset", "plan", "preset_names"),
    "mhmoe.moe": ("DenseFFN", "DenseLayer", "FFNOutput", "GroupedExperts", "MHMoELayer", "MoELayer", "RouterOutput",
                  "RoutingStats", "SharedExperts", "build_ffn_layer", "build_router", "entropy_loss",
                  "load_balancing_loss", "router_z_loss"),
    "mhmoe.model": ("LM", "Encoder", "EncoderOutput", "LMOutput", "build_model", "generate"),
    "mhmoe.data": ("Tokenizer", "load_tokenizer"),
    "mhmoe.loading.pretrained": ("Pretrained", "load"),
    "mhmoe.loading.checkpoint": ("load_latest",),
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)

if TYPE_CHECKING:  # static analysers see the real names
    from mhmoe.config import (
        DataConfig,
        ModelConfig,
        MoEConfig,
        Plan,
        RunConfig,
        TrainConfig,
        count_layer,
        get_preset,
        plan,
        preset_names,
    )
    from mhmoe.data import Tokenizer, load_tokenizer
    from mhmoe.errors import CheckpointError, ConfigError, DataError
    from mhmoe.loading.checkpoint import load_latest
    from mhmoe.loading.pretrained import Pretrained, load
    from mhmoe.model import LM, Encoder, EncoderOutput, LMOutput, build_model, generate
    from mhmoe.moe import (
        DenseFFN,
        DenseLayer,
        FFNOutput,
        GroupedExperts,
        MHMoELayer,
        MoELayer,
        RouterOutput,
        RoutingStats,
        SharedExperts,
        build_ffn_layer,
        build_router,
        entropy_loss,
        load_balancing_loss,
        router_z_loss,
    )
