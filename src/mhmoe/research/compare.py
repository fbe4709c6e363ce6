"""``mhmoe compare``: train and evaluate several presets the same way, then one table and one figure.

Layout (the suite directory of :mod:`mhmoe.research.report`): ``OUT/<preset>/seed<k>/`` per run, seed k
trained with ``train.seed + k``; ``OUT/results.{md,csv,json}`` and ``OUT/curves.png``. A run whose
``results.json`` exists is reused when its config matches (else a one-line error names the first
difference); a run with checkpoints but no results continues from its newest checkpoint.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from mhmoe.checkpoint.layout import RESULTS_FILE
from mhmoe.config.presets import get_preset
from mhmoe.config.run import RunConfig
from mhmoe.errors import ConfigError
from mhmoe.parallel.launch import train_parallel
from mhmoe.research.report import write_suite_report
from mhmoe.research.reproduce import _check_same_run as check_same_run
from mhmoe.research.store import no_symlink_below
from mhmoe.research.throughput import ROUNDS, describe, timed_throughput
from mhmoe.runtime.console import is_rank0
from mhmoe.runtime.files import make_dirs
from mhmoe.runtime.reading import read_json

DEFAULT_PRESETS = ("tiny-dense", "tiny-smoe", "tiny-mh3")


def compare_runs(presets: list[str], seeds: int = 1, overrides: list[str] | None = None,
                 first_seed: int = 0) -> list[tuple[str, int, RunConfig]]:
    """(preset, seed index, run config) for every preset x seed index ``first_seed`` .. ``first_seed + seeds - 1``
    (seed k: ``train.seed`` + k, after the overrides); every name and override is checked before anything trains."""
    if seeds < 1:
        raise ConfigError("--seeds", seeds, "an integer >= 1")
    if first_seed < 0:
        raise ConfigError("--first-seed", first_seed, "an integer >= 0")
    out = []
    for name in presets:
        run = get_preset(name).with_overrides(list(overrides or []))
        out += [(name, k, run.with_overrides([f"train.seed={run.train.seed + k}"]))
                for k in range(first_seed, first_seed + seeds)]
    return out


def run_compare(presets: list[str], out: str | Path, seeds: int = 1, overrides: list[str] | None = None,
                progress: bool = True, timing_rounds: int = ROUNDS, first_seed: int = 0) -> tuple[list[dict], str]:
    """Train (or reuse) every preset x seed (indices ``first_seed`` ..) into ``out``; time the final models'
    training steps round-robin (``timing_rounds`` steps each, :mod:`mhmoe.research.throughput`; 0: no timing, the
    table shows each run's average); write the suite report. Returns (runs, Markdown table with its notes)."""
    out = Path(out)
    plan = compare_runs(presets, seeds, overrides, first_seed)
    runs, t0 = [], time.perf_counter()
    for name, seed, run in plan:
        run_dir = out / name / f"seed{seed}"
        done = run_dir / RESULTS_FILE
        no_symlink_below(out, run_dir)  # a symlinked model or seed directory leads out of --out
        check_same_run(run_dir, run)
        if done.exists():
            print(f"[{name} seed {seed}] finished earlier: reusing {run_dir}", file=sys.stderr)
        else:
            print(f"[{name} seed {seed}] training {run.train.max_steps} steps x {run.train.tokens_per_step:,} tokens",
                  file=sys.stderr)
            resume = run_dir.is_dir()  # ours: continue it
            make_dirs(run_dir, root=out)  # a symlinked model or seed directory in --out is refused
            train_parallel(run, run_dir, resume=resume, progress=progress)
        if not is_rank0():  # torchrun: rank 0 reports
            continue
        results = read_json(done, follow=False, what=RESULTS_FILE)  # a FIFO, a symlink, too large: one line
        runs.append({"label": name, "seed": seed, "run_dir": str(run_dir), **results})
    if not runs:  # a torchrun rank other than 0
        return [], ""
    wall = time.perf_counter() - t0
    timing = None
    if timing_rounds > 0:
        first = {r["label"]: r["run_dir"] for r in runs if r["seed"] == first_seed}
        train_cfg = plan[0][2].train
        print(f"timing {timing_rounds} training steps of each model, round-robin", file=sys.stderr)
        timing = timed_throughput(first, timing_rounds, train_cfg.device, train_cfg.threads)
    meta = {"wall_s": wall, "seeds": seeds, "first_seed": first_seed}
    note = describe(timing) if timing else ""
    table = write_suite_report(runs, out, "compare: " + ", ".join(presets), meta, timing, note)
    return runs, table


__all__ = ["DEFAULT_PRESETS", "compare_runs", "run_compare"]
