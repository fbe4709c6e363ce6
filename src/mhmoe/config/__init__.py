"""The configuration layer: validated dataclasses with YAML round trips, the FLOPs/parameter parity
planner and the named presets. Pure Python (no torch); every other layer builds from these.

- :class:`MoEConfig` (one FFN layer: dense, SMoE, fine-grained, MH-MoE), :class:`ModelConfig`
  (the decoder LM), :class:`DataConfig`, :class:`TrainConfig`, :class:`RunConfig` (all three + YAML,
  ``--set`` overrides);
- :func:`plan` / :func:`count_layer` (the parity planner, docs/PLANNER.md);
- :func:`get_preset` / :func:`preset_names` (``paper-*``, ``tiny-*``, ``icml-*`` presets).
"""

from mhmoe.config.data import DataConfig
from mhmoe.config.model import ModelConfig
from mhmoe.config.moe import MoEConfig
from mhmoe.config.planner import Plan, count_layer, format_plan, plan
from mhmoe.config.presets import get_preset, preset_names
from mhmoe.config.run import RunConfig
from mhmoe.config.train import TrainConfig

__all__ = [
    "DataConfig", "ModelConfig", "MoEConfig", "Plan", "RunConfig", "TrainConfig", "count_layer", "format_plan",
    "get_preset", "plan", "preset_names",
]
