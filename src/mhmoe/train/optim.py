"""Optimizer and schedules: AdamW with decayed and undecayed groups, linear warm-up then linear/cosine/constant
decay or warm-up-stable-decay (wsd), and the two-stage (BitNet) lr and weight-decay schedule. All schedules are pure
functions of the optimizer step, so a resumed run applies exactly what an uninterrupted one would."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from mhmoe.config.train import TrainConfig


def in_stage2(cfg: TrainConfig, step: int) -> bool:
    """Two-stage schedule: optimizer step ``step`` (0-based) is in the second half of the run."""
    return step >= cfg.max_steps // 2


def decay_start(cfg: TrainConfig) -> int:
    """The first optimizer step (0-based) of the decay: right after warm-up, or for ``wsd`` the first step of the
    cooldown, the last ``cooldown_fraction`` of ``max_steps`` (never inside the warm-up)."""
    if cfg.schedule != "wsd":
        return cfg.warmup_steps
    return max(cfg.warmup_steps, cfg.max_steps - round(cfg.cooldown_fraction * cfg.max_steps))


def _decay(shape: str, t: float) -> float:
    """From 1 at t = 0 to 0 at t = 1."""
    if shape == "linear":
        return 1 - t
    if shape == "1-sqrt":
        return 1 - math.sqrt(t)
    return 0.5 * (1 + math.cos(math.pi * t))


def lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    """Multiplier of the peak lr at optimizer step s: linear warm-up, then linear/cosine decay, constant, or
    (``wsd``) constant until :func:`decay_start` and the ``cooldown_shape`` after it; times ``lr_stage2_ratio``
    from the halfway point (two-stage schedule, 1.0 = off)."""
    start = decay_start(cfg)
    shape = cfg.cooldown_shape if cfg.schedule == "wsd" else cfg.schedule

    def base(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant" or step < start:
            return 1.0
        t = min(1.0, (step - start) / max(1, cfg.max_steps - start))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * _decay(shape, t)

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


def continue_schedule(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR,
                      cfg: TrainConfig) -> None:
    """After a checkpoint's scheduler state is loaded: every group's lr for the next step from ``cfg``'s schedule
    (a resume with another ``max_steps``, a branch with another schedule) instead of the one the checkpoint's
    schedule set; with the same schedule, the same numbers."""
    f = lr_lambda(cfg)
    for group, base in zip(optimizer.param_groups, scheduler.base_lrs, strict=True):
        group["lr"] = base * f(scheduler.last_epoch)
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]  # what get_last_lr() reports
