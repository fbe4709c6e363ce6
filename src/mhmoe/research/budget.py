"""A suite's token budget from a wall-clock budget: ``mhmoe reproduce SUITE --minutes M``.

The throughput of the same models differs by orders of magnitude between a laptop CPU and an H100, so a
fixed token count is either too small for the GPU or too large for the CPU. ``--minutes`` instead
**measures**, on the machine and device the suite will run on, what each row's run will cost: a few
training steps of the freshly initialised model timed round-robin in one process
(:func:`mhmoe.research.throughput.round_robin`), one evaluation on the run's validation sets, one
checkpoint save and the run's start-up (data and model). Every run then gets the same number of tokens
``T``, the most for which the whole suite fits in the budget:

    calibration + sum over rows of seeds(row) * (start-up + T / tokens_per_s + evals(T) * eval_s
                                                 + checkpoints(T) * checkpoint_s)  <=  M * 60 * (1 - reserve)

where ``evals(T)`` and ``checkpoints(T)`` count the evaluations (periodic and final) and checkpoints of a
run of ``T`` tokens under the suite's schedule, and ``reserve`` (default 5%) is left for the process start
and the report. The result is written to ``OUT/budget.json`` and reused while the minutes, seeds, rows and
device are unchanged, so an interrupted suite resumes with the same runs (a new calibration would give
other step counts, hence other runs). The budget assumes one process trains the suite's runs one after
another; with several processes in parallel, give ``--tokens`` instead.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mhmoe.config.run import RunConfig
from mhmoe.errors import ConfigError
from mhmoe.runtime.files import atomic_write, make_dirs
from mhmoe.runtime.reading import read_json, regular_or_missing

RESERVE = 0.05  # of the wall-clock budget, for the process start and the final report
CALIBRATION_ROUNDS = 3  # timed steps per row (after WARMUP untimed ones)
EVAL_SAMPLE_BATCHES = 2  # evaluation batches timed per validation set (the cost is linear in batches)
WARMUP = 2  # untimed steps per row: allocations, optimizer state, CUDA kernels' first launch / autotuning


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def calibrate(runs: dict[str, RunConfig], rounds: int = CALIBRATION_ROUNDS,
              scratch: Path | None = None) -> dict[str, dict[str, float]]:
    """What each row's run costs on its device, dtype and threads: ``tokens_per_s`` (the median of
    ``rounds`` training steps timed round-robin after :data:`WARMUP` untimed rounds), ``eval_s`` (one
    evaluation of ``train.eval_batches`` batches per validation set, scaled from
    :data:`EVAL_SAMPLE_BATCHES` timed ones after an untimed one), ``checkpoint_s`` (one checkpoint save,
    into a temporary directory under ``scratch``), ``setup_s`` (data and model, data cached) and
    ``train_tokens`` (the training corpus's tokens; None for a masked multi-modal run)."""
    import torch

    from mhmoe.checkpoint.write import save_checkpoint
    from mhmoe.data import train_tokens as count_tokens
    from mhmoe.model import build_model
    from mhmoe.research.throughput import round_robin, training_step
    from mhmoe.runtime.device import resolve_device
    from mhmoe.train.objectives import build_objective

    old_threads = torch.get_num_threads()
    steps, tokens, out, prepared = {}, {}, {}, set()
    tmp = Path(tempfile.mkdtemp(prefix=".calibration-", dir=scratch))
    try:
        for label, run in runs.items():
            if run.train.threads:
                torch.set_num_threads(run.train.threads)
            device = resolve_device(run.train.device)
            if repr(run.data) not in prepared:  # the first build prepares and caches the data; a run pays the next
                build_objective(run)
                prepared.add(repr(run.data))
            torch.manual_seed(run.train.seed)
            (objective, model), setup_s = _timed(lambda run=run, device=device: (
                build_objective(run), build_model(run.model).to(device)))
            steps[label] = training_step(run, model, objective, device)
            tokens[label] = run.train.batch_size * run.train.seq_len * run.train.grad_accum
            sample = min(EVAL_SAMPLE_BATCHES, run.train.eval_batches)
            objective.evaluate(model, max_batches=1, device=device, dtype=run.train.dtype)  # untimed: first calls
            _, sample_s = _timed(lambda run=run, model=model, objective=objective, device=device, sample=sample:
                                 objective.evaluate(model, max_batches=sample, device=device, dtype=run.train.dtype))
            full, timed = objective.eval_size(run.train.eval_batches), objective.eval_size(sample)
            eval_s = sample_s * full / max(1, timed)
            moments = {"exp_avg": [torch.zeros_like(p) for p in model.parameters()],
                       "exp_avg_sq": [torch.zeros_like(p) for p in model.parameters()]}  # AdamW's state, in size
            _, ckpt_s = _timed(lambda run=run, model=model, objective=objective, moments=moments: save_checkpoint(
                tmp / str(len(out)), 1, model, run, objective.tokenizer, {"optimizer": moments}, keep_last=1))
            train_tokens = count_tokens(objective.data) if run.data.task == "lm" else None
            out[label] = {"setup_s": setup_s, "eval_s": eval_s, "checkpoint_s": ckpt_s, "train_tokens": train_tokens}
        median = round_robin(steps, rounds=rounds, warmup=WARMUP)
    finally:
        torch.set_num_threads(old_threads)
        shutil.rmtree(tmp, ignore_errors=True)
    # one timed step is one micro-batch; a run's step is grad_accum of them
    for label, run in runs.items():
        out[label]["tokens_per_s"] = tokens[label] / (median[label] * run.train.grad_accum)
    return out


def run_seconds(cost: dict[str, float], run: RunConfig) -> float:
    """Predicted wall seconds of ``run`` (its resolved schedule) from its row's calibrated ``cost``."""
    cfg = run.train
    steps = cfg.max_steps
    evals = (len(range(cfg.eval_every, steps, cfg.eval_every)) if cfg.eval_every else 0) + 1  # periodic + final
    ckpts = (len(range(cfg.ckpt_every, steps, cfg.ckpt_every)) if cfg.ckpt_every else 0) + 1
    return (cost["setup_s"] + steps * cfg.tokens_per_step / cost["tokens_per_s"] + evals * cost["eval_s"]
            + ckpts * cost["checkpoint_s"])


def tokens_for_minutes(minutes: float, seeds: dict[str, int], costs: dict[str, dict[str, float]],
                       resolve: Callable[[str, int], RunConfig], spent_s: float = 0.0,
                       reserve: float = RESERVE) -> int:
    """The largest per-run token count ``T`` for which every row x seed fits in ``minutes`` (module
    docstring), ``spent_s`` (the calibration) included; ``resolve(label, T)`` is the row's run at ``T``
    tokens. 0 when not even one step per run fits."""
    limit = minutes * 60 * (1 - reserve) - spent_s

    def total(t: int) -> float:
        return sum(n * run_seconds(costs[label], resolve(label, t)) for label, n in seeds.items())

    step = max(resolve(label, 1).train.tokens_per_step for label in seeds)
    if total(step) > limit:
        return 0
    lo, hi = 1, 2  # in steps: lo fits, hi does not
    while total(hi * step) <= limit:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if total(mid * step) <= limit else (lo, mid)
    return lo * step


def suite_budget(out: Path, suite: str, runs: dict[str, RunConfig], seeds: dict[str, int], minutes: float,
                 resolve: Callable[[str, int], RunConfig], may_calibrate: bool = True) -> dict[str, Any]:
    """The suite's budget: ``OUT/budget.json`` when it was made for the same minutes, seeds, rows and
    device, else a new calibration (written there; with ``may_calibrate=False`` a one-line refusal instead). Refuses a
    budget too small for one step per run."""
    if not minutes > 0:
        raise ConfigError("--minutes", minutes, "a number of minutes > 0")
    from mhmoe.runtime.device import resolve_device

    devices = sorted({resolve_device(run.train.device).type for run in runs.values()})
    key = {"suite": suite, "minutes": minutes, "seeds": seeds, "rows": list(runs), "device": devices}
    path = out / "budget.json"
    if regular_or_missing(path):  # a symlink, a FIFO, a directory: one line naming it
        saved = read_json(path, follow=False, what="budget.json")
        if isinstance(saved, dict) and {k: saved.get(k) for k in key} == key:
            return saved
    if not may_calibrate:
        raise ConfigError("--minutes", minutes, f"the minutes of a budget in {path}",
                          hint="--status calibrates nothing, and there is no budget for these minutes;")
    make_dirs(out)
    costs, calibration_s = _timed(lambda: calibrate(runs, scratch=out))
    tokens = tokens_for_minutes(minutes, seeds, costs, resolve, spent_s=calibration_s)
    if tokens == 0:
        one = sum(n * run_seconds(costs[label], resolve(label, 1)) for label, n in seeds.items())
        need = math.ceil((calibration_s + one) / 60 / (1 - RESERVE) * 10) / 10
        raise ConfigError("--minutes", minutes, f"at least about {need:g} minutes on this machine (calibration "
                          f"{calibration_s:.0f} s, then one step, evaluation and checkpoint per run)")
    predicted = sum(n * run_seconds(costs[label], resolve(label, tokens)) for label, n in seeds.items())
    budget = {**key, "reserve": RESERVE, "tokens_per_run": tokens,
              "calibrated_tokens_per_s": {k: round(v["tokens_per_s"], 1) for k, v in costs.items()},
              "calibrated_costs_s": {k: {n: round(v[n], 3) for n in ("setup_s", "eval_s", "checkpoint_s")}
                                     for k, v in costs.items()},
              "train_tokens": next((v["train_tokens"] for v in costs.values() if v["train_tokens"]), None),
              "calibration_s": round(calibration_s, 1),
              "predicted_minutes": round((calibration_s + predicted) / 60, 2),
              "predicted_train_minutes": round(sum(n * tokens / costs[k]["tokens_per_s"] for k, n in seeds.items())
                                               / 60, 2)}
    atomic_write(path, json.dumps(budget, indent=1, ensure_ascii=False) + "\n")
    return budget
