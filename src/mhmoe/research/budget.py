"""A suite's token budget from a wall-clock budget: ``mhmoe reproduce SUITE --minutes M``.

The throughput of the same models differs by orders of magnitude between a laptop CPU and an H100, so a
fixed token count is either too small for the GPU or too large for the CPU. ``--minutes`` instead
**measures** every row's training throughput on the machine and device the suite will run on -- a few
training steps of each freshly initialised row model, timed round-robin in one process
(:func:`mhmoe.research.throughput.round_robin`) -- and gives every run the same number of tokens, the
most for which all rows x seeds fit in the budget:

    tokens per run = M * 60 * (1 - reserve) / sum over rows of (seeds / tokens_per_s(row))

``reserve`` (default 0.2) is left for start-up, evaluation and checkpoints. The result is written to
``OUT/budget.json`` and reused while the minutes, seeds, rows and device are unchanged, so an interrupted
suite resumes with the same runs (a new calibration would give other step counts, which the suite's
reuse check refuses).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from mhmoe.config.run import RunConfig
from mhmoe.errors import ConfigError
from mhmoe.runtime.bounded import load_json
from mhmoe.runtime.files import atomic_write, make_dirs

RESERVE = 0.2  # of the wall-clock budget, for start-up, evaluation and checkpoints
CALIBRATION_ROUNDS = 3  # timed steps per row (after WARMUP untimed ones)
WARMUP = 2  # untimed steps per row: allocations, optimizer state, CUDA kernels' first launch / autotuning


def calibrate(runs: dict[str, RunConfig], rounds: int = CALIBRATION_ROUNDS) -> dict[str, float]:
    """Training tokens/s of each row's freshly initialised model on its run's device, dtype and threads:
    the median of ``rounds`` steps timed round-robin after :data:`WARMUP` untimed rounds."""
    import torch

    from mhmoe.model import build_model
    from mhmoe.research.throughput import round_robin, training_step
    from mhmoe.runtime.device import resolve_device
    from mhmoe.train.objectives import build_objective

    old_threads = torch.get_num_threads()
    steps, tokens = {}, {}
    try:
        for label, run in runs.items():
            if run.train.threads:
                torch.set_num_threads(run.train.threads)
            device = resolve_device(run.train.device)
            torch.manual_seed(run.train.seed)
            model = build_model(run.model).to(device)
            steps[label] = training_step(run, model, build_objective(run), device)
            tokens[label] = run.train.batch_size * run.train.seq_len * run.train.grad_accum
        median = round_robin(steps, rounds=rounds, warmup=WARMUP)
    finally:
        torch.set_num_threads(old_threads)
    # one timed step is one micro-batch; a run's step is grad_accum of them
    return {label: tokens[label] / (median[label] * runs[label].train.grad_accum) for label in runs}


def tokens_for_minutes(minutes: float, seeds: int, tokens_per_s: dict[str, float], reserve: float = RESERVE) -> int:
    """The largest equal per-run token count for which every row x seed trains within ``minutes``
    (module docstring), before rounding to whole steps."""
    seconds_per_token = sum(seeds / tps for tps in tokens_per_s.values())
    return int(minutes * 60 * (1 - reserve) / seconds_per_token)


def suite_budget(out: Path, suite: str, runs: dict[str, RunConfig], seeds: int, minutes: float) -> dict[str, Any]:
    """The suite's budget: ``OUT/budget.json`` when it was made for the same minutes, seeds, rows and
    device, else a new calibration (written there). Refuses a budget too small for one step per run."""
    if not minutes > 0:
        raise ConfigError("--minutes", minutes, "a number of minutes > 0")
    from mhmoe.runtime.device import resolve_device

    devices = sorted({resolve_device(run.train.device).type for run in runs.values()})
    key = {"suite": suite, "minutes": minutes, "seeds": seeds, "rows": list(runs), "device": devices}
    path = out / "budget.json"
    if path.is_file():
        saved = load_json(path.read_text(encoding="utf-8"), str(path))
        if isinstance(saved, dict) and {k: saved.get(k) for k in key} == key:
            return saved
    tps = calibrate(runs)
    tokens = tokens_for_minutes(minutes, seeds, tps)
    step_tokens = max(run.train.tokens_per_step for run in runs.values())
    if tokens < step_tokens:
        need = math.ceil(minutes * step_tokens / max(tokens, 1))
        raise ConfigError("--minutes", minutes, f"at least about {need} minutes on this machine "
                          f"(the budget gives {tokens} tokens per run, one step is {step_tokens})")
    budget = {**key, "reserve": RESERVE, "tokens_per_run": tokens,
              "calibrated_tokens_per_s": {k: round(v, 1) for k, v in tps.items()},
              "predicted_train_minutes": round(sum(seeds * tokens / v for v in tps.values()) / 60, 2)}
    make_dirs(out)
    atomic_write(path, json.dumps(budget, indent=1, ensure_ascii=False) + "\n")
    return budget
