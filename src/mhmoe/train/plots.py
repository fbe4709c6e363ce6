"""Training curves as PNG files (matplotlib, Agg backend): ``RUN/curves.png`` for one run, and one
figure for several runs (``mhmoe compare``, ``mhmoe reproduce``, ``mhmoe plot``).

A figure has two panels over optimizer steps: the training loss of ``metrics.jsonl`` (lines) and the
validation perplexity of ``eval.jsonl`` (lines with a marker at each evaluation, log scale). One run:
every validation set gets a line. Several runs: one line per run (or per model, averaged over its
seeds) on the validation set they share, the training corpus's own first. Files are written to a
temporary name and renamed, so a viewer never sees a half-written PNG.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from mhmoe.errors import one_line
from mhmoe.runtime.files import atomic_write

CURVES_FILE = "curves.png"


@dataclass
class Curves:
    """One run's (or one model's, seed-averaged) curves: ``train`` = [(step, loss)], ``val`` = {set: [(step,
    perplexity)]} in the order the sets appear in ``eval.jsonl``."""

    label: str
    train: list[tuple[int, float]] = field(default_factory=list)
    val: dict[str, list[tuple[int, float]]] = field(default_factory=dict)


def read_jsonl(path: Path) -> list[dict]:
    """The JSON objects of a ``.jsonl`` file (a torn last line, as after a crash, is skipped)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and "step" in rec:
            out.append(rec)
    return out


def read_curves(run_dir: str | os.PathLike[str], label: str | None = None) -> Curves:
    """The curves of a run directory (label: its name, or its parent's for ``.../seed<k>``)."""
    run = Path(run_dir)
    if label is None:
        label = run.parent.name if run.name.startswith("seed") and run.name[4:].isdigit() else run.name
    curves = Curves(label, [(int(r["step"]), float(r["loss"])) for r in read_jsonl(run / "metrics.jsonl")
                            if isinstance(r.get("loss"), (int, float))])
    for rec in read_jsonl(run / "eval.jsonl"):
        for key, value in rec.items():
            if key.endswith("_ppl") and isinstance(value, (int, float)):
                curves.val.setdefault(key[:-4], []).append((int(rec["step"]), float(value)))
    return curves


def mean_curves(label: str, runs: list[Curves]) -> Curves:
    """Average several runs (seeds) of one model at the steps they all logged."""
    if len(runs) == 1:
        return Curves(label, runs[0].train, runs[0].val)

    def mean(series: list[list[tuple[int, float]]]) -> list[tuple[int, float]]:
        maps = [dict(s) for s in series]
        steps = sorted(set.intersection(*(set(m) for m in maps))) if maps else []
        return [(s, statistics.fmean(m[s] for m in maps)) for s in steps]

    sets = [k for k in runs[0].val if all(k in r.val for r in runs)]
    return Curves(label, mean([r.train for r in runs]), {k: mean([r.val[k] for r in runs]) for k in sets})


def shared_val_set(curves: list[Curves]) -> str | None:
    """The validation set every run has, preferring the first run's first (its training corpus)."""
    if not curves:
        return None
    return next((k for k in curves[0].val if all(k in c.val for c in curves)), None)


def plot_curves(curves: list[Curves], path: str | os.PathLike[str], title: str = "") -> Path:
    """Draw ``curves`` into ``path`` (PNG); returns the path. See the module docstring for the panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(11, 4))
    for c in curves:
        if c.train:
            ax_t.plot(*zip(*c.train, strict=True), label=c.label, linewidth=1.2)
    if len(curves) == 1:
        series = [(name, pts) for name, pts in curves[0].val.items()]
        val_title = "validation perplexity"
    else:
        key = shared_val_set(curves)
        series = [(c.label, c.val[key]) for c in curves] if key else []
        val_title = f"validation perplexity ({key})" if key else "validation perplexity (no shared set)"
    for name, pts in series:
        if pts:
            ax_v.plot(*zip(*pts, strict=True), marker="o", markersize=4, label=name)
    ax_t.set(xlabel="step", ylabel="training loss (nats/token)", title="training loss")
    ax_v.set(xlabel="step", ylabel="perplexity", title=val_title)
    if any(pts for _, pts in series):
        ax_v.set_yscale("log")
    for ax in (ax_t, ax_v):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if ax.get_lines():
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    try:
        atomic_write(out, lambda f: fig.savefig(f, format="png", dpi=110))
    finally:
        plt.close(fig)
    return out


def plot_run(run_dir: str | os.PathLike[str], title: str | None = None) -> Path:
    """``RUN/curves.png`` from the run's metrics.jsonl and eval.jsonl (called by the trainer at every
    evaluation)."""
    run = Path(run_dir)
    curves = read_curves(run)
    return plot_curves([curves], run / CURVES_FILE, title if title is not None else curves.label)


def update_run_plot(run_dir: str | os.PathLike[str]) -> None:
    """:func:`plot_run` for the trainer: a failure to draw prints one warning line and never stops training."""
    try:
        plot_run(run_dir)
    except (OSError, ValueError, RuntimeError, ImportError) as exc:
        print(f"mhmoe: warning: {Path(run_dir) / CURVES_FILE} not written ({exc.__class__.__name__}: {one_line(exc)})",
              file=sys.stderr)
