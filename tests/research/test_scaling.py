"""The expert-scaling view (ICML Fig. 6a / Fig. 9) on a fake suite folder of finished runs: nothing trains."""

import json

import pytest

from mhmoe.cli import main
from mhmoe.research import reproduce
from mhmoe.research.analysis import SUITE_STATS
from mhmoe.research.scaling import family_of, scaling_figure, write_scaling


def _fake_train(run, run_dir, resume=False, progress=True):
    """A finished run whose perplexity falls with log2(experts), 10 lower for MH-MoE, + seed."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(run.to_yaml())
    moe = run.model.moe
    ppl = 200.0 - 10 * moe.n_experts.bit_length() - (10.0 if moe.heads > 1 else 0.0) + (run.train.seed - 1337)
    (run_dir / "results.json").write_text(json.dumps({
        "preset": run.name, "step": 10, "params": 1_000_000, "fwd_flops_per_token": 1e6, "tokens_per_s": 100.0,
        "train_s": 1.0, "nan_skips": 0, "eval": {"kjv": {"ppl": ppl, "loss": 5.0}}}))


@pytest.fixture
def suite(tmp_path, monkeypatch):
    monkeypatch.setattr("mhmoe.train.loop.train", _fake_train)
    only = ["X-MoE (8 experts)", "MH-MoE (8 experts)", "X-MoE (256 experts)", "MH-MoE (256 experts)"]
    out = tmp_path / "suite"  # its runs go to the run store beside it
    reproduce.run_suite("icml-fig6", out, seeds=2, progress=False, only=only)
    return out


def _analysis(suite_dir, labels):
    """An analysis.json as analyze_suite writes it (every statistic 1.0 ± 0 but the activation ratio)."""
    rows = [{"label": label, "max_possible_diversity": 8} | {k: {"mean": 1.0, "std": 0.0} for k in SUITE_STATS}
            | {"activation_ratio": {"mean": 0.5 + 0.1 * i, "std": 0.01}} for i, label in enumerate(labels)]
    out = {"suite_dir": str(suite_dir), "threshold": 0.01, "batches": 1, "rows": rows}
    (suite_dir / "analysis.json").write_text(json.dumps(out))
    return out


def test_family_is_the_label_without_its_parenthesis():
    assert family_of("MH-MoE (64 experts)") == "MH-MoE" and family_of("X-MoE") == "X-MoE"


def test_scaling_table_and_figure_from_a_finished_suite(suite):
    table = write_scaling(suite)
    assert table["suite"] == "icml-fig6" and table["validation_set"] == "kjv" and table["threshold"] is None
    assert list(table["families"]) == ["X-MoE", "MH-MoE"]
    mh = table["families"]["MH-MoE"]
    assert mh["experts"] == [8, 256] and mh["heads"] == [4, 4] and mh["seeds"] == [2, 2]
    assert mh["ppl_mean"] == [200 - 40 - 10 + 0.5, 200 - 90 - 10 + 0.5] and mh["ppl_std"] == [0.71, 0.71]
    assert mh["activation_ratio"] == [None, None]  # not analysed yet
    assert json.loads((suite / "scaling.json").read_text()) == table
    assert (suite / "scaling.png").stat().st_size > 0
    _analysis(suite, ["X-MoE (8 experts)", "MH-MoE (8 experts)", "X-MoE (256 experts)", "MH-MoE (256 experts)"])
    table = write_scaling(suite)
    assert table["threshold"] == 0.01
    assert [a["mean"] for a in table["families"]["X-MoE"]["activation_ratio"]] == [0.5, 0.7]
    fig = scaling_figure(table)
    ax_ppl, ax_act = fig.axes
    assert ax_ppl.get_xscale() == "log" and [t.get_text() for t in ax_ppl.get_xticklabels()] == ["8", "256"]
    assert "random routing" in " ".join(t.get_text() for t in ax_act.get_legend().get_texts())
    assert len(ax_act.get_lines()) >= 4  # two families, each measured and random


def test_analyze_suite_scaling_cli(suite, monkeypatch, capsys):
    def fake_analyze_suite(suite_dir, batches, threshold, device):
        return _analysis(suite, ["MH-MoE (8 experts)", "MH-MoE (256 experts)"])

    monkeypatch.setattr("mhmoe.research.analysis.analyze_suite", fake_analyze_suite)
    assert main(["analyze", "--suite", str(suite), "--scaling"]) == 0
    out = capsys.readouterr().out
    assert "MH-MoE E=256: ppl 100.50 ± 0.71, activation ratio 0.600 ± 0.010 (1.000)" in out
    assert "X-MoE E=8: ppl 160.50 ± 0.71, activation ratio -" in out
    assert (suite / "scaling.png").is_file()
    assert main(["analyze", "--checkpoint", str(suite), "--scaling"]) == 2
    assert "--scaling" in capsys.readouterr().err
