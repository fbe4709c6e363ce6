"""`mhmoe reproduce icml-table1` covers ICML Table 1's three settings: the English rows, then the
multilingual and masked multi-modal blocks (suites of their own, each in OUT/<block>/), reported
together with per-language and per-modality columns beside the paper's numbers."""

from __future__ import annotations

import json

import pytest

from mhmoe.cli import main
from mhmoe.errors import ConfigError
from mhmoe.research import reproduce

BLOCKS = ("icml-table1-multilingual", "icml-table1-multimodal")


def _fake_train(calls):
    def fake_train(run, run_dir, resume=False, progress=True):
        calls.append((run.name, run.data.task, run.train.seed))
        if run.data.task == "masked_mm":
            sets = ("masked", "masked_image", "masked_text")
        elif run.data.corpus == "manpages":
            sets = ("manpages", *run.data.val_sets)
        else:
            sets = ("kjv",)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "results.json").write_text(json.dumps({
            "preset": run.name, "step": 1, "params": 10, "fwd_flops_per_token": 5.0, "tokens_per_s": 1.0,
            "train_s": 1.0, "nan_skips": 0,
            "eval": {s: {"ppl": 10.0 + len(calls) + i, "loss": 2.3} for i, s in enumerate(sets)}}))
        (run_dir / "eval.jsonl").write_text(json.dumps({"step": 1, f"{sets[0]}_ppl": 12.0}) + "\n")
    return fake_train


def test_blocks_are_the_papers_rows():
    assert reproduce.SUITE_BLOCKS["icml-table1"] == BLOCKS
    ml, mm = (reproduce.suite_rows(b) for b in BLOCKS)
    labels = ["Dense", "X-MoE (8 experts)", "MH-MoE (8 experts)", "X-MoE (32 experts)", "MH-MoE (32 experts)"]
    assert [r.label for r in ml] == [r.label for r in mm] == labels
    assert [r.paper["Perplexity"] for r in ml] == [8.56, 7.19, 6.26, 6.02, 5.09]
    assert [r.paper["Perplexity"] for r in mm] == [17.95, 16.34, 14.73, 12.68, 10.87]
    assert [r.build("tiny").name for r in mm] == ["tiny-icml-mm-dense", "tiny-icml-mm-xmoe-8", "tiny-icml-mm-mh4-8",
                                                  "tiny-icml-mm-xmoe-32", "tiny-icml-mm-mh4-32"]
    assert {r.build("tiny").data.corpus for r in ml} == {"manpages"}


def test_icml_table1_runs_and_reports_all_three_settings(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr("mhmoe.train.loop.train", _fake_train(calls))
    out = tmp_path / "suite"  # its run store: tmp_path/store; its blocks' (OUT/<block>/): OUT/store
    res = reproduce.run_table("icml-table1", out, seeds=2, progress=False)
    assert len(res) == len(calls) == 3 * 5 * 2
    assert sum(c[1] == "masked_mm" for c in calls) == 10
    for block in BLOCKS:
        assert (out / block / "results.csv").read_text().count("\n") == 11
    assert len(list((out / "store" / "records").glob("*.json"))) == 20
    assert len(list((tmp_path / "store" / "records").glob("*.json"))) == 10
    md = (out / "results.md").read_text()
    assert md.index("# icml-table1\n") < md.index("# icml-table1-multilingual") < md.index("# icml-table1-multimodal")
    for col in ("ours man-ja", "ours man-pt-br", "ours manpages", "ours masked_image", "ours masked_text"):
        assert col in md
    assert "8.56" in md and "17.95" in md and "± " in md
    # a second call reuses every run
    reproduce.run_table("icml-table1", out, seeds=2, progress=False)
    assert len(calls) == 30


def test_report_only_leaves_out_blocks_without_runs(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr("mhmoe.train.loop.train", _fake_train(calls))
    out = tmp_path / "suite"
    reproduce.run_table("icml-table1-multimodal", out / BLOCKS[1], seeds=1, progress=False)
    assert len(calls) == 5
    assert main(["reproduce", "icml-table1", "--out", str(out), "--report-only", "--no-progress"]) == 0
    md = (out / "results.md").read_text()
    assert "# icml-table1-multimodal" in md and "# icml-table1-multilingual" not in md and len(calls) == 5
    with pytest.raises(ConfigError, match="finished icml-table1 runs"):
        reproduce.run_table("icml-table1", tmp_path / "empty", train_missing=False)
