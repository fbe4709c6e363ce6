"""The MoE layer library: FFN layers (dense, sparse MoE, Multi-Head MoE), routers, auxiliary losses,
experts, capacity, the per-expert loop oracle and the dispatch paths.

Shape legend (every module here): B batch, T time, D model width, H heads, S = B*T*H routed
sub-tokens, E experts, K top-k, F expert hidden width, N valid (sub-token, slot) pairs.

Modules, bottom up: :mod:`.routers` (router -> typed :class:`RouterOutput`), :mod:`.losses` (pure
functions), :mod:`.experts` (stacked expert weights), :mod:`.capacity`, :mod:`.reference` (the oracle),
:mod:`.dispatch` (one module per execution path), :mod:`.layers` (the layers users build).
"""

from mhmoe.moe.experts import DenseFFN, GroupedExperts, SharedExperts
from mhmoe.moe.layers import DenseLayer, FFNOutput, MHMoELayer, MoELayer, RoutingStats, build_ffn_layer
from mhmoe.moe.losses import entropy_loss, load_balancing_loss, router_z_loss
from mhmoe.moe.reference import loop_moe
from mhmoe.moe.routers import RouterOutput, build_router

__all__ = [
    "DenseFFN", "DenseLayer", "FFNOutput", "GroupedExperts", "MHMoELayer", "MoELayer", "RouterOutput",
    "RoutingStats", "SharedExperts", "build_ffn_layer", "build_router", "entropy_loss", "load_balancing_loss",
    "loop_moe", "router_z_loss",
]
