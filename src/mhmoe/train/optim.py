"""Optimizer and schedules: AdamW with decayed and undecayed groups, linear warm-up then
linear/cosine/constant decay, and the two-stage (BitNet) lr and weight-decay schedule. All schedules
are pure functions of the optimizer step, so a resumed run applies exactly what an uninterrupted one would."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from mhmoe.config.train import TrainConfig


def in_stage2(cfg: TrainConfig, step: int) -> bool:
    """Two-stage schedule: optimizer step ``step`` (0-based) is in the second half of the run."""
    return step >= cfg.max_steps // 2


def lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    """Multiplier of the peak lr at optimizer step s: linear warm-up, then linear/cosine decay;
    times ``lr_stage2_ratio`` from the halfway point (two-stage schedule, 1.0 = off)."""
    def base(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        t = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
        decay = 1 - t if cfg.schedule == "linear" else 0.5 * (1 + math.cos(math.pi * t))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * decay

    def f(step: int) -> float:
        return base(step) * (cfg.lr_stage2_ratio if in_stage2(cfg, step) else 1.0)
    return f


def weight_decay_at(cfg: TrainConfig, step: int) -> float:
    """Weight decay of the matrices at optimizer step ``step``: ``wd_stage2`` from the halfway point
    when set (BitNet: 0.1 -> 0), else ``weight_decay``. A pure function of the step, so a resumed
    run applies the same decay as an uninterrupted one."""
    if cfg.wd_stage2 is not None and in_stage2(cfg, step):
        return cfg.wd_stage2
    return cfg.weight_decay


def build_optimizer(model: nn.Module, cfg: TrainConfig, fused: bool = False) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices (dim >= 2), none on norms (including the [E, F] per-expert
    sub-norms of quantized experts), biases and router temperatures. Group 0 is the decayed one."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 and not name.endswith("sub_norm") else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused or None)
