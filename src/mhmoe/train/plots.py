"""Training curves as PNG files (matplotlib, Agg backend): ``RUN/curves.png`` for one run, and one
figure for several runs (``mhmoe compare``, ``mhmoe reproduce``, ``mhmoe plot``).

A figure has two panels over optimizer steps: the training loss of ``metrics.jsonl`` and the validation
perplexity of ``eval.jsonl``. One run: every validation set gets a line. Several runs: one line per run
(or per model, averaged over its seeds, with a band of ± one standard deviation over them) on the
validation set they share, the training corpus's own first. When every run was evaluated once (at the
end), the perplexity panel is a dot plot of the final values (with the seed spread as error bars).
Lines get markers when they have few points; a long run's noisy loss is drawn faintly under its moving
average; axes and ticks follow :mod:`mhmoe.train.plot_style`. Files are written to a temporary name and
renamed, so a viewer never sees a half-written PNG.
"""

from __future__ import annotations

import json
import os
import stat
import statistics
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from mhmoe.checkpoint.layout import CURVES_FILE, EVAL_FILE, METRICS_FILE
from mhmoe.errors import one_line
from mhmoe.runtime.reading import iter_lines
from mhmoe.train.plot_style import colors, draw_series, figure, final_values, save_figure, step_axis, value_axis


@dataclass
class Curves:
    """One run's (or one model's, seed-averaged) curves: ``train`` = [(step, loss)], ``val`` = {set: [(step,
    perplexity)]} in the order the sets appear in ``eval.jsonl``. ``seeds`` > 1: the points are means over
    that many runs, and ``train_std`` / ``val_std`` hold the standard deviation over them at each step."""

    label: str
    train: list[tuple[int, float]] = field(default_factory=list)
    val: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    seeds: int = 1
    train_std: dict[int, float] = field(default_factory=dict)
    val_std: dict[str, dict[int, float]] = field(default_factory=dict)


def read_jsonl(path: Path) -> list[dict]:
    """The JSON objects of a ``.jsonl`` file (a torn last line, as after a crash, is skipped), streamed
    line by line (:func:`mhmoe.runtime.reading.iter_lines`); anything but a regular file (a symlink, a
    FIFO, a device) is not read."""
    if not stat.S_ISREG(path.lstat().st_mode if os.path.lexists(path) else 0):
        return []
    out = []
    for line in iter_lines(path, follow=False):
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):  # a torn line, or a nesting bomb in a stranger's run
            continue
        if isinstance(rec, dict) and "step" in rec:
            out.append(rec)
    return out


def read_curves(run_dir: str | os.PathLike[str], label: str | None = None) -> Curves:
    """The curves of a run directory (label: its name, or its parent's for ``.../seed<k>``)."""
    run = Path(run_dir)
    if label is None:
        label = run.parent.name if run.name.startswith("seed") and run.name[4:].isdigit() else run.name
    curves = Curves(label, [(int(r["step"]), float(r["loss"])) for r in read_jsonl(run / METRICS_FILE)
                            if isinstance(r.get("loss"), (int, float))])
    for rec in read_jsonl(run / EVAL_FILE):
        for key, value in rec.items():
            if key.endswith("_ppl") and isinstance(value, (int, float)):
                curves.val.setdefault(key[:-4], []).append((int(rec["step"]), float(value)))
    return curves


def _mean_std(series: list[list[tuple[int, float]]]) -> tuple[list[tuple[int, float]], dict[int, float]]:
    """Mean and sample standard deviation over ``series`` at the steps they all have."""
    maps = [dict(s) for s in series]
    steps = sorted(set.intersection(*(set(m) for m in maps))) if maps else []
    mean = [(s, statistics.fmean(m[s] for m in maps)) for s in steps]
    std = {s: statistics.stdev(m[s] for m in maps) for s in steps} if len(maps) > 1 else {}
    return mean, std


def mean_curves(label: str, runs: list[Curves]) -> Curves:
    """Average several runs (seeds) of one model at the steps they all logged, with their spread."""
    if len(runs) == 1:
        return replace(runs[0], label=label)
    train, train_std = _mean_std([r.train for r in runs])
    out = Curves(label, train, seeds=len(runs), train_std=train_std)
    for k in (k for k in runs[0].val if all(k in r.val for r in runs)):
        out.val[k], out.val_std[k] = _mean_std([r.val[k] for r in runs])
    return out


def shared_val_set(curves: list[Curves]) -> str | None:
    """The validation set every run has, preferring the first run's first (its training corpus)."""
    if not curves:
        return None
    return next((k for k in curves[0].val if all(k in c.val for c in curves)), None)


def plot_curves(curves: list[Curves], path: str | os.PathLike[str], title: str = "") -> Path:
    """Draw ``curves`` into ``path`` (PNG); returns the path. See :func:`curves_figure` for the panels."""
    return save_figure(curves_figure(curves, title), path)


def curves_figure(curves: list[Curves], title: str = ""):
    """The two-panel figure of ``curves`` (module docstring; :mod:`mhmoe.train.plot_style` for the axes)."""
    fig, (ax_t, ax_v) = figure((11, 4), ncols=2)
    palette = colors()
    for i, c in enumerate(curves):
        if c.train:
            draw_series(ax_t, c.train, c.train_std, c.label, palette[i % len(palette)])
    step_axis(ax_t, [s for c in curves for s, _ in c.train])
    seeds = seed_note(curves)
    ax_t.set(ylabel="training loss (nats/token)", title="training loss" + seeds)
    if len(curves) == 1:
        series = [(name, pts, curves[0].val_std.get(name, {}), curves[0].seeds) for name, pts in curves[0].val.items()]
        val_title = "validation perplexity"
    else:
        key = shared_val_set(curves)
        series = [(c.label, c.val[key], c.val_std.get(key, {}), c.seeds) for c in curves] if key else []
        val_title = f"validation perplexity ({key})" if key else "validation perplexity (no shared set)"
    series = [s for s in series if s[1]]
    if series and all(len(pts) == 1 for _, pts, _, _ in series):
        final_values(ax_v, [(name, pts[0], std) for name, pts, std, _ in series], val_title, palette)
        ax_v.set_xlabel("perplexity" + seeds)
    else:
        for i, (name, pts, std, _) in enumerate(series):
            draw_series(ax_v, pts, std, name, palette[i % len(palette)], markers_up_to=60)
        step_axis(ax_v, [s for _, pts, _, _ in series for s, _ in pts])
        value_axis(ax_v, [v for _, pts, _, _ in series for _, v in pts], "y")
        ax_v.set(ylabel="perplexity", title=val_title + seeds)
    for ax in (ax_t, ax_v):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def seed_note(curves: list[Curves]) -> str:
    """`` (mean ± std over 3 seeds)`` when some curve averages seeds, else ``""``."""
    n = sorted({c.seeds for c in curves if c.seeds > 1})
    return f" (mean ± std over {'/'.join(map(str, n))} seeds)" if n else ""


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
