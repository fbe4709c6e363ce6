"""Suite definitions are at parity; suites resume at run level."""

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mhmoe.cli import main
from mhmoe.errors import ConfigError
from mhmoe.model import build_model
from mhmoe.research import reproduce


def _moe_layer_counts(run):
    torch.manual_seed(0)
    cfg = run.model
    model = build_model(cfg)
    block = next(b for b in model.blocks if b.is_moe)
    params = sum(p.numel() for n, p in block.ffn.named_parameters() if "router" not in n and not n.endswith("bias"))
    x = torch.randn(64, cfg.d_model)
    with torch.no_grad(), FlopCounterMode(display=False) as c:
        block.ffn(x)
    heads = getattr(block.ffn, "heads", 1)
    router_flops = 2 * 64 * heads * sum(p.numel() for n, p in block.ffn.named_parameters() if "router" in n)
    return params, c.get_total_flops() - router_flops, router_flops


@pytest.mark.parametrize("suite", sorted(reproduce.SUITES))
def test_suite_rows_at_parity(suite):
    torch.set_num_threads(1)
    rows = reproduce.suite_rows(suite)
    groups: dict[str, list] = {}
    for row in rows:
        run = row.build("tiny")
        assert run.model.d_model == 192
        if row.parity_group:
            groups.setdefault(row.parity_group, []).append((row.label, *_moe_layer_counts(run)))
    for group, members in groups.items():
        ref_label, ref_params, ref_flops, _ = members[0]
        for label, params, flops, _ in members[1:]:
            assert abs(params / ref_params - 1) < 0.01, (suite, label, params, ref_params)
            if group == "v2":  # FLOPs parity too (the ICML groups match parameters only, by design);
                # the router's own matmul is not part of the parity
                assert abs(flops / ref_flops - 1) < 0.01, (suite, label, flops, ref_flops)


def test_unknown_suite_and_bad_scale():
    with pytest.raises(ConfigError, match="suite"):
        reproduce.suite_rows("v9-table1")
    with pytest.raises(ConfigError, match="--scale"):
        reproduce.run_suite("v2-table5", "/tmp/never", scale="huge")


def test_run_level_resume_reuses_finished_runs(tmp_path, monkeypatch):
    calls = []

    def fake_train(run, run_dir, resume=False, progress=True):
        calls.append((run.name, run.train.seed, str(run_dir)))
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "results.json").write_text(json.dumps({
            "preset": run.name, "step": 1, "params": 10, "fwd_flops_per_token": 5.0, "tokens_per_s": 1.0,
            "train_s": 1.0, "nan_skips": 0, "eval": {"kjv": {"ppl": 10.0 + len(calls), "loss": 2.3}}}))
        (run_dir / "eval.jsonl").write_text(json.dumps({"step": 1, "kjv_ppl": 12.0}) + "\n")

    monkeypatch.setattr("mhmoe.train.loop.train", fake_train)
    res = reproduce.run_suite("v2-table5", tmp_path, seeds=2, progress=False)
    assert len(calls) == 8 and len(res) == 8
    assert {c[1] for c in calls} == {1337, 1338}  # seeds offset the preset's seed
    again = reproduce.run_suite("v2-table5", tmp_path, seeds=2, progress=False)
    assert len(calls) == 8 and [r["eval"] for r in again] == [r["eval"] for r in res]
    md = (tmp_path / "results.md").read_text()
    assert "± " in md and "11.60" in md  # mean ± std over seeds, the paper's number beside ours
    assert (tmp_path / "results.csv").read_text().count("\n") == 9
    assert (tmp_path / "curves.png").stat().st_size > 0


def test_reuse_refuses_a_run_with_a_different_config(tmp_path, monkeypatch):
    def fake_train(run, run_dir, resume=False, progress=True):
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(run.to_yaml())
        (run_dir / "results.json").write_text(json.dumps({
            "preset": run.name, "step": 1, "params": 10, "fwd_flops_per_token": 5.0, "tokens_per_s": 1.0,
            "train_s": 1.0, "nan_skips": 0, "eval": {"kjv": {"ppl": 10.0, "loss": 2.3}}}))

    monkeypatch.setattr("mhmoe.train.loop.train", fake_train)
    reproduce.run_suite("v2-table5", tmp_path, progress=False)
    reproduce.run_suite("v2-table5", tmp_path, progress=False, overrides=["train.eval_batches=3"])  # bookkeeping
    with pytest.raises(ConfigError, match="train.lr"):
        reproduce.run_suite("v2-table5", tmp_path, progress=False, overrides=["train.lr=1e-4"])


def test_report_only_trains_nothing_and_reports_finished_runs(tmp_path, monkeypatch, capsys):
    calls = []

    def fake_train(run, run_dir, resume=False, progress=True):
        calls.append(run.name)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "results.json").write_text(json.dumps({
            "preset": run.name, "step": 1, "params": 10, "fwd_flops_per_token": 5.0, "tokens_per_s": 1.0,
            "train_s": 1.0, "nan_skips": 0, "eval": {"kjv": {"ppl": 20.0, "loss": 3.0}}}))

    monkeypatch.setattr("mhmoe.train.loop.train", fake_train)
    with pytest.raises(ConfigError):  # nothing finished yet
        reproduce.run_suite("v2-table5", tmp_path, progress=False, train_missing=False)
    assert main(["reproduce", "v2-table5", "--out", str(tmp_path), "--report-only", "--no-progress"]) == 2
    first = reproduce.suite_rows("v2-table5")[0]
    fake_train(first.build("tiny"), reproduce._run_dir(tmp_path, first.label, 0))
    calls.clear()
    res = reproduce.run_suite("v2-table5", tmp_path, progress=False, train_missing=False)
    assert calls == [] and [r["label"] for r in res] == [first.label]
    md = (tmp_path / "results.md").read_text()
    assert first.label in md and md.count("\n| ") == 2  # header + the one finished row
