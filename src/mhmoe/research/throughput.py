"""Training throughput of finished runs, timed so that models can be compared (``mhmoe compare``'s tok/s).

A run's own tokens/s (``results.json``) is its tokens over its wall time: on a shared machine it measures
the load during that run as much as the model, and runs trained one after another see different loads.
:func:`timed_throughput` instead times a few training steps of every run's final model **round-robin in
one process** (model A, B, C, A, B, C, ...), after :data:`WARMUP` untimed rounds, and reports each
model's median step: whatever load the machine has falls on all of them alike.

A timed step is what :meth:`mhmoe.train.loop.Trainer.train_step` does for one micro-batch: the objective's
batch and forward (:mod:`mhmoe.train.objectives`), backward, gradient clipping and an AdamW step, in the run's
dtype and thread count, on the run's device.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

WARMUP = 1  # untimed rounds (first-touch allocations, optimizer state)
ROUNDS = 3  # timed rounds: each model's median step over these


def training_step(run: Any, model: Any, objective: Any, device: Any) -> Callable[[], None]:
    """One training step of ``model`` (train mode) as the trainer takes it: the objective's first micro-batch,
    forward in the run's dtype, backward, gradient clipping and an AdamW step (synchronised on CUDA)."""
    import torch

    from mhmoe.runtime.device import autocast_ctx
    from mhmoe.train.optim import build_optimizer

    cfg = run.train
    model.train()
    opt = build_optimizer(model, cfg)
    batch = objective.micro_batch(0, 0, device)

    def step() -> None:
        with autocast_ctx(device, cfg.dtype):
            out = objective.forward(model, batch)
        (out.loss + out.aux_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or math.inf)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return step


def _step_fn(run_dir: Path, device: Any) -> tuple[Callable[[], None], int, str]:
    """(one training step of the run's final model, tokens per step, dtype) on ``device``."""
    import dataclasses

    from mhmoe.loading.checkpoint import load_latest
    from mhmoe.train.objectives import build_objective

    ck = load_latest(run_dir, device)
    run = dataclasses.replace(ck.run, data=dataclasses.replace(ck.run.data, cache_dir=""))
    objective = build_objective(run, tokenizer=ck.tokenizer)
    step = training_step(run, ck.model, objective, device)
    return step, run.train.batch_size * run.train.seq_len, run.train.dtype


def round_robin(steps: dict[str, Callable[[], None]], rounds: int = ROUNDS, warmup: int = WARMUP) -> dict[str, float]:
    """Median seconds per call of each step function, called round-robin (A, B, C, A, B, C, ...) after
    ``warmup`` untimed rounds, so that machine load falls on every candidate alike."""
    times: dict[str, list[float]] = {label: [] for label in steps}
    for r in range(warmup + rounds):
        for label, step in steps.items():
            t0 = time.perf_counter()
            step()
            if r >= warmup:
                times[label].append(time.perf_counter() - t0)
    return {label: statistics.median(ts) for label, ts in times.items()}


def timed_throughput(run_dirs: dict[str, Path], rounds: int = ROUNDS, device: str = "cpu",
                     threads: int = 0) -> dict[str, Any]:
    """Tokens/s of each run's final model: median of ``rounds`` training steps timed round-robin (module
    docstring). Returns ``{"rounds", "warmup", "device", "threads", "tokens_per_s": {label: float}}``."""
    import torch

    from mhmoe.runtime.device import resolve_device

    dev = resolve_device(device)
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        steps = {label: _step_fn(Path(d), dev) for label, d in run_dirs.items()}
        median = round_robin({label: fn for label, (fn, _, _) in steps.items()}, rounds)
        used = torch.get_num_threads()
    finally:
        torch.set_num_threads(old_threads)
    tps = {label: steps[label][1] / median[label] for label in steps}
    return {"rounds": rounds, "warmup": WARMUP, "device": str(dev), "threads": used, "tokens_per_s": tps}


def describe(timing: dict[str, Any]) -> str:
    """The note under a table: what the tok/s column measured, on which machine."""
    from mhmoe.runtime.cpu import cpu_info

    where = timing["device"]
    if where.startswith("cpu"):
        where = f"{cpu_info()[0]}, {timing['threads']} thread{'s' if timing['threads'] != 1 else ''}"
    return (f"train tok/s: median of {timing['rounds']} training steps of each final model, timed round-robin in "
            f"one process after training (after {timing['warmup']} untimed round), so machine load falls on "
            f"every model alike; {where}.")
