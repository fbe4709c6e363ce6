"""The outputs of a *suite directory* (``mhmoe compare``, ``mhmoe reproduce``): one table in three formats
and one curves figure, beside the run directories::

    SUITE/<model>/seed<k>/     one run directory per model and seed (config.yaml, metrics.jsonl, ...)
    SUITE/results.md           the table (Markdown; mean ± std over seeds when there are several)
    SUITE/results.csv          one line per run
    SUITE/results.json         {"title", "runs": [every run's results.json + label, seed, run_dir], "models": [...]}
    SUITE/curves.png           training loss and validation perplexity over steps, one line per model

``runs`` below are dicts: a run's ``results.json`` plus ``label``, ``seed`` and ``run_dir``.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from mhmoe.checkpoint.layout import CURVES_FILE, METRICS_FILE, RESULTS_FILE
from mhmoe.runtime.files import atomic_write
from mhmoe.train.plots import Curves, mean_curves, plot_curves, read_curves

# a suite's files: its results.json and curves.png are named as a run's
RESULTS_MD, RESULTS_CSV, RESULTS_JSON, CURVES_PNG = "results.md", "results.csv", RESULTS_FILE, CURVES_FILE
MAX_RESULTS_MD_BYTES = 16 << 20  # a suite's results.md: its tables and notes (a few KB)


def read_results_md(suite_dir: str | os.PathLike[str]) -> str:
    """``SUITE/results.md``: a regular file (not a symlink, a FIFO or a device) of at most
    :data:`MAX_RESULTS_MD_BYTES`; BoundedLoadError (one line naming it) otherwise."""
    from mhmoe.runtime.reading import read_text

    return read_text(Path(suite_dir) / RESULTS_MD, MAX_RESULTS_MD_BYTES, follow=False, what=RESULTS_MD)


def val_sets(runs: list[dict]) -> list[str]:
    """Validation sets over all runs: kjv first, then alphabetical."""
    return sorted({k for r in runs for k in r.get("eval", {})}, key=lambda s: (s != "kjv", s))


def labels_in_order(runs: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["label"] for r in runs))


def model_rows(runs: list[dict]) -> list[dict[str, Any]]:
    """One row per model (label): seeds, params, FLOPs/token, mean tokens/s and per-set perplexity mean/std."""
    rows = []
    for label in labels_in_order(runs):
        rs = [r for r in runs if r["label"] == label]
        row: dict[str, Any] = {"model": label, "seeds": len(rs), "params": rs[0]["params"],
                               "fwd_flops_per_token": rs[0]["fwd_flops_per_token"],
                               "tokens_per_s": statistics.fmean(r["tokens_per_s"] for r in rs), "ppl": {}}
        for s in val_sets(runs):
            v = [r["eval"][s]["ppl"] for r in rs if s in r.get("eval", {})]
            if v:
                row["ppl"][s] = {"mean": statistics.fmean(v), "std": statistics.stdev(v) if len(v) > 1 else None}
        rows.append(row)
    return rows


def format_ppl(cell: dict | None) -> str:
    if not cell:
        return "-"
    return f"{cell['mean']:.2f}" + (f" ± {cell['std']:.2f}" if cell.get("std") is not None else "")


RUN_AVERAGE_NOTE = ("train tok/s: each run's tokens over its training time, machine load included (runs trained at "
                    "different times on a shared machine are not comparable by it).")


def markdown_table(runs: list[dict], timed: dict[str, float] | None = None) -> str:
    """model | params | fwd FLOPs/token | ppl <set>... | train tok/s (the README's demo table). ``timed``
    (label -> tokens/s, :func:`mhmoe.research.throughput.timed_throughput`) fills the tok/s column;
    without it the column is each model's run average (:data:`RUN_AVERAGE_NOTE` says what that is)."""
    sets = val_sets(runs)
    head = ["model", "params", "fwd FLOPs/token"] + [f"ppl {s}" for s in sets] + ["train tok/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in model_rows(runs):
        tps = timed.get(row["model"]) if timed else row["tokens_per_s"]
        cells = [row["model"], f"{row['params'] / 1e6:.2f}M", f"{row['fwd_flops_per_token'] / 1e6:.2f}M"]
        cells += [format_ppl(row["ppl"].get(s)) for s in sets] + ["-" if tps is None else f"{tps:,.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_runs_csv(runs: list[dict], path: Path, suite: str = "") -> None:
    """One line per run: suite, label, seed, params, FLOPs/token, tokens/s, train seconds, ppl per set."""
    sets = val_sets(runs)
    buf = io.StringIO(newline="")
    w = csv.writer(buf)
    w.writerow(["suite", "label", "seed", "params", "fwd_flops_per_token", "tokens_per_s", "train_s"]
               + [f"ppl_{s}" for s in sets])
    for r in runs:
        w.writerow([suite, r["label"], r["seed"], r["params"], r["fwd_flops_per_token"],
                    f"{r['tokens_per_s']:.1f}", f"{r.get('train_s', 0.0):.1f}"]
                   + [f"{r['eval'][s]['ppl']:.4f}" if s in r.get("eval", {}) else "" for s in sets])
    atomic_write(path, buf.getvalue())


def write_json(runs: list[dict], path: Path, title: str, extra: dict | None = None) -> None:
    data = {"title": title, **(extra or {}), "models": model_rows(runs), "runs": runs}
    atomic_write(path, json.dumps(data, indent=2, default=str))


def run_curves(run: dict, label: str) -> Curves:
    """A run's curves: from its record's ``curve`` / ``train_curve`` when the entry has them (a reproduce
    suite; the run directory may be on another machine), else from its run directory."""
    if "curve" not in run:
        return read_curves(run["run_dir"], label)
    return record_curves(run, label)


def record_curves(run: dict, label: str) -> Curves:
    """The curves stored in a run's record entry (``curve``: evaluations, ``train_curve``: training loss)."""
    curves = Curves(label, [(int(s), float(v)) for s, v in run.get("train_curve") or []])
    for point in run.get("curve") or []:
        for s, loss in point["loss"].items():
            curves.val.setdefault(s, []).append((int(point["step"]), math.exp(float(loss))))
    return curves


def suite_curves(runs: list[dict]) -> list[Curves]:
    """One :class:`Curves` per model, averaged over its seeds."""
    return [mean_curves(label, [run_curves(r, label) for r in runs if r["label"] == label])
            for label in labels_in_order(runs)]


def plot_suite_curves(runs: list[dict], path: str | os.PathLike[str], title: str) -> Path:
    """``curves.png`` of a suite: training loss and validation perplexity, one line per model."""
    return plot_curves(suite_curves(runs), path, title)


def write_suite_report(runs: list[dict], out: str | os.PathLike[str], title: str,
                       extra: dict | None = None, timing: dict | None = None, timing_note: str = "") -> str:
    """results.md / .csv / .json and curves.png of a compare suite into ``out``; returns the Markdown table
    followed by its notes. ``timing`` (:func:`~mhmoe.research.throughput.timed_throughput`) fills the tok/s
    column, ``timing_note`` says what it measured."""
    out = Path(out)
    timed = timing["tokens_per_s"] if timing else None
    table = markdown_table(runs, timed)
    n_seeds = len({r["seed"] for r in runs})
    note = f"Seeds: {n_seeds}" + (" (mean ± std over seeds)." if n_seeds > 1 else ".")
    note += " " + (timing_note if timed else RUN_AVERAGE_NOTE)
    atomic_write(out / RESULTS_MD, f"# {title}\n\n{table}\n\n{note}\n")
    extra = {**(extra or {}), **({"timed_throughput": {**timing, "note": timing_note}} if timing else {})}
    write_runs_csv(runs, out / RESULTS_CSV, title)
    write_json(runs, out / RESULTS_JSON, title, extra)
    plot_suite_curves(runs, out / CURVES_PNG, title)
    return f"{table}\n\n{note}"


def run_dirs_of(path: Path) -> list[Path]:
    """A run directory itself, or the run directories below a suite directory (any depth, sorted)."""
    if (path / METRICS_FILE).is_file():
        return [path]
    return sorted(p.parent for p in path.rglob(METRICS_FILE))


def _suite_runs(path: Path) -> list[tuple[str, Curves]]:
    """(label, curves) of every run listed in a reproduce suite's ``results.json`` (runs kept in a run
    store are not below the suite folder); [] for any other path."""
    from mhmoe.research.store import read_suite_results

    if (path / METRICS_FILE).is_file():
        return []
    data = read_suite_results(path / RESULTS_JSON)  # a symlink, a FIFO, an oversized file: one line
    runs = data.get("runs") if isinstance(data, dict) else None
    if not isinstance(runs, list) or not all(isinstance(r, dict) and "curve" in r for r in runs):
        return []
    try:
        return [(str(r["label"]), record_curves(r, str(r["label"]))) for r in runs]
    except (KeyError, TypeError, ValueError, AttributeError):  # not a results.json this version wrote
        return []


def collect_curves(paths: list[Path], labels: list[str] | None = None) -> list[Curves]:
    """Curves for ``mhmoe plot``: one per run directory, or one per model of a suite directory (seeds
    averaged, as in its curves.png); ``labels`` (one per path) rename them. ConfigError for a path with no
    runs in it."""
    from mhmoe.errors import ConfigError

    out: list[Curves] = []
    for i, path in enumerate(paths):
        groups: dict[str, list[Curves]] = {}
        for label, c in _suite_runs(path) or [(None, read_curves(run)) for run in run_dirs_of(path)]:
            groups.setdefault(label or c.label, []).append(c)
        if not groups:
            raise ConfigError("RUN", str(path), "a run directory (with metrics.jsonl) or a directory of runs")
        named = [mean_curves(label, cs) for label, cs in groups.items()]
        if labels:
            named = [replace(c, label=labels[i] if len(named) == 1 else f"{labels[i]}/{c.label}") for c in named]
        out += named
    return out
