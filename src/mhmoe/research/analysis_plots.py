"""The pictures of ``mhmoe analyze`` (:func:`mhmoe.research.analysis.write_report`), each with its chance level.

- ``activation.png``: the expert activation frequency per MoE layer (selections per token) as a heatmap
  with a labelled colour bar on which the uniform-routing level H*K/E and the activation threshold are
  marked; below it, every layer's frequencies sorted from the busiest expert down, against the same two
  lines -- how far the routing is from uniform reads at a glance.
- ``diversity.png``: the histogram of distinct experts per token (mean over MoE layers, so multiples of
  1/L), one bar per possible value, with the model's mean, the mean under uniformly random routing
  (measured, and the expected E(1-(1-K/E)^H)) and the maximum min(E, H*K) as vertical lines.

- ``polysemy.png`` (``mhmoe analyze --polysemy``, :mod:`mhmoe.research.polysemy`): the mean assign
  diversity of polysemous and monosemous tokens per layer beside random routing, and its distribution.

All are :class:`matplotlib.figure.Figure` objects (tests inspect them before saving).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mhmoe.train.plot_style import colors, figure, integer_axis

UNIFORM_STYLE = {"color": "tab:red", "linestyle": "--", "linewidth": 1.2}
THRESHOLD_STYLE = {"color": "0.4", "linestyle": ":", "linewidth": 1.2}


def activation_figure(freq: np.ndarray, summary: dict[str, Any]) -> Any:
    """Heatmap [L, E] of selections per token + sorted frequencies per layer (module docstring)."""
    from matplotlib.figure import Figure

    n_layers, n_experts = freq.shape if freq.size else (1, 1)
    uniform = float(np.mean(summary.get("uniform_frequency_per_layer") or [0.0]))
    threshold = float(summary["threshold"])
    random_ratio = summary.get("random_routing", {}).get("activation_ratio")
    fig = Figure(figsize=(max(7.0, min(14.0, 0.1 * n_experts + 3)), 4.0 + 0.45 * n_layers), layout="constrained")
    ax_map, ax_rank = fig.subplots(2, 1, height_ratios=[max(1.6, 0.45 * n_layers), 2.2])
    data = freq if freq.size else np.zeros((1, 1))
    im = ax_map.imshow(data, aspect="auto", cmap="viridis", vmin=0, interpolation="nearest")
    ax_map.set(xlabel="expert", ylabel="MoE layer")
    ax_map.set_yticks(range(n_layers))
    integer_axis(ax_map, "x")
    title = f"expert activation: activation ratio {summary['activation_ratio']:.3f}"
    if random_ratio is not None:
        title += f" (random routing {random_ratio:.3f})"
    ax_map.set_title(f"{title}\nthreshold {threshold:g} selections/token", fontsize=10)
    bar = fig.colorbar(im, ax=ax_map, pad=0.01)
    bar.set_label("selections per token", fontsize=8)
    bar.ax.axhline(uniform, **UNIFORM_STYLE)
    bar.ax.axhline(threshold, **THRESHOLD_STYLE)
    palette = colors()
    ranks = np.arange(1, n_experts + 1)
    for i, row in enumerate(freq):
        ax_rank.plot(ranks, np.sort(row)[::-1], color=palette[i % len(palette)], linewidth=1.3,
                     marker="o" if n_experts <= 30 else None, markersize=3, label=f"layer {i}")
    ax_rank.axhline(uniform, label=f"uniform routing H*K/E = {uniform:.3g}", **UNIFORM_STYLE)
    ax_rank.axhline(threshold, label=f"activation threshold {threshold:g}", **THRESHOLD_STYLE)
    ax_rank.set(xlabel="expert rank (busiest first)", ylabel="selections / token", xlim=(0.5, n_experts + 0.5))
    integer_axis(ax_rank, "x")
    ax_rank.grid(alpha=0.3)
    ax_rank.legend(fontsize=7, ncol=2 if n_layers > 3 else 1)
    return fig


def diversity_figure(div: np.ndarray, summary: dict[str, Any]) -> Any:
    """Histogram of distinct experts per token with the model mean, random routing and the maximum."""
    fig, ax = figure((7, 3.8))
    n_layers = max(1, len(summary.get("load_imbalance_per_layer") or [1]))
    rnd = summary.get("random_routing", {})
    expected = rnd.get("expected_assign_diversity_per_layer") or []
    if div.size:
        values, counts = np.unique(np.round(div * n_layers) / n_layers, return_counts=True)
        ax.bar(values, counts, width=0.8 / n_layers, color="tab:blue", alpha=0.75, label="tokens")
    mean = float(summary["mean_assign_diversity"])
    ax.axvline(mean, color="tab:blue", linewidth=2, label=f"model mean {mean:.2f}")
    if "mean_assign_diversity" in rnd:
        ax.axvline(rnd["mean_assign_diversity"], label=f"random routing {rnd['mean_assign_diversity']:.2f}",
                   **UNIFORM_STYLE)
    if expected:
        e = float(np.mean(expected))
        ax.axvline(e, color="tab:red", linestyle=":", linewidth=1, label=f"expected E(1-(1-K/E)^H) = {e:.2f}")
    top = summary.get("max_possible_diversity")
    if top:
        ax.axvline(top, color="0.3", linewidth=1, label=f"max min(E, H*K) = {top}")
    integer_axis(ax, "x")
    integer_axis(ax, "y")
    lo = min([float(div.min())] if div.size else [1.0]) - 0.6
    ax.set_xlim(max(0.0, lo), max(float(top or 1), float(div.max()) if div.size else 1.0) + 0.6)
    ax.set(xlabel=f"distinct experts per token (mean over {n_layers} MoE layer{'s' if n_layers > 1 else ''})",
           ylabel="tokens", title=f"sub-token assign diversity: mean {mean:.2f}"
           + (f" (random routing {rnd['mean_assign_diversity']:.2f})" if "mean_assign_diversity" in rnd else ""))
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig


POLYSEMY_COLORS = {"polysemous": "tab:orange", "monosemous": "tab:blue"}


def _p_label(p: float | None) -> str:
    return "p n/a" if p is None else f"p={p:.3g}"


def polysemy_figure(stats: dict[str, Any]) -> Any:
    """``polysemy.png`` (:mod:`mhmoe.research.polysemy`): left, per MoE layer and for the mean over layers,
    each group's mean assign diversity (points, ± 1.96 standard errors) with the random-routing mean as a
    dashed red line across the pair and the occurrence / type permutation p-values below; right, the
    distribution of the mean-over-layers diversity per group."""
    fig, (ax, ax_hist) = figure((11, 4.2), ncols=2)
    cols = stats["layers"] + [stats["mean_over_layers"]]
    names = [f"layer {c['layer']}" for c in stats["layers"]] + ["mean over\nlayers"]
    for x, c in enumerate(cols):
        for dx, g in ((-0.12, "polysemous"), (0.12, "monosemous")):
            if c[f"{g}_mean"] is not None:
                ax.errorbar(x + dx, c[f"{g}_mean"], yerr=1.96 * c[f"{g}_std"] / max(1, stats["tokens"][g]) ** 0.5,
                            fmt="o", color=POLYSEMY_COLORS[g], capsize=3, label=g if x == 0 else None)
        rnd = [v for v in (c["random_polysemous_mean"], c["random_monosemous_mean"]) if v is not None]
        if rnd:
            ax.hlines(float(np.mean(rnd)), x - 0.35, x + 0.35, label="random routing" if x == 0 else None,
                      **UNIFORM_STYLE)
    ax.set_xticks(range(len(cols)), [f"{n}\n{_p_label(c['p_value'])}\nwords {_p_label(c['p_value_types'])}\n"
                                     f"freq. strata {_p_label(c['p_value_types_frequency_strata'])}"
                                     for n, c in zip(names, cols, strict=True)], fontsize=7)
    ax.set_xlim(-0.6, len(cols) - 0.4)
    ax.set(ylabel=f"distinct experts per token (max {stats['max_possible_diversity']})",
           title=f"assign diversity, h={stats['heads']} top-{stats['top_k']} E={stats['n_experts']}: "
           f"WordNet senses >= {stats['min_senses']} vs 1",
           xlabel="MoE layer; permutation p (tokens, words, words within frequency strata)")
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)
    _polysemy_histogram(ax_hist, stats)
    fig.tight_layout()
    return fig


def _polysemy_histogram(ax: Any, stats: dict[str, Any]) -> None:
    """Fraction of each group's tokens at each mean-over-layers diversity value."""
    hist = stats["histogram_mean_over_layers"]
    values = np.asarray(hist["values"], dtype=float)
    width = 0.8 * float(np.min(np.diff(values))) / 2 if values.size > 1 else 0.4
    for dx, g in ((-0.5, "polysemous"), (0.5, "monosemous")):
        ax.bar(values + dx * width, hist[g], width=width, color=POLYSEMY_COLORS[g], alpha=0.8,
               label=f"{g} ({stats['tokens'][g]:,} tokens, {stats['word_types'][g]:,} words)")
    integer_axis(ax, "x")
    ax.set(xlabel=f"distinct experts per token (mean over {len(stats['layers'])} MoE layers)",
           ylabel="fraction of the group's tokens", title="distribution")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, loc="upper left")
