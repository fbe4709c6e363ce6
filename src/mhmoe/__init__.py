"""mhmoe: Multi-Head Mixture-of-Experts layers, parity planner and language models.

Layers, bottom up (each imports only the ones below it; docs/ARCHITECTURE.md):
``config`` (dataclasses, planner, presets) -> ``quant`` -> ``moe`` (layers, routers, dispatch) ->
``model`` / ``data`` -> ``train`` -> ``parallel`` -> ``research`` / ``integrations`` -> ``cli``.
"""

from mhmoe.config.moe import MoEConfig
from mhmoe.config.planner import Plan, count_layer, plan
from mhmoe.errors import CheckpointError, ConfigError, DataError
from mhmoe.moe.experts import DenseFFN, GroupedExperts, SharedExperts
from mhmoe.moe.layers import DenseLayer, FFNOutput, MHMoELayer, MoELayer, RoutingStats, build_ffn_layer
from mhmoe.moe.losses import entropy_loss, load_balancing_loss, router_z_loss
from mhmoe.moe.routers import RouterOutput, build_router

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "ConfigError", "DataError", "DenseFFN", "DenseLayer", "FFNOutput", "GroupedExperts",
    "MHMoELayer", "MoEConfig", "MoELayer", "Plan", "RouterOutput", "RoutingStats", "SharedExperts",
    "build_ffn_layer", "build_router", "count_layer", "entropy_loss", "load_balancing_loss", "plan",
    "router_z_loss",
]
