"""The pictures of `mhmoe analyze` (mhmoe.research.analysis_plots) read at a glance: a labelled colour bar,
the uniform-routing level and the threshold beside the measured frequencies, integer ticks for counts of
experts, and the random-routing diversity beside the model's -- checked on the matplotlib objects."""

from __future__ import annotations

import numpy as np

from mhmoe.research.analysis_plots import activation_figure, diversity_figure

SUMMARY = {"threshold": 0.01, "activation_ratio": 0.5, "uniform_frequency_per_layer": [0.097, 0.097],
           "mean_assign_diversity": 8.82, "max_possible_diversity": 9, "load_imbalance_per_layer": [6.5, 9.8],
           "random_routing": {"activation_ratio": 1.0, "mean_assign_diversity": 8.71,
                              "expected_assign_diversity_per_layer": [8.71, 8.71]}}


def _shown(axis) -> list[str]:
    axis.axes.figure.canvas.draw()
    lo, hi = sorted(axis.get_view_interval())
    i = 0 if axis.axis_name == "x" else 1
    return [t.get_text() for t in axis.get_ticklabels() if t.get_text() and lo <= t.get_position()[i] <= hi]


def test_activation_has_a_labelled_colour_bar_and_the_uniform_level():
    freq = np.random.default_rng(0).random((2, 93)) * 0.3
    fig = activation_figure(freq, SUMMARY)
    heat, rank, bar = fig.axes
    assert bar.get_ylabel() == "selections per token"
    assert [ln.get_ydata()[0] for ln in bar.get_lines()] == [0.097, 0.01]  # uniform level and threshold marked
    assert "random routing 1.000" in heat.get_title() and "threshold 0.01" in heat.get_title()
    labels = [ln.get_label() for ln in rank.get_lines()]
    assert labels == ["layer 0", "layer 1", "uniform routing H*K/E = 0.097", "activation threshold 0.01"]
    sorted_layer = rank.get_lines()[0].get_ydata()
    assert list(sorted_layer) == sorted(freq[0], reverse=True)
    assert all(s.isdigit() for s in _shown(heat.xaxis) + _shown(rank.xaxis))  # expert ids / ranks: integers


def test_diversity_has_integer_ticks_and_the_random_routing_reference():
    div = np.array([7.5, 8.0, 8.5, 8.5, 9.0, 9.0, 9.0])  # means over 2 layers: multiples of 1/2
    fig = diversity_figure(div, SUMMARY)
    (ax,) = fig.axes
    assert _shown(ax.xaxis) and all(s.isdigit() for s in _shown(ax.xaxis))  # no 7.5, 8.5 ticks
    assert all(float(s).is_integer() for s in _shown(ax.yaxis))
    bars = sorted((p.get_x() + p.get_width() / 2, p.get_height()) for p in ax.patches)
    assert [(round(x, 2), h) for x, h in bars] == [(7.5, 1), (8.0, 1), (8.5, 2), (9.0, 3)]
    lines = {ln.get_label(): ln.get_xdata()[0] for ln in ax.get_lines()}
    assert lines["model mean 8.82"] == 8.82 and lines["random routing 8.71"] == 8.71
    assert lines["max min(E, H*K) = 9"] == 9
    assert "random routing 8.71" in ax.get_title()
