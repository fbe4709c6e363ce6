"""Training curves: the trainer redraws RUN/curves.png at every evaluation; reading runs (torn lines,
seeds averaged); drawing several runs; a failure to draw never stops training."""

from __future__ import annotations

import json

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
