"""Suite definitions are at parity; suites resume at run level."""

import json
import math

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
    block = next((b for b in model.blocks if b.is_moe), model.blocks[1])  # dense: the FFN at an MoE position
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
            groups.setdefault(row.parity_group, []).append((row, *_moe_layer_counts(run)))
    for group, members in groups.items():
        _, ref_params, ref_flops, _ = members[0]
        for row, params, flops, _ in members[1:]:
            label = row.label
            assert abs(params / ref_params - 1) < row.params_tol, (suite, label, params, ref_params)
            if group == "v2":  # FLOPs parity too (the ICML groups match parameters only, by design);
                # the router's own matmul is not part of the parity
                assert abs(flops / ref_flops - 1) < 0.01, (suite, label, flops, ref_flops)


def test_unknown_suite_and_bad_scale():
    with pytest.raises(ConfigError, match="suite"):
        reproduce.suite_rows("v9-table1")
    with pytest.raises(ConfigError, match="--scale"):
        reproduce.run_suite("v2-table5", "/tmp/never", scale="huge")


def test_run_level_resume_reuses_finished_runs(tmp_path, monkeypatch):
    out = tmp_path / "suite"  # the run store goes beside it, into tmp_path/store
    calls = []

    def fake_train(run, run_dir, resume=False, progress=True):
        calls.append((run.name, run.train.seed, str(run_dir)))
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "results.json").write_text(json.dumps({
            "preset": run.name, "step": 1, "params": 10, "fwd_flops_per_token": 5.0, "tokens_per_s": 1.0,
            "train_s": 1.0, "nan_skips": 0, "eval": {"kjv": {"ppl": 10.0 + len(calls), "loss": 2.3}}}))
        (run_dir / "eval.jsonl").write_text(json.dumps({"step": 1, "kjv_ppl": 12.0}) + "\n")

    monkeypatch.setattr("mhmoe.train.loop.train", fake_train)
    res = reproduce.run_suite("v2-table5", out, seeds=2, progress=False)
    assert len(calls) == 8 and len(res) == 8
    assert {c[1] for c in calls} == {1337, 1338}  # seeds offset the preset's seed
    assert [c[1] for c in calls] == [1337] * 4 + [1338] * 4  # seed-major: whole seeds first
    again = reproduce.run_suite("v2-table5", out, seeds=2, progress=False)
    assert len(calls) == 8 and [r["eval"] for r in again] == [r["eval"] for r in res]
    md = (out / "results.md").read_text()
    assert "± " in md and "11.60" in md  # mean ± std over seeds, the paper's number beside ours
    assert (out / "results.csv").read_text().count("\n") == 9
    assert (out / "curves.png").stat().st_size > 0


def test_a_changed_config_is_another_run_and_an_old_folder_refuses_it(tmp_path, monkeypatch):
    out = tmp_path / "suite"  # the run store goes beside it, into tmp_path/store
    calls = []

    def fake_train(run, run_dir, resume=False, progress=True):
        calls.append(run.train.lr)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(run.to_yaml())
        (run_dir / "results.json").write_text(json.dumps({
            "preset": run.name, "step": 1, "params": 10, "fwd_flops_per_token": 5.0, "tokens_per_s": 1.0,
            "train_s": 1.0, "nan_skips": 0, "eval": {"kjv": {"ppl": 10.0, "loss": 2.3}}}))

    monkeypatch.setattr("mhmoe.train.loop.train", fake_train)
    reproduce.run_suite("v2-table5", out, seeds=1, progress=False)
    reproduce.run_suite("v2-table5", out, seeds=1, progress=False, overrides=["train.eval_batches=3"])  # bookkeeping
    assert len(calls) == 4
    reproduce.run_suite("v2-table5", out, seeds=1, progress=False, overrides=["train.lr=1e-4"])
    assert calls[4:] == [1e-4] * 4 and len(list((tmp_path / "store" / "records").glob("*.json"))) == 8
    # an older folder keeps its runs as OUT/<label>/seed<k>/: a different config there is refused
    row = reproduce.suite_rows("v2-table5")[0]
    fake_train(row.build("tiny"), reproduce._run_dir(tmp_path / "old", row.label, 0))
    with pytest.raises(ConfigError, match="train.lr"):
        reproduce.run_suite("v2-table5", tmp_path / "old", seeds=1, progress=False, overrides=["train.lr=1e-4"])


def test_report_only_trains_nothing_and_reports_finished_runs(tmp_path, monkeypatch, capsys):
    out = tmp_path / "suite"  # the run store goes beside it, into tmp_path/store
    calls = []

    def fake_train(run, run_dir, resume=False, progress=True):
        calls.append(run.name)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "results.json").write_text(json.dumps({
            "preset": run.name, "step": 1, "params": 10, "fwd_flops_per_token": 5.0, "tokens_per_s": 1.0,
            "train_s": 1.0, "nan_skips": 0, "eval": {"kjv": {"ppl": 20.0, "loss": 3.0}}}))

    monkeypatch.setattr("mhmoe.train.loop.train", fake_train)
    with pytest.raises(ConfigError):  # nothing finished yet
        reproduce.run_suite("v2-table5", out, progress=False, train_missing=False)
    assert main(["reproduce", "v2-table5", "--out", str(out), "--report-only", "--no-progress"]) == 2
    first = reproduce.suite_rows("v2-table5")[0]
    fake_train(first.build("tiny"), reproduce._run_dir(out, first.label, 0))
    calls.clear()
    res = reproduce.run_suite("v2-table5", out, progress=False, train_missing=False)
    assert calls == [] and [r["label"] for r in res] == [first.label]
    md = (out / "results.md").read_text()
    assert first.label in md and md.count("\n| ") == 2  # header + the one finished row


def _fake_trainer(calls):
    def fake_train(run, run_dir, resume=False, progress=True):
        calls.append((run.name, run.train.seed, run.model.moe.renormalize))
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(run.to_yaml())
        ppl = 100.0 + run.train.seed - 1337 + (5.0 if run.model.moe.renormalize is False else 0.0)
        (run_dir / "results.json").write_text(json.dumps({
            "preset": run.name, "step": 200, "params": 7_480_000, "fwd_flops_per_token": 6_690_000.0,
            "tokens_per_s": 4000.0, "train_s": 1.0, "nan_skips": 0,
            "eval": {"kjv": {"ppl": ppl, "loss": math.log(ppl)}}}))
    return fake_train


def test_summary_json_holds_the_printed_numbers_and_the_papers(tmp_path, monkeypatch):
    out = tmp_path / "suite"  # the run store goes beside it, into tmp_path/store
    monkeypatch.setattr("mhmoe.train.loop.train", _fake_trainer([]))
    reproduce.run_suite("v2-table4", out, seeds=3, progress=False)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["suite"] == "v2-table4" and summary["seeds"] == 3 and summary["validation_sets"] == ["kjv"]
    row = summary["rows"][-1]
    assert row["label"] == "MH-MoE (head=2)" and row["train_seeds"] == [1337, 1338, 1339]
    assert row["ppl"]["kjv"] == {"mean": 101.0, "std": 1.0, "per_seed": [100.0, 101.0, 102.0]}
    assert row["paper"] == {"RedPajama": 11.46, "Wiki": 9.98, "C4": 14.89}
    assert row["params_M"] == 7.48 and row["fwd_flops_per_token_M"] == 6.69
    md = (out / "results.md").read_text()
    assert "101.00 ± 1.00" in md and "11.46" in md
    assert "Table 4 prints 11.46" in md and "11.60" in md  # the paper's inconsistency is stated
    assert any("11.60" in n for n in summary["notes"])


def test_renorm_ablation_reuses_the_v2_table1_runs(tmp_path, monkeypatch):
    out = tmp_path / "suite"  # the run store goes beside it, into tmp_path/store
    calls = []
    monkeypatch.setattr("mhmoe.train.loop.train", _fake_trainer(calls))
    reproduce.run_suite("v2-table1", out, seeds=2, progress=False)
    assert len(calls) == 10 and all(c[2] is None for c in calls)
    calls.clear()
    res = reproduce.run_suite("renorm-ablation", out, seeds=2, progress=False)
    assert len(calls) == 6 and all(c[2] is False for c in calls)  # only the raw-weight rows are new
    assert len(res) == 14
    rows = {r["label"]: r for r in json.loads((out / "summary.json").read_text())["rows"]}
    assert rows["MH-MoE (head=3), raw top-k weights"]["ppl"]["kjv"]["mean"] == 105.5
    assert rows["MH-MoE (head=3)"]["ppl"]["kjv"]["mean"] == 100.5


def test_rows_selects_a_subset_of_the_table(tmp_path, monkeypatch, capsys):
    out = tmp_path / "suite"  # the run store goes beside it, into tmp_path/store
    calls = []
    monkeypatch.setattr("mhmoe.train.loop.train", _fake_trainer(calls))
    res = reproduce.run_suite("icml-table1", out, only=["X-MoE (8 experts)", "MH-MoE (8 experts)"], seeds=1,
                              progress=False)
    assert [r["label"] for r in res] == ["X-MoE (8 experts)", "MH-MoE (8 experts)"] and len(calls) == 2
    assert main(["reproduce", "icml-table1", "--out", str(out), "--rows", "X-MoE (8 experts)",
                 "--report-only"]) == 0
    assert "MH-MoE (8 experts)" not in (out / "results.md").read_text()
    assert main(["reproduce", "icml-table1", "--out", str(out), "--rows", "X-MoE (9 experts)"]) == 2
    assert "--rows" in capsys.readouterr().err


def test_first_seed_trains_and_reports_a_fresh_set_of_seeds(tmp_path, monkeypatch, capsys):
    out, calls = tmp_path / "suite", []
    monkeypatch.setattr("mhmoe.train.loop.train", _fake_trainer(calls))
    rows = ["SMoE", "MH-MoE (head=3)"]
    kjv = ["data.corpus=kjv"]  # a corpus every install has
    reproduce.run_suite("decisive", out, seeds=2, only=rows, overrides=kjv, progress=False)
    assert [c[1] for c in calls] == [1337, 1337, 1338, 1338]
    res = reproduce.run_suite("decisive", out, seeds=3, first_seed=2, only=rows, overrides=kjv, progress=False)
    assert [c[1] for c in calls[4:]] == [1339, 1339, 1340, 1340, 1341, 1341]  # seeds 2-4, seed-major
    assert [r["seed"] for r in res] == [2, 2, 3, 3, 4, 4]  # the report holds the fresh seeds only
    summary = json.loads((out / "summary.json").read_text())
    assert summary["seeds"] == 3 and summary["rows"][0]["train_seeds"] == [1339, 1340, 1341]
    assert "Seeds per row: 3." in (out / "results.md").read_text()
    argv = ["reproduce", "decisive", "--out", str(out), "--data", "kjv", "--report-only"]
    argv += [a for r in rows for a in ("--rows", r)]
    assert main(argv + ["--seeds", "2"]) == 0  # seeds 0-1 again, from the store
    assert json.loads((out / "summary.json").read_text())["rows"][0]["train_seeds"] == [1337, 1338]
    assert main(argv + ["--seeds", "1", "--first-seed", "4"]) == 0 and len(calls) == 10
    assert json.loads((out / "summary.json").read_text())["rows"][0]["train_seeds"] == [1341]
    assert main(argv + ["--first-seed", "-1"]) == 2
    assert "--first-seed" in capsys.readouterr().err


def test_status_counts_the_planned_runs_without_their_results(tmp_path, monkeypatch, capsys):
    out, calls = tmp_path / "suite", []
    monkeypatch.setattr("mhmoe.train.loop.train", _fake_trainer(calls))
    rows, kjv = ["SMoE", "MH-MoE (head=3)"], ["data.corpus=kjv"]
    reproduce.run_suite("decisive", out, seeds=2, first_seed=1, only=rows, overrides=kjv, progress=False)
    plan = reproduce._plan("decisive", out, "tiny", 4, None, kjv, rows, None, 0).plan  # seeds 0-3, seed-major
    store = reproduce.RunStore(tmp_path / "store")
    interrupted, training = (store.run_dir(reproduce.run_key(p.run)) for p in plan[6:])  # both rows of seed 3
    interrupted.mkdir(parents=True)
    training.mkdir(parents=True)
    monkeypatch.setattr(reproduce, "_locked", lambda run_dir: run_dir == training)
    status = reproduce.suite_status("decisive", out, seeds=4, only=rows, overrides=kjv)
    assert status == {"SMoE": {"finished": [1, 2], "training": [], "interrupted": [3], "to_train": [0]},
                      "MH-MoE (head=3)": {"finished": [1, 2], "training": [3], "interrupted": [], "to_train": [0]}}
    calls.clear()
    argv = ["reproduce", "decisive", "--out", str(out), "--data", "kjv", "--seeds", "4", "--status"]
    argv += [a for r in rows for a in ("--rows", r)]
    assert main(argv) == 0 and calls == []
    text = capsys.readouterr().out
    assert "decisive: 4 of 8 planned runs finished (results are not shown)" in text
    assert "SMoE             finished 2  training 0  interrupted 1  to train 1  (interrupted: seed 3)" in text
    assert "MH-MoE (head=3)  finished 2  training 1  interrupted 0  to train 1  (training: seed 3)" in text
    assert "ppl" not in text and "100" not in text  # no result of a finished run
    assert main(argv + ["--json"]) == 0 and json.loads(capsys.readouterr().out) == {"decisive": status}
    assert main(argv + ["--report-only"]) == 2 and "--report-only" in capsys.readouterr().err
    assert main([a for a in argv if a != "--status"] + ["--json"]) == 2 and "--json" in capsys.readouterr().err
    assert main(argv + ["--minutes", "5"]) == 2 and "--status calibrates nothing" in capsys.readouterr().err
    assert calls == [] and not (out / "budget.json").exists()


def _model_key(run):
    """What a row computes: the model config without its name."""
    return repr({k: v for k, v in run.to_dict().items() if k != "name"})


@pytest.mark.parametrize("suite", sorted(reproduce.SUITES))
def test_no_two_rows_of_a_suite_build_the_same_model(suite):
    keys = [_model_key(row.build("tiny")) for row in reproduce.suite_rows(suite)]
    assert len(set(keys)) == len(keys), suite


def test_v2_table4_head_merge_rows_are_resized_and_the_added_reading_is_not():
    resized = {r.label: r.build("tiny").model.moe for r in reproduce.suite_rows("v2-table4")}
    added = {r.label: r.build("tiny").model.moe for r in reproduce.suite_rows("v2-table4-added-flops")}
    hm = resized["SMoE + head & merge"]
    assert hm.head_layer and hm.merge_layer and (hm.n_experts, hm.d_expert, hm.top_k) == (10, 384, 1)
    fg = resized["Fine-grained SMoE + head & merge"]
    assert (fg.n_experts, fg.d_expert, fg.top_k) == (21, 192, 2)
    plain = added["SMoE + head & merge (added)"]
    assert (plain.n_experts, plain.d_expert, plain.head_layer) == (8, 512, True)
    # the added reading is above the SMoE's FLOPs by the two d x d layers: not in a parity group
    assert all(r.parity_group is None for r in reproduce.suite_rows("v2-table4-added-flops") if "added" in r.label)


def test_v2_table5_removes_layers_by_default_and_replans_them_in_the_parity_suite():
    paper = {r.label: r.build("tiny").model.moe for r in reproduce.suite_rows("v2-table5")}
    parity = {r.label: r.build("tiny").model.moe for r in reproduce.suite_rows("v2-table5-parity")}
    off = "head ✗ merge ✗"
    assert (paper[off].n_experts, paper[off].d_expert) == (41, 192)  # mh2 with the layers removed
    assert (parity[off].n_experts, parity[off].d_expert) == (32, 256)  # re-planned: v2 Table 4's w/o-h&m model
    assert reproduce.suite_rows("v2-table5")[0].note  # the table says so


def test_icml_table6_has_the_papers_rows_once():
    labels = [r.label for r in reproduce.suite_rows("icml-table6")]
    assert labels == ["Dense", "Dense w/ MLP", "X-MoE", "X-MoE w/ MLP = MH-MoE w/o TS", "MH-MoE w/o MLP", "MH-MoE"]
    mlp = reproduce.suite_rows("icml-table6")[1].build("tiny").model.moe
    assert (mlp.n_experts, mlp.top_k, mlp.head_layer, mlp.merge_layer) == (1, 1, True, True)


def test_summary_marks_separated_pairs(tmp_path, monkeypatch):
    out = tmp_path / "suite"  # the run store goes beside it, into tmp_path/store
    monkeypatch.setattr("mhmoe.train.loop.train", _fake_trainer([]))
    reproduce.run_suite("renorm-ablation", out, seeds=2, progress=False)
    summary = json.loads((out / "summary.json").read_text())
    pairs = {(c["a"], c["b"]): c for c in summary["comparisons"]}
    raw = pairs[("Fine-grained SMoE", "Fine-grained SMoE, raw top-k weights")]
    # fake perplexities: 100/101 (renormalised) vs 105/106 (raw): seed for seed, ln(100/105) and ln(101/106)
    assert raw["separated"] and raw["lower"] == "Fine-grained SMoE" and raw["ppl_mean_diff"] == 5.0
    assert raw["mean_diff"] == pytest.approx((math.log(100 / 105) + math.log(101 / 106)) / 2)
    assert raw["n"] == 2 and raw["p_sign_flip"] == 0.5 and raw["p_min"] == 0.5
    same = pairs[("SMoE", "Fine-grained SMoE")]
    assert not same["separated"] and same["mean_diff"] == 0.0
    primary = pairs[("MH-MoE (head=3)", "MH-MoE (head=3), raw top-k weights")]  # the suite's primary order
    assert primary["primary"] and primary["mean_diff"] < 0
    sep = summary["separation"]
    assert sep["compared"] == len(summary["comparisons"]) == 21 and sep["expected_by_chance"] == 1.05
    assert sep["separated"] == sum(c["separated"] for c in summary["comparisons"])
    md = (out / "results.md").read_text()
    assert f"{sep['separated']} of 21 pairs compared, 1.05 expected by chance" in md
    assert "kjv: Fine-grained SMoE < Fine-grained SMoE, raw top-k weights" in md
    assert "Primary comparison (kjv validation loss" in md and "MH-MoE (head=3) - MH-MoE (head=3), raw" in md
