"""Axes and series that read at a glance, for every PNG the project writes (curves, routing analysis).

Rules, for runs from 2 to 100,000 steps:

- **Steps** are integers: integer ticks only (never 3.8, 3.9, ...), the axis starts at 0, and large step
  counts are written ``20k``, ``40k``.
- **Few points get markers** (a one-point line is invisible); a long, noisy series (more than
  :data:`SMOOTH_ABOVE` points) is drawn faintly with its moving average on top.
- **Seeds**: a mean over seeds carries a band of ± one standard deviation (error bars for single points).
- **Perplexity-like values** use a log axis only when they span a factor of :data:`LOG_RATIO` or more
  (then at least two labelled ticks fall inside), with plain labels (``200``, ``500``, ``1,000``; never
  ``2.09x10^3`` minor labels); a narrower range is linear, with plain labels and no offset.

Figures are :class:`matplotlib.figure.Figure` objects (no pyplot state, nothing to close), so tests can
inspect their lines, markers and tick labels before :func:`save_figure` writes them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SMOOTH_ABOVE = 300  # points: above this a series is drawn faintly under its moving average
LOG_RATIO = 8.0  # max / min at which a positive value axis becomes logarithmic
MARKERS_UP_TO = 30  # points: up to this many a line gets a marker at each point


def figure(figsize: tuple[float, float], ncols: int = 1) -> tuple[Any, Any]:
    """A new figure and its axes (one row of ``ncols``); Agg canvas, independent of pyplot."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    return fig, fig.subplots(1, ncols)


def colors() -> list[str]:
    import matplotlib

    return list(matplotlib.rcParams["axes.prop_cycle"].by_key()["color"])


def save_figure(fig: Any, path: str | os.PathLike[str], dpi: int = 110) -> Path:
    """Write ``fig`` as a PNG atomically (:func:`mhmoe.runtime.files.atomic_write`: a viewer never sees a
    half-written file, a symlink at ``path`` is replaced, not followed)."""
    from mhmoe.runtime.files import atomic_write

    return atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=dpi))


def plain_number(value: float, _pos: Any = None) -> str:
    """``0.5``, ``12``, ``200``, ``1,500``: a tick label without exponent."""
    if value == 0 or abs(value) >= 10:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def step_number(value: float, _pos: Any = None) -> str:
    """``500``, ``2,000``, ``20k``, ``1.5M``: a step count."""
    if abs(value) >= 1e6:
        return f"{value / 1e6:g}M"
    if abs(value) >= 1e4:
        return f"{value / 1e3:g}k"
    return f"{value:,.0f}"


def integer_axis(ax: Any, which: str = "x") -> None:
    """Integer ticks only (at least one), on ``which`` axis."""
    from matplotlib.ticker import MaxNLocator

    axis = ax.xaxis if which == "x" else ax.yaxis
    axis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1, steps=[1, 2, 2.5, 5, 10]))


def step_axis(ax: Any, steps: Sequence[int]) -> None:
    """An optimizer-step x axis: from 0 to just past the last step, integer ticks, ``k`` for thousands."""
    from matplotlib.ticker import FuncFormatter

    ax.set_xlabel("step")
    integer_axis(ax, "x")
    ax.xaxis.set_major_formatter(FuncFormatter(step_number))
    if steps:
        last = max(steps)
        ax.set_xlim(0, last + max(0.5, 0.03 * last))


def value_axis(ax: Any, values: Sequence[float], which: str = "y") -> None:
    """A positive-value axis (perplexity): log when the values span :data:`LOG_RATIO`, else linear; plain
    tick labels either way."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter, ScalarFormatter

    axis = ax.yaxis if which == "y" else ax.xaxis
    finite = [v for v in values if v > 0 and math.isfinite(v)]
    if finite and max(finite) / min(finite) >= LOG_RATIO:
        (ax.set_yscale if which == "y" else ax.set_xscale)("log")
        decades = math.log10(max(finite) / min(finite))
        axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0) if decades <= 3 else (1.0,)))
        axis.set_major_formatter(FuncFormatter(plain_number))
        axis.set_minor_formatter(NullFormatter())
    else:
        fmt = ScalarFormatter(useOffset=False)
        fmt.set_scientific(False)
        axis.set_major_formatter(fmt)


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over ``window`` points (shorter at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def draw_series(ax: Any, pts: Sequence[tuple[int, float]], std: dict[int, float], label: str, color: str,
                markers_up_to: int = MARKERS_UP_TO) -> None:
    """One (step, value) series: markers when few points, faint raw + moving average when many, a ± std
    band (error bars for a single point) when ``std`` has the spread over seeds."""
    steps, vals = [s for s, _ in pts], [v for _, v in pts]
    n = len(pts)
    if n > SMOOTH_ABOVE:
        window = max(5, n // 50)
        ax.plot(steps, vals, color=color, linewidth=0.6, alpha=0.3)
        ax.plot(steps, moving_average(vals, window), color=color, linewidth=1.5,
                label=f"{label} (mean of {window} logs)")
    else:
        marker = {"marker": "o", "markersize": 5 if n <= 10 else 3} if n <= markers_up_to else {}
        ax.plot(steps, vals, color=color, linewidth=1.3, label=label, **marker)
    if std:
        sd = [std.get(s, 0.0) for s in steps]
        if n == 1:
            ax.errorbar(steps, vals, yerr=sd, color=color, capsize=4, linewidth=1)
        else:
            ax.fill_between(steps, [v - d for v, d in zip(vals, sd, strict=True)],
                            [v + d for v, d in zip(vals, sd, strict=True)], color=color, alpha=0.2, linewidth=0)


def final_values(ax: Any, rows: Sequence[tuple[str, tuple[int, float], dict[int, float]]], title: str,
                 palette: Sequence[str]) -> None:
    """A dot plot of one value per row (e.g. each model's final perplexity), ± std error bars where
    there are seeds, the value written beside each dot; the first row on top."""
    n = len(rows)
    allv: list[float] = []
    for i, (_, (step, value), std) in enumerate(rows):
        y = n - 1 - i
        sd = std.get(step)
        ax.errorbar([value], [y], xerr=[[sd], [sd]] if sd else None, fmt="o", markersize=7, capsize=4,
                    color=palette[i % len(palette)])
        text = f" {value:,.1f}" + (f" ± {sd:,.1f}" if sd else "")
        ax.annotate(text, (value + (sd or 0.0), y), xytext=(4, 0), textcoords="offset points", va="center",
                    fontsize=8)
        allv += [value - (sd or 0.0), value + (sd or 0.0)]
    ax.set_yticks(range(n), [r[0] for r in reversed(rows)])
    ax.set_ylim(-0.6, n - 0.4)
    value_axis(ax, [v for v in allv if v > 0], "x")
    lo, hi = min(allv), max(allv)
    pad = (hi - lo) * 0.25 or abs(hi) * 0.05 or 1.0
    if ax.get_xscale() == "log":
        ax.set_xlim(lo / 1.3, hi * 2.2)  # room for the value written right of the dot
    else:
        ax.set_xlim(lo - pad * 0.4, hi + pad)  # room for the value labels on the right
    steps = {r[1][0] for r in rows}
    ax.set_xlabel("perplexity")
    ax.set_title(f"{title} at step {step_number(steps.pop())}" if len(steps) == 1 else f"{title} (final)")
