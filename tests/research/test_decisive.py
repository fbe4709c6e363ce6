"""The decisive suite and what every suite now keeps: the run store (each config x seed x budget trained
once, across suites), run records, per-seed evaluation curves, epochs, the environment, two processes on
one folder, and a real tiny run of the decisive suite end to end."""

import json
import threading
import time

import pytest

from mhmoe.cli import main
from mhmoe.errors import ConfigError
from mhmoe.research import reproduce
from mhmoe.research.store import RunStore, run_key
from mhmoe.research.suites import DECISIVE_CORPUS, suite_settings


def _fake_trainer(calls, lock=False):
    """A trainer that writes a finished run (eval.jsonl with one evaluation per eval_every steps)."""
    def fake_train(run, run_dir, resume=False, progress=True):
        from contextlib import nullcontext

        from mhmoe.train.lock import RunDirLock

        with RunDirLock(run_dir) if lock else nullcontext():
            calls.append((run.name, run.train.seed, run.train.max_steps, str(run_dir)))
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.yaml").write_text(run.to_yaml())
            steps, every = run.train.max_steps, run.train.eval_every or run.train.max_steps
            loss = 5.0 - 0.001 * (run.train.seed - 1337) - (0.01 if run.model.moe.heads == 3 else 0.0)
            evals = [s for s in range(every, steps, every)] + [steps]
            (run_dir / "eval.jsonl").write_text("".join(
                json.dumps({"step": s, "kjv_ppl": 2.718 ** (loss + 1 / s), "kjv_loss": loss + 1 / s}) + "\n"
                for s in evals))
            (run_dir / "results.json").write_text(json.dumps({
                "preset": run.name, "step": steps, "params": 7_480_000, "fwd_flops_per_token": 7_480_000.0,
                "tokens_per_s": 1000.0, "train_s": 1.0, "nan_skips": 0,
                "eval": {"kjv": {"ppl": 2.718 ** (loss + 1 / steps), "loss": loss + 1 / steps}}}))
    return fake_train


def test_the_decisive_suite_is_v2_table1s_primary_pair_on_the_big_corpus():
    rows = {r.label: r.build("tiny") for r in reproduce.suite_rows("decisive")}
    assert list(rows) == ["Dense", "SMoE", "MH-MoE (head=3)"]
    v2 = {r.label: r.build("tiny") for r in reproduce.suite_rows("v2-table1")}
    for label, run in rows.items():
        assert run.data.corpus == DECISIVE_CORPUS == "debdocs" and run.data.val_sets == ()
        assert run.model == v2[label].model and run.train == v2[label].train  # the v2 Table 1 rows' builders
    st = suite_settings("decisive")
    assert st.primary == (("MH-MoE (head=3)", "SMoE"),) and st.max_epochs == 1.0 and st.curve_points == 10
    assert reproduce.seeds_per_row("decisive", reproduce.suite_rows("decisive"), None) == {
        "Dense": 3, "SMoE": 5, "MH-MoE (head=3)": 5}
    pilot = reproduce.suite_rows("decisive-pilot")
    assert [r.label for r in pilot] == ["SMoE", "MH-MoE (head=3)"]
    assert suite_settings("decisive-pilot").curve_points == 20
    assert reproduce.seeds_per_row("decisive-pilot", pilot, None) == {"SMoE": 3, "MH-MoE (head=3)": 3}
    for name, st in reproduce.SETTINGS.items():  # every suite names its primary pairs among its rows
        labels = {r.label for r in reproduce.suite_rows(name)}
        assert st.primary and all(a in labels and b in labels for a, b in st.primary), name


def test_decisive_refuses_more_than_one_epoch_and_other_suites_warn_past_two(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr("mhmoe.train.loop.train", _fake_trainer(calls))
    # the fixture's corpus has 875,290 training tokens: 214 steps of 4,096 are one epoch
    args = ["reproduce", "decisive", "--out", str(tmp_path / "d"), "--data", "kjv", "--no-progress"]
    assert main(args + ["--tokens", "1000000"]) == 2
    assert "at most 1 epoch(s) of kjv" in capsys.readouterr().err and calls == []
    reproduce.run_suite("v2-table5", tmp_path / "t5", seeds=1, tokens=2_000_000, progress=False,
                        only=["head ✓ merge ✓"])
    err = capsys.readouterr().err
    assert err.count("warning: v2-table5: runs train 2.3 epochs of kjv") == 1
    summary = json.loads((tmp_path / "t5" / "summary.json").read_text())
    assert summary["rows"][0]["epochs"] == [round(488 * 4096 / 875_290, 4)]
    md = (tmp_path / "t5" / "results.md").read_text()
    assert "Epochs of the training corpus (875,290 tokens) per run: 2.28" in md


def test_a_model_shared_by_three_suites_trains_once(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr("mhmoe.train.loop.train", _fake_trainer(calls))
    root = tmp_path / "reproduce"  # the suites side by side share root/store
    reproduce.run_suite("v2-table1", root / "v2-table1-tiny", seeds=2, progress=False, only=["MH-MoE (head=2)"])
    reproduce.run_suite("v2-table4", root / "v2-table4-tiny", seeds=2, progress=False, only=["MH-MoE (head=2)"])
    reproduce.run_suite("v2-table5", root / "v2-table5-tiny", seeds=2, progress=False, only=["head ✓ merge ✓"])
    assert len(calls) == 2  # seeds 0 and 1, once
    t5 = json.loads((root / "v2-table5-tiny" / "results.json").read_text())
    t1 = json.loads((root / "v2-table1-tiny" / "results.json").read_text())
    assert [r["key"] for r in t5["runs"]] == [r["key"] for r in t1["runs"]]
    assert [r["label"] for r in t5["runs"]] == ["head ✓ merge ✓"] * 2
    reproduce.run_suite("v2-table1", root / "v2-table1-tiny", seeds=2, tokens=409_600, progress=False,
                        only=["MH-MoE (head=2)"])
    assert len(calls) == 4  # another budget is another run


def test_results_keep_curves_epochs_and_the_environment(tmp_path, monkeypatch):
    monkeypatch.setattr("mhmoe.train.loop.train", _fake_trainer([]))
    out = tmp_path / "suite"
    reproduce.run_suite("decisive", out, seeds=2, tokens=409_600, overrides=["data.corpus=kjv"], progress=False)
    data = json.loads((out / "results.json").read_text())
    run = data["runs"][0]
    assert [p["step"] for p in run["curve"]] == list(range(10, 101, 10))  # 100 steps, 10 evaluations
    assert run["curve"][0]["tokens"] == 40_960 and set(run["curve"][0]["loss"]) == {"kjv"}
    assert run["epochs"] == round(409_600 / 875_290, 4) and run["train_tokens"] == 875_290
    assert run["environment"]["machine"]["cpu"] and "torch" in run["environment"]["versions"]
    env = data["environment"]
    assert set(env) >= {"machine", "threads", "torch_default_threads", "versions", "git", "command", "date"}
    assert set(env["versions"]) >= {"torch", "triton", "numpy", "python"} and isinstance(env["machine"]["isa"], list)
    assert env["git"] is None or len(env["git"]["commit"]) == 40
    summary = json.loads((out / "summary.json").read_text())
    assert summary["environment"] == env and summary["primary"] == [["MH-MoE (head=3)", "SMoE"]]
    assert summary["corpus"] == [{"name": "kjv", "train_tokens": 875_290, "tokenizer": "0123456789abcdef",
                                  "seeds": {"Dense": [0, 1], "SMoE": [0, 1], "MH-MoE (head=3)": [0, 1]}}]
    main_pair = next(c for c in summary["comparisons"] if c["primary"])
    assert (main_pair["a"], main_pair["b"], main_pair["n"]) == ("MH-MoE (head=3)", "SMoE", 2)
    assert main_pair["mean_diff"] == pytest.approx(-0.01) and main_pair["p_min"] == 0.5
    md = (out / "results.md").read_text()
    assert "Primary comparison (kjv validation loss" in md and "Reported on:" in md and "| seeds |" in md
    assert f"({len(data['runs'])} runs)" in md.split("Trained on: ")[1].split("\n")[0]


def test_provenance_outside_a_checkout_and_the_command_line(tmp_path, monkeypatch):
    from mhmoe.research import provenance

    assert provenance.git_commit(tmp_path) is None  # not a checkout: no commit, no failure
    monkeypatch.setattr("sys.argv", ["/x/bin/mhmoe", "reproduce", "decisive", "--rows", "MH-MoE (head=3)"])
    env = provenance.environment(["cpu"], 1)
    assert env["command"] == "mhmoe reproduce decisive --rows 'MH-MoE (head=3)'" and env["threads"] == 1
    assert "thread(s) per run" in provenance.describe(env)
    assert "thread" not in provenance.describe(env, threads=False)


def test_the_report_names_the_runs_machines_not_the_reporting_process():
    """The threads, machine and torch of the runs come from their own records (a --report-only process runs with
    torch's default thread count, not the runs' train.threads)."""
    from mhmoe.research import provenance

    def env(threads: int, cpu: str = "Xeon", commit: str = "a" * 40) -> dict:
        return {"machine": {"cpu": cpu, "isa": ["amx_bf16"]}, "threads": threads, "torch_default_threads": 2,
                "versions": {"torch": "2.13.0"}, "git": {"commit": commit, "dirty": False}}

    line = provenance.describe_runs([env(1), env(1, commit="b" * 40), env(2), None, env(1, cpu="EPYC")])
    assert line == ("Xeon (amx_bf16), 1 thread(s) per run, torch 2.13.0 (2 runs); "
                    "Xeon (amx_bf16), 2 thread(s) per run, torch 2.13.0 (1 run); "
                    "EPYC (amx_bf16), 1 thread(s) per run, torch 2.13.0 (1 run); 1 run without a recorded machine")


def test_records_elsewhere_report_without_the_run_directories(tmp_path, monkeypatch):
    """Records committed to the repository complete a suite on another machine."""
    calls = []
    monkeypatch.setattr("mhmoe.train.loop.train", _fake_trainer(calls))
    out, recs = tmp_path / "suite", tmp_path / "committed"
    reproduce.run_suite("v2-table5", out, seeds=1, progress=False, records=recs)
    assert len(list(recs.glob("*.json"))) == 4 and not (tmp_path / "store" / "records").exists()
    other = tmp_path / "elsewhere"  # no run directories, only the records
    res = reproduce.run_suite("v2-table5", other / "suite", seeds=1, progress=False, records=recs, train_missing=False)
    assert len(res) == 4 and len(calls) == 4 and not (other / "store").exists()
    assert (other / "suite" / "curves.png").stat().st_size > 0
    for f in recs.glob("*.json"):
        rec = json.loads(f.read_text())
        assert f.stem == rec["key"] and "train.eval_every" not in rec["identity"] and rec["environment"]
    first = reproduce.select_rows("v2-table5")[0].build("tiny")  # eval_every is bookkeeping: the same key
    (recs / f"{run_key(first)}.json").write_text("{not json")
    assert RunStore(tmp_path / "store", recs).load_record(first) is None  # reported in one line, ignored


def test_two_processes_on_one_folder_take_turns(tmp_path, monkeypatch):
    """A run another process is training is skipped, then waited for; when its lock goes without a record
    (the other process died), this one trains it."""
    from mhmoe.train.lock import RunDirLock

    calls = []
    monkeypatch.setattr("mhmoe.train.loop.train", _fake_trainer(calls, lock=True))
    monkeypatch.setattr(reproduce, "WAIT_POLL_S", 0.05)
    out = tmp_path / "suite"
    first = reproduce.select_rows("v2-table5")[0]
    run = reproduce._resolver("v2-table5", {first.label: first.build("tiny")}, [])(first.label, None, 0)
    held = RunStore(tmp_path / "store").run_dir(run_key(run))
    taken = threading.Event()

    def other_process():  # holds the run's lock for a second, then ends without finishing it
        with RunDirLock(held):
            taken.set()
            time.sleep(1.0)

    thread = threading.Thread(target=other_process)
    thread.start()
    taken.wait(10)
    t0 = time.perf_counter()
    res = reproduce.run_suite("v2-table5", out, seeds=1, progress=False)
    thread.join()
    assert time.perf_counter() - t0 >= 0.9
    assert [c[3] for c in calls][-1] == str(held) and len(calls) == 4  # the held run came last
    assert [r["label"] for r in res] == [r.label for r in reproduce.suite_rows("v2-table5")]  # table order


@pytest.mark.real_train_tokens
def test_decisive_trains_for_real_on_a_small_corpus(tmp_path, capsys):
    """A tiny real run: the loop's evaluations become its record's curve, the epochs are counted on the
    real corpus."""
    out = tmp_path / "suite"
    small = ["train.batch_size=2", "train.seq_len=32", "train.eval_batches=1", "train.threads=1", "model.n_layers=2"]
    args = ["reproduce", "decisive", "--data", "kjv", "--out", str(out), "--seeds", "1", "--tokens", "256",
            "--rows", "SMoE", "--no-progress"] + [a for s in small for a in ("--set", s)]
    assert main(args) == 0
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    assert [p["step"] for p in run["curve"]] == [1, 2, 3, 4] and run["curve"][-1]["tokens"] == 256
    assert run["curve"][-1]["loss"]["kjv"] == pytest.approx(run["eval"]["kjv"]["loss"])
    assert 0 < run["epochs"] < 0.001 and run["train_tokens"] > 800_000
    with pytest.raises(ConfigError):
        reproduce.run_suite("decisive", out, seeds=1, tokens=256, overrides=small + ["data.corpus=kjv"],
                            progress=False, only=["Dense"], train_missing=False)


def test_seeds_pair_only_within_one_data_version(tmp_path, monkeypatch):
    """Records from machines whose corpus packages differ (other training tokens, another tokenizer) are kept
    and shown, but a seed whose two runs saw different data is left out of the paired comparison."""
    calls = []
    monkeypatch.setattr("mhmoe.train.loop.train", _fake_trainer(calls))
    out, recs = tmp_path / "suite", tmp_path / "records"
    reproduce.run_suite("decisive-pilot", out, seeds=3, progress=False, records=recs)
    rec = json.loads(next(recs.glob("*.json")).read_text())
    assert rec["data"] == {"train_tokens": 875_290, "tokenizer": "0123456789abcdef"} and rec["train_tokens"] == 875_290
    summary = json.loads((out / "summary.json").read_text())
    (main_cmp,) = [c for c in summary["comparisons"] if c["primary"]]
    assert main_cmp["n"] == 3 and "unpaired_seeds" not in main_cmp and len(summary["corpus"]) == 1
    for seed, data in ((1, {"train_tokens": 875_290, "tokenizer": "fedcba9876543210"}),  # same size, other BPE
                       (2, None)):  # an older record: its training tokens only
        path = next(p for p in recs.glob("*.json")
                    if json.loads(p.read_text())["identity"]["train.seed"] == 1337 + seed
                    and json.loads(p.read_text())["identity"]["model.moe.heads"] == 3)
        r = json.loads(path.read_text())
        r["data"] = data
        r["train_tokens"] = 875_290 if data else 870_000
        path.write_text(json.dumps(r))
    reproduce.run_suite("decisive-pilot", out, seeds=3, progress=False, records=recs, train_missing=False)
    summary = json.loads((out / "summary.json").read_text())
    (main_cmp,) = [c for c in summary["comparisons"] if c["primary"]]
    assert main_cmp["n"] == 1 and main_cmp["unpaired_seeds"] == [1, 2]
    assert len(summary["corpus"]) == 3
    md = (out / "results.md").read_text()
    assert "3 versions of their data" in md and "seeds 1, 2 left out" in md
    assert "Epochs of the training corpus (870,000-875,290 tokens)" in md
