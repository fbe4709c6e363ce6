"""Training curves: the trainer redraws RUN/curves.png at every evaluation; reading runs (torn lines,
seeds averaged); drawing several runs; a failure to draw never stops training."""

from __future__ import annotations

import json
import math
import random
import re

import pytest
from helpers import tiny_run

from mhmoe.train import plots
from mhmoe.train.loop import train
from mhmoe.train.plots import Curves, mean_curves, plot_curves, read_curves, read_jsonl, shared_val_set

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_training_writes_and_updates_curves_png(tmp_path, monkeypatch):
    drawn = []
    real = plots.plot_run
    monkeypatch.setattr(plots, "plot_run", lambda run_dir: drawn.append(run_dir) or real(run_dir))
    run = tiny_run(tmp_path, max_steps=6, eval_every=2)
    train(run, tmp_path / "run", progress=False)
    assert len(drawn) == 3  # evaluations at steps 2 and 4, and the final one
    png = tmp_path / "run" / "curves.png"
    assert png.read_bytes().startswith(PNG_MAGIC)
    curves = read_curves(tmp_path / "run")
    assert [s for s, _ in curves.train] == [1, 2, 3, 4, 5, 6]
    assert list(curves.val) == ["corpus"] and [s for s, _ in curves.val["corpus"]] == [2, 4, 6]


def test_read_jsonl_skips_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n" + '{"step": 2, "lo')
    assert read_jsonl(path) == [{"step": 1, "loss": 2.0}] and read_jsonl(tmp_path / "missing.jsonl") == []


def _write_run(root, losses, ppl, label_dir="seed0"):
    run = root / label_dir
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "loss": v}) + "\n"
                                               for i, v in enumerate(losses)))
    (run / "eval.jsonl").write_text("".join(json.dumps({"step": s, "kjv_ppl": p, "pydocs_ppl": 2 * p}) + "\n"
                                            for s, p in ppl))
    return run


def test_labels_and_seed_averages(tmp_path):
    a = read_curves(_write_run(tmp_path / "mh3", [4.0, 3.0, 2.0], [(2, 30.0), (3, 20.0)]))
    b = read_curves(_write_run(tmp_path / "mh3", [2.0, 1.0], [(2, 10.0)], "seed1"))
    assert a.label == "mh3" and list(a.val) == ["kjv", "pydocs"]
    m = mean_curves("mh3", [a, b])
    assert m.train == [(1, 3.0), (2, 2.0)] and m.val["kjv"] == [(2, 20.0)]  # steps all seeds logged


def test_shared_validation_set():
    a, b = Curves("a", val={"kjv": [], "pydocs": []}), Curves("b", val={"pydocs": [], "wordnet": []})
    assert shared_val_set([a, b]) == "pydocs" and shared_val_set([a, Curves("c")]) is None


def test_plot_several_runs_and_an_empty_one(tmp_path):
    runs = [read_curves(_write_run(tmp_path / n, [3.0, 2.0], [(1, 9.0), (2, 8.0)])) for n in ("a", "b")]
    out = plot_curves(runs + [Curves("empty")], tmp_path / "plots" / "all.png", "title")
    assert out.read_bytes().startswith(PNG_MAGIC)
    assert sorted(p.name for p in out.parent.iterdir()) == ["all.png"]  # no temporary file left


def test_a_failed_plot_warns_in_one_line_and_training_goes_on(tmp_path, monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("no display\nmore")

    monkeypatch.setattr(plots, "plot_curves", broken)
    res = train(tiny_run(tmp_path, max_steps=2), tmp_path / "run", progress=False)
    assert res.step == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if "curves.png" in ln]
    assert err and err[0].startswith("mhmoe: warning:") and "RuntimeError: no display" in err[0]


@pytest.mark.parametrize("bad", [{"step": 1, "loss": "nan?"}, {"loss": 1.0}])
def test_records_without_a_numeric_loss_or_step_are_left_out(tmp_path, bad):
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps(bad) + "\n" + json.dumps({"step": 2, "loss": 1.5}) + "\n")
    assert read_curves(run).train == [(2, 1.5)]


# ---- readable at a glance (matplotlib objects, before saving) -----------------------------------------------------
def _tick_labels(axis) -> list[str]:
    """The major tick labels shown (inside the axis' view), as drawn."""
    axis.axes.figure.canvas.draw()  # tick labels are resolved at draw time
    lo, hi = sorted(axis.get_view_interval())
    return [t.get_text() for t in axis.get_ticklabels() if t.get_text() and lo <= t.get_position()[
        0 if axis.axis_name == "x" else 1] <= hi]


def _lines_with_data(ax):
    return [ln for ln in ax.get_lines() if len(ln.get_xdata())]


def test_a_two_step_run_has_markers_and_integer_step_ticks():
    c = Curves("r", train=[(1, 9.05), (2, 8.91)], val={"kjv": [(2, 4943.1)], "pydocs": [(2, 6275.2)]})
    fig = plots.curves_figure([c], "r")
    ax_t, ax_v = fig.axes
    (line,) = _lines_with_data(ax_t)
    assert list(line.get_xdata()) == [1, 2] and line.get_marker() == "o"
    assert _tick_labels(ax_t.xaxis) == ["0", "1", "2"]  # integers only, from 0
    # evaluated once: a dot per validation set, its value written beside it, the step in the title
    assert ax_v.get_title() == "validation perplexity at step 2"
    assert [t.get_text() for t in ax_v.get_yticklabels()] == ["pydocs", "kjv"]
    assert sorted(t.get_text().strip() for t in ax_v.texts) == ["4,943.1", "6,275.2"]


def test_a_narrow_perplexity_range_is_linear_with_plain_labels():
    c = Curves("r", train=[(1, 7.64), (2, 7.63)], val={"kjv": [(1, 2090.0), (2, 2081.0)]})
    ax_v = plots.curves_figure([c]).axes[1]
    assert ax_v.get_yscale() == "linear"
    labels = _tick_labels(ax_v.yaxis)
    assert labels and all(re.fullmatch(r"\d{4}", s) for s in labels), labels  # no 2.09x10^3, no offset
    assert len(set(labels)) == len(labels)
    (kjv,) = _lines_with_data(ax_v)
    assert kjv.get_marker() == "o"


def test_a_wide_perplexity_range_is_log_with_plain_labels():
    c = Curves("r", val={"kjv": [(s, 20 + 2000 * math.exp(-s / 8000)) for s in range(2000, 100_001, 2000)]})
    ax_v = plots.curves_figure([c]).axes[1]
    assert ax_v.get_yscale() == "log"
    labels = _tick_labels(ax_v.yaxis)
    assert {"20", "50", "100", "200", "500", "1,000"} <= set(labels), labels
    assert not any("10^" in s or "times" in s for s in labels)
    assert not [t.get_text() for t in ax_v.yaxis.get_minorticklabels() if t.get_text()]


def test_a_100k_step_run_is_smoothed_with_thousands_on_the_step_axis():
    rng = random.Random(0)
    steps = [1] + list(range(10, 100_001, 10))
    c = Curves("long", train=[(s, 3 + 6 * math.exp(-s / 8000) + rng.gauss(0, 0.15)) for s in steps])
    ax_t = plots.curves_figure([c]).axes[0]
    raw, smooth = _lines_with_data(ax_t)
    assert len(raw.get_xdata()) == len(smooth.get_xdata()) == len(steps)
    assert raw.get_alpha() < 1 and smooth.get_label().startswith("long (mean of") and raw.get_marker() == "None"
    assert max(smooth.get_ydata()[-500:]) - min(smooth.get_ydata()[-500:]) < 0.2  # the noise is averaged out
    assert _tick_labels(ax_t.xaxis) == ["0", "20k", "40k", "60k", "80k", "100k"]


def test_seed_means_carry_a_band_and_error_bars(tmp_path):
    runs = []
    for label, base in (("dense", 150.0), ("mh3", 140.0)):
        for k in range(3):
            d = _write_run(tmp_path / label, [5.0 - k * 0.1, 4.0, 3.0 + k * 0.1], [(3, base + k)], f"seed{k}")
            runs.append(read_curves(d))
    curves = [mean_curves("dense", runs[:3]), mean_curves("mh3", runs[3:])]
    assert curves[0].seeds == 3 and curves[0].train_std[1] == pytest.approx(0.1)
    assert curves[0].val_std["kjv"][3] == pytest.approx(1.0)
    fig = plots.curves_figure(curves, "suite")
    ax_t, ax_v = fig.axes
    assert len(ax_t.collections) == 2  # one ± std band per model
    assert ax_t.get_title() == "training loss (mean ± std over 3 seeds)"
    assert [ln.get_label() for ln in _lines_with_data(ax_t)] == ["dense", "mh3"]
    assert "± 1.0" in " ".join(t.get_text() for t in ax_v.texts)  # the final values with their spread
    assert ax_v.get_xlabel() == "perplexity (mean ± std over 3 seeds)"
    assert ax_v.get_title() == "validation perplexity (kjv) at step 3"
