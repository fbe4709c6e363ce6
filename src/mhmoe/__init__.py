"""mhmoe: Multi-Head Mixture-of-Experts layers, parity planner and language models.

The layer library (config, routers, losses, dispatch, experts, MoE/MH-MoE layers, planner) imports
only torch; the language-model stack (model, data, training) is importable from its modules.
"""

from mhmoe.config import MoEConfig
from mhmoe.errors import CheckpointError, ConfigError, DataError
from mhmoe.experts import DenseFFN, GroupedExperts, SharedExperts
from mhmoe.losses import entropy_loss, load_balancing_loss, router_z_loss
from mhmoe.moe import DenseLayer, FFNOutput, MHMoELayer, MoELayer, RoutingStats, build_ffn_layer
from mhmoe.planner import Plan, count_layer, plan
from mhmoe.routers import RouterOutput, build_router

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "ConfigError", "DataError", "DenseFFN", "DenseLayer", "FFNOutput", "GroupedExperts",
    "MHMoELayer", "MoEConfig", "MoELayer", "Plan", "RouterOutput", "RoutingStats", "SharedExperts",
    "build_ffn_layer", "build_router", "count_layer", "entropy_loss", "load_balancing_loss", "plan",
    "router_z_loss",
]
