"""CLI smoke tests through ``mhmoe.cli.main``: train (from a YAML config), resume, eval, generate and
compare on a tiny model; bad input exits 2 with a one-line message on stderr."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from helpers import load_script

from mhmoe.cli import main
from mhmoe.config.data import DataConfig
from mhmoe.config.model import ModelConfig
from mhmoe.config.moe import MoEConfig
from mhmoe.config.presets import get_preset
from mhmoe.config.run import RunConfig
from mhmoe.config.train import TrainConfig

WORDS = "in the beginning was the word and light dark water earth heaven man made said god day night".split()



def _write_corpus(root: Path, n_docs: int = 12, seed: int = 0) -> Path:
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n_docs):
        (root / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(250)) + "\n")
    return root


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A corpus directory, an extra validation file and a tiny MH-MoE YAML config."""
    root = tmp_path_factory.mktemp("cli")
    corpus = _write_corpus(root / "corpus")
    extra = root / "psalms.txt"
    rng = random.Random(1)
    extra.write_text(" ".join(rng.choice(WORDS) for _ in range(300)) + "\n")
    run = RunConfig(
        name="tiny-cli",
        model=ModelConfig(vocab_size=0, d_model=48, n_layers=2, n_heads=4, d_ff=64, max_seq_len=64,
                          moe=MoEConfig(n_experts=6, top_k=3, d_expert=16, heads=3, head_layer=True,
                                        merge_layer=True)),
        train=TrainConfig(max_steps=100, batch_size=4, seq_len=32, log_every=1, eval_batches=2, warmup_steps=1,
                          lr=1e-3, dtype="float32", device="cpu", threads=1, ckpt_every=0),
        data=DataConfig(corpus=str(corpus), tokenizer="byte", val_sets=(str(extra),), val_tokens=512,
                        cache_dir=str(root / "cache")),
    )
    config = root / "tiny.yaml"
    config.write_text(run.to_yaml())
    return {"root": root, "corpus": corpus, "config": config}


@pytest.fixture(scope="module")
def trained(setup):
    """`mhmoe train --config tiny.yaml --out RUN --max-steps 4` (run once for the module)."""
    out = setup["root"] / "run"
    threads = torch.get_num_threads()
    rc = main(["train", "--config", str(setup["config"]), "--out", str(out), "--max-steps", "4", "--no-progress"])
    torch.set_num_threads(threads)
    assert rc == 0
    return out


def _one_line_error(capsys, prefix: str = "mhmoe ") -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(prefix), err
    return err


# ---- train / eval / generate ------------------------------------------------------------------------------------
def test_train_writes_the_run(trained):
    summary = json.loads((trained / "results.json").read_text())
    assert summary["preset"] == "tiny-cli" and summary["step"] == 4
    assert set(summary["eval"]) == {"corpus", "psalms"}
    assert len((trained / "metrics.jsonl").read_text().splitlines()) == 4
    assert (trained / "checkpoints" / "step_00000004" / "meta.json").is_file()
    assert RunConfig.load(trained / "config.yaml").train.max_steps == 4  # --max-steps applied


def test_train_json_summary_and_set_overrides(setup, tmp_path, capsys):
    out = tmp_path / "r"
    rc = main(["train", "--config", str(setup["config"]), "--out", str(out), "--max-steps", "2", "--no-progress",
               "--set", "train.lr=2e-3", "--set", "model.moe.top_k=2", "--json"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["step"] == 2 and summary["params"] > 0 and "psalms" in summary["eval"]
    saved = RunConfig.load(out / "config.yaml")
    assert saved.train.lr == 2e-3 and saved.model.moe.top_k == 2


def test_train_data_flag_overrides_the_corpus(setup, tmp_path, capsys):
    other = _write_corpus(tmp_path / "other", n_docs=6, seed=5)
    rc = main(["train", "--config", str(setup["config"]), "--out", str(tmp_path / "r"), "--max-steps", "1",
               "--data", str(other), "--no-progress"])
    assert rc == 0
    assert RunConfig.load(tmp_path / "r" / "config.yaml").data.corpus == str(other)
    assert "step 1" in capsys.readouterr().out


def test_train_refuses_existing_run_then_resumes(setup, trained, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    before = (run / "metrics.jsonl").read_text()
    argv = ["train", "--config", str(setup["config"]), "--out", str(run), "--max-steps", "6", "--no-progress"]
    assert main(argv) == 2
    assert "--resume" in _one_line_error(capsys, "mhmoe train: error:")
    assert (run / "metrics.jsonl").read_text() == before
    assert main(argv + ["--resume"]) == 0
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(ln)["step"] for ln in lines] == [1, 2, 3, 4, 5, 6]
    assert lines[:4] == before.splitlines()


def test_resume_keeps_the_runs_activation_checkpointing_unless_given(setup, trained, tmp_path, capsys):
    """``--set train.activation_checkpointing=`` on a resume changes it (a launch property: same results, less
    memory); a later resume without it keeps the run's setting instead of the command's default."""
    from mhmoe.loading.checkpoint import load_latest

    run = tmp_path / "run"
    shutil.copytree(trained, run)
    argv = ["train", "--config", str(setup["config"]), "--out", str(run), "--resume", "--no-progress"]
    assert main(argv + ["--max-steps", "5", "--set", "train.activation_checkpointing=moe"]) == 0
    assert "activation checkpointing: moe" in capsys.readouterr().err
    assert main(argv + ["--max-steps", "6"]) == 0
    assert "activation checkpointing: moe" in capsys.readouterr().err
    assert load_latest(run).run.train.activation_checkpointing == "moe"


def test_eval_json(trained, capsys):
    assert main(["eval", "--checkpoint", str(trained), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["step"] == 4 and res["checkpoint"].endswith("step_00000004")
    assert set(res["eval"]) == {"corpus", "psalms"}
    for r in res["eval"].values():
        assert 1 < r["ppl"] < 257 and r["tokens"] > 0
    results = json.loads((trained / "results.json").read_text())
    for name, r in res["eval"].items():  # same windows as the end-of-training evaluation
        assert r["loss"] == pytest.approx(results["eval"][name]["loss"], rel=1e-5)


def test_eval_text_and_batches(trained, capsys):
    ckpt = trained / "checkpoints" / "step_00000004"
    assert main(["eval", "--checkpoint", str(ckpt), "--batches", "1"]) == 0
    out = capsys.readouterr().out
    assert "step 4" in out and "psalms" in out and "ppl" in out


def test_generate(trained, capsys):
    argv = ["generate", "--checkpoint", str(trained), "--prompt", "In the beginning", "--max-new-tokens", "5"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert text.startswith("In the beginning")
    assert main(argv + ["--temperature", "0"]) == 0
    greedy = capsys.readouterr().out
    assert main(argv + ["--temperature", "0"]) == 0
    assert capsys.readouterr().out == greedy  # greedy is deterministic
    assert main(argv + ["--seed", "3"]) == 0 and main(argv + ["--seed", "3"]) == 0
    a, b = capsys.readouterr().out.splitlines()[:2]
    assert a == b  # seeded sampling is reproducible


# ---- bad input: exit 2, one line on stderr ------------------------------------------------------------------------
@pytest.fixture
def bad_files(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "binary.txt").write_bytes(bytes(range(256)) * 8)
    (tmp_path / "bad.yaml").write_text("model: [\n")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    return tmp_path


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--data", "{tmp}/missing.txt"], "no such file"),
        (["--data", "{tmp}/empty.txt"], "empty"),
        (["--data", "{tmp}/binary.txt"], "binary"),
        (["--set", "train.lrr=1e-3"], "train.lrr"),
        (["--set", "train.lr=-1"], "train.lr"),
        (["--set", "train.lr"], "key=value"),
        (["--set", "train.lr=[1"], "train.lr"),
        (["--set", "model.n_heads=5"], "model.n_heads"),
        (["--set", "model.moe.top_k=99"], "model.moe.top_k"),
        (["--set", "data.tokenizer=nope"], "data.tokenizer"),
        (["--max-steps", "0"], "train.max_steps"),
    ],
)
def test_train_bad_input_exits_2(setup, bad_files, tmp_path, capsys, args, needle):
    out = tmp_path / "out"
    args = [a.replace("{tmp}", str(bad_files)) for a in args]
    rc = main(["train", "--config", str(setup["config"]), "--out", str(out), "--no-progress", *args])
    assert rc == 2
    err = _one_line_error(capsys, "mhmoe train: error:")
    assert needle in err
    assert not out.exists()  # nothing was created


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["train", "--preset", "tiny-nope", "--out", "{tmp}/o"], "preset"),
        (["train", "--config", "{tmp}/missing.yaml", "--out", "{tmp}/o"], "missing.yaml"),
        (["train", "--config", "{tmp}/bad.yaml", "--out", "{tmp}/o"], "YAML"),
        (["train", "--config", "{tmp}/list.yaml", "--out", "{tmp}/o"], "config"),
        (["eval", "--checkpoint", "{tmp}/no-run"], "no such"),
        (["eval", "--checkpoint", "{tmp}"], "no checkpoints"),
        (["generate", "--checkpoint", "{tmp}/no-run", "--prompt", "x"], "no such"),
        (["compare", "--presets", "tiny-smoe", "tiny-nope", "--out", "{tmp}/o"], "tiny-nope"),
        (["presets", "--show", "tiny-nope"], "tiny-nope"),
    ],
)
def test_other_bad_input_exits_2(bad_files, capsys, argv, needle):
    argv = [a.replace("{tmp}", str(bad_files)) for a in argv]
    assert main(argv) == 2
    assert needle in _one_line_error(capsys)
    assert not (bad_files / "o").exists()


@pytest.mark.parametrize("extra, needle", [(["--prompt", ""], "--prompt"),
                                           (["--prompt", "x", "--top-p", "0"], "top-p"),
                                           (["--prompt", "x", "--max-new-tokens", "0"], "max-new-tokens"),
                                           (["--prompt", "x", "--temperature", "-1"], "temperature")])
def test_generate_bad_input_exits_2(trained, capsys, extra, needle):
    assert main(["generate", "--checkpoint", str(trained), *extra]) == 2
    assert needle in _one_line_error(capsys, "mhmoe generate: error:")


def test_eval_all_checkpoints_corrupt_exits_2(trained, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    w = run / "checkpoints" / "step_00000004" / "model.safetensors"
    w.write_bytes(w.read_bytes()[:100])
    assert main(["eval", "--checkpoint", str(run)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "truncated" in err[0] and err[1].startswith("mhmoe eval: error:")


def test_argparse_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        main(["train"])  # --out missing
    assert info.value.code == 2 and "--out" in _one_line_error(capsys, "mhmoe train: error:")
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in _one_line_error(capsys, "mhmoe: error:")
    assert main([]) == 2


def test_diverging_run_exits_1(setup, tmp_path, capsys):
    rc = main(["train", "--config", str(setup["config"]), "--out", str(tmp_path / "r"), "--max-steps", "20",
               "--no-progress", "--set", "train.lr=1e30", "--set", "train.warmup_steps=0",
               "--set", "train.max_nan_skips=1"])
    assert rc == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("mhmoe train: stopping:") and "max_nan_skips=1" in err[-1]


# ---- compare --------------------------------------------------------------------------------------------------------
def test_compare_two_tiny_presets(setup, tmp_path, capsys):
    """`compare` on two real tiny presets, shrunk with --set to a couple of 64-token steps."""
    sets = ["train.batch_size=2", "train.seq_len=32", "train.eval_batches=1", "train.ckpt_every=0",
            "train.log_every=1", "train.warmup_steps=0", "train.threads=1", "train.dtype=float32", "train.device=cpu",
            "data.tokenizer=byte", "data.val_sets=[]", "data.val_tokens=256", f"data.cache_dir={tmp_path}/cache",
            "model.max_seq_len=32"]
    argv = ["compare", "--presets", "tiny-dense", "tiny-mh3", "--out", str(tmp_path / "cmp"), "--max-steps", "2",
            "--data", str(setup["corpus"]), "--no-progress"]
    for s in sets:
        argv += ["--set", s]
    assert main(argv + ["--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    rows = {r["label"]: r for r in res["runs"]}
    assert set(rows) == {"tiny-dense", "tiny-mh3"}
    for name, r in rows.items():
        assert r["step"] == 2 and "corpus" in r["eval"] and r["fwd_flops_per_token"] > 0 and r["preset"] == name
        assert Path(r["run_dir"]) == tmp_path / "cmp" / name / "seed0"  # the suite layout
    assert rows["tiny-mh3"]["params"] > rows["tiny-dense"]["params"]
    for f in ("results.md", "results.csv", "results.json", "curves.png"):
        assert (tmp_path / "cmp" / f).stat().st_size > 0, f
    saved = json.loads((tmp_path / "cmp" / "results.json").read_text())
    assert [m["model"] for m in saved["models"]] == ["tiny-dense", "tiny-mh3"] and len(saved["runs"]) == 2
    # tok/s: the final models timed round-robin, said so under the table
    timed = saved["timed_throughput"]
    assert timed["rounds"] == 3 and timed["threads"] == 1 and set(timed["tokens_per_s"]) == set(rows)
    md = (tmp_path / "cmp" / "results.md").read_text()
    assert "median of 3 training steps of each final model, timed round-robin" in md
    assert f"| {timed['tokens_per_s']['tiny-mh3']:,.0f} |" in md
    # a second call reuses the finished runs and prints the markdown table
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "finished earlier" in captured.err
    table = [ln for ln in captured.out.splitlines() if ln.startswith("|")]
    assert table[0].startswith("| model | params | fwd FLOPs/token | ppl corpus |") and len(table) == 4
    assert "train tok/s: median of 3 training steps" in captured.out
    assert main(argv + ["--timing-steps", "0"]) == 0  # no timing: the run averages, said so
    assert "machine load included" in capsys.readouterr().out
    # the same suite with another config is refused (one line), not silently reused
    assert main(argv + ["--lr", "0.5"]) == 2
    assert "train.lr" in _one_line_error(capsys, "mhmoe compare: error:")
    # --first-seed: seed indices K.. beside the finished seed 0, trained with train.seed + K, reported alone
    assert main(argv + ["--first-seed", "1", "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert {(r["label"], r["seed"]) for r in runs} == {("tiny-dense", 1), ("tiny-mh3", 1)}
    for r in runs:
        assert Path(r["run_dir"]) == tmp_path / "cmp" / r["label"] / "seed1"
        seed = yaml.safe_load((Path(r["run_dir"]) / "config.yaml").read_text())["train"]["seed"]
        assert seed == get_preset(r["label"]).train.seed + 1
    saved = json.loads((tmp_path / "cmp" / "results.json").read_text())
    assert saved["first_seed"] == 1 and set(saved["timed_throughput"]["tokens_per_s"]) == {"tiny-dense", "tiny-mh3"}
    assert main(argv + ["--first-seed", "-1"]) == 2
    assert "--first-seed" in _one_line_error(capsys, "mhmoe compare: error:")


# ---- the throughput benchmark script --------------------------------------------------------------------------------
def test_train_throughput_benchmark_smoke(tmp_path, capsys):
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "train_throughput.py"
    spec = importlib.util.spec_from_file_location("train_throughput", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert len(bench.DEFAULT_PRESETS) == 9 and all(n.startswith("tiny-") for n in bench.DEFAULT_PRESETS)
    out = tmp_path / "bench.json"
    rc = bench.main(["--presets", "tiny-dense", "tiny-mh3", "--steps", "1", "--warmup", "0", "--batch-size", "2",
                     "--seq-len", "16", "--device", "cpu", "--json", str(out)])
    assert rc == 0
    table = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("|")]
    assert len(table) == 4 and "tokens/s" in table[0] and "fwd FLOPs/token" in table[0]
    res = json.loads(out.read_text())
    assert {"cpu", "threads", "torch", "devices"} <= set(res["machine"])
    assert [r["preset"] for r in res["rows"]] == ["tiny-dense", "tiny-mh3"]
    for r in res["rows"]:
        assert r["tokens_per_s"] > 0 and r["tokens_per_step"] == 32 and r["params"] > 0
        assert 0 < r["ms_fwd_bwd"] <= r["ms_per_step"] and r["ms_optimizer"] > 0
    dense, mh3 = res["rows"]  # vs dense: the FLOP rate over the family's dense preset's
    assert dense["vs_dense"] == 1.0
    ratio = mh3["tokens_per_s"] * mh3["fwd_flops_per_token"] / (dense["tokens_per_s"] * dense["fwd_flops_per_token"])
    assert mh3["vs_dense"] == pytest.approx(ratio) and res["machine"]["isa"] and len(res["machine"]["loadavg"]) == 3
    flops = mh3["fwd_flops_per_token"] / dense["fwd_flops_per_token"]  # one round: the paired ratios are its steps'
    assert mh3["vs_dense_paired"] == pytest.approx(dense["step_times_s"][0] / mh3["step_times_s"][0] * flops)
    assert mh3["vs_dense_fwd_bwd"] == pytest.approx(dense["fwd_bwd_times_s"][0] / mh3["fwd_bwd_times_s"][0] * flops)
    assert dense["vs_dense_paired"] == dense["vs_dense_fwd_bwd"] == 1.0
    assert bench.main(["--presets", "tiny-nope"]) == 2


def test_train_throughput_paired_ratio_is_the_median_of_the_rounds():
    bench = load_script("benchmarks/train_throughput.py")
    # rounds 2x, 1x and 4x slower than the dense steps: the median pairs round with round, not medians with medians
    assert bench.paired_ratio([1.0, 3.0, 1.0], [2.0, 3.0, 4.0], 1.0) == pytest.approx(0.5)
    assert bench.paired_ratio([1.0, 3.0, 1.0], [2.0, 3.0, 4.0], 2.0) == pytest.approx(1.0)
    assert bench.paired_ratio([1.0, 2.0], [1.0], 1.0) is None and bench.paired_ratio([], [], 1.0) is None


def test_generate_throughput_benchmark_smoke(tmp_path, capsys):
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "generate_throughput.py"
    spec = importlib.util.spec_from_file_location("generate_throughput", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "gen.json"
    rc = bench.main(["--presets", "tiny-dense", "tiny-mh3", "--new-tokens", "3", "--prompt", "4", "--repeats", "1",
                     "--warmup", "0", "--json", str(out)])
    assert rc == 0
    table = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("|")]
    assert len(table) == 4 and "tokens/s" in table[0]
    rows = json.loads(out.read_text())["rows"]
    assert [r["preset"] for r in rows] == ["tiny-dense", "tiny-mh3"] and rows[0]["vs_dense"] == 1.0
    assert all(r["tokens_per_s"] > 0 and r["new_tokens"] == 3 for r in rows) and rows[1]["vs_dense"] > 0
    assert bench.main(["--presets", "tiny-dense", "--new-tokens", "0"]) == 2


def test_expert_gemm_benchmark_smoke(tmp_path, capsys):
    import importlib.util

    from mhmoe.moe.dispatch import fused, native
    from mhmoe.runtime.cpu import cpu_isa

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "expert_gemm.py"
    spec = importlib.util.spec_from_file_location("expert_gemm", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    if native.expert_ops(torch.bfloat16) is None or native.capability() != "AVX512" or cpu_isa() not in bench.ISAS:
        assert bench.main(["--layers", "tiny-mh3", "--rounds", "1"]) == 2  # says why, no traceback
        pytest.skip("the C++ loop's own bf16 kernel needs an AVX-512 build and AVX-512 BF16")
    rule = fused.expert_gemm
    out = tmp_path / "eg.json"
    assert bench.main(["--layers", "tiny-mh3", "--rounds", "1", "--json", str(out)]) == 0
    assert fused.expert_gemm is rule  # the rule is back after the benchmark
    (row,) = json.loads(out.read_text())["rows"]
    assert row["layer"] == "tiny-mh3" and row["d_in"] == 64 and row["ms_aten"] > 0 and row["ms_own"] > 0
    assert row["tensors"] == 10 and row["auto_uses_own"] == (
        native.expert_gemm(torch.bfloat16, 64, row["d_hidden"]) != native.GEMM_ATEN)
    loop_weight = fused._loop_weight
    assert bench.main(["--layers", "tiny-mh3", "--rounds", "1", "--autocast", "--json", str(out)]) == 0
    assert fused._loop_weight is loop_weight  # restored after the benchmark
    (row,) = json.loads(out.read_text())["rows"]
    assert row["ms_cast"] > 0 and row["ms_fp32_weights"] > 0 and row["tensors_equal"] == row["tensors"] == 10
    assert row["saved_mb_cast"] > row["saved_mb_fp32_weights"] > 0  # the bf16 weight copies are not kept


def test_native_ops_benchmark_smoke(tmp_path, capsys):
    import importlib.util

    from mhmoe.moe.dispatch import native

    if native.expert_ops(torch.float32) is None:
        pytest.skip("C++ ops not built here")
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "native_ops.py"
    spec = importlib.util.spec_from_file_location("native_ops", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "ops.json"
    assert bench.main(["--repeats", "1", "--rows", "64", "--scale", "0.02", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [(r["experts"], r["k"]) for r in res["topk"]] == bench.TOPK_CASES
    assert all(r["ns_per_row_cpp"] > 0 and r["ns_per_row_torch"] > 0 for r in res["topk"])
    loops = res["expert_loop"]
    assert {(r["shape"], r["dtype"]) for r in loops} == {(s, d) for s in bench.EXPERT_CASES
                                                         for d in ("float32", "bfloat16")}
    assert all(r["ms_forward"] > 0 and r["ns_per_element_swiglu_backward"] > 0 for r in loops)
    gemms = res["gemm_locality"]
    assert {(r["shape"], r["dtype"]) for r in gemms} == {(r["shape"], r["dtype"]) for r in loops}
    assert all(r[f"gflops_{k}"] > 0 for r in gemms for k in ("distinct", "shared", "one_gemm"))
