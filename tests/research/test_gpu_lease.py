"""benchmarks/gpu_lease.sh on the CPU: the dry run of the lease (the same steps and file names, tiny shapes)
finishes, writes at most 8 files that all parse, caps every step; a step past its cap is killed and keeps its
output, a step that does not fit is skipped, both logged; the steps' command lines parse; the docs' GPU tables
fill from the dry run's files."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from docs_check import matches, source_values, table_numbers, tables

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_lease as L  # noqa: E402
import gpu_lease_steps as S  # noqa: E402
import gpu_lease_tables as T  # noqa: E402


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """One dry run of part 1 (about 25 s of CPU): (exit status, OUT, stdout)."""
    tmp = tmp_path_factory.mktemp("lease")
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "DEVICE")} | {"PY": sys.executable}
    res = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_lease.sh"), "600", "--dry-run", "--out",
                          str(tmp / "out"), "--work", str(tmp / "work")], capture_output=True, text=True, env=env,
                         timeout=900)
    return res.returncode, tmp / "out", res.stdout + res.stderr


def test_the_dry_run_finishes_with_at_most_eight_files_that_all_parse(dry_run):
    rc, out, stdout = dry_run
    assert rc == 0, stdout[-4000:]
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= L.MAX_FILES and "lease.log" in files and "lease.json" in files, files
    docs = {f: json.loads((out / f).read_text()) for f in files if f.endswith(".json")}
    summary = docs["lease.json"]
    assert [s["step"] for s in summary["steps"]] == L.PARTS[1]
    for s in summary["steps"]:
        if s["status"] == "skipped":
            assert s["reason"], s
            continue
        assert s["status"] == "ok", s
        assert s["file"] in files and 0 < s["cap_s"] <= s["left_s"] and s["seconds"] <= s["cap_s"], s
    science = next(s for s in summary["steps"] if s["step"] == "science")
    assert science["status"] == "skipped"  # no bundle (CI), or one: the dry run names the command instead
    assert ("no data bundle" in science["reason"]) != ("reproduce decisive" in science["reason"]), science
    log = (out / "lease.log").read_text()
    for step in L.PARTS[1]:
        assert re.search(rf"\[ *[\d.]+s {step}\] (ok|skipped)", log), step
    assert "[" in stdout and "done in" in stdout  # the log goes to stdout too (the lease's output tail)


def test_the_dry_run_measures_what_the_gpu_run_will(dry_run):
    _, out, _ = dry_run
    versions = json.loads((out / "versions.json").read_text())
    assert versions["packages"]["torch"] and versions["gpu"] is None and "filelock_4" in versions["checks"]
    plan = versions["plan"]  # counted on the CPU for the GPU: compiles are counted, not guessed
    assert plan["bench_mh3"]["compiles"] > 10 and plan["bench_mh3"]["kernels"].get("up_fwd")
    assert plan["train"]["compiles"] > 0 and plan["science"]["compiles"] == 0
    mh3 = json.loads((out / "bench_mh3.json").read_text())
    assert [(r["config"], r["pass"]) for r in mh3["rows"]] == [("mh3", "fwd"), ("mh3", "fwd_bwd")]
    for r in mh3["rows"]:
        assert r["ms_ours"] > 0 and r["ratio_dense"] > 0 and r["ratio_floor"] > 0 and "ms_grouped_mm" in r
    parity = json.loads((out / "bench_parity.json").read_text())
    assert sorted({r["config"] for r in parity["rows"]}) == ["fgmoe", "mh2", "smoe"] and not parity["errors"]
    train = json.loads((out / "train.json").read_text())
    assert [(r["preset"], [o for o in r["overrides"] if "impl" in o]) for r in train["rows"]] == [
        ("tiny-dense", []), ("tiny-mh3", []), ("tiny-mh3", ["model.moe.impl=triton"])]
    assert all(r["tokens_per_s"] > 0 for r in train["rows"]) and len(train["vs_dense"]) == 2
    assert [(r["preset"], r["mode"]) for r in train["activation_memory"]] == [
        ("tiny-mh3", "none"), ("tiny-mh3", "moe"), ("tiny-mh3", "blocks")] and not train["errors"]
    tests = json.loads((out / "gpu_tests.json").read_text())
    assert tests["source"] == "junit" and tests["tests"] == tests["skipped"] >= 12  # no CUDA: all skipped


def _fake(tmp_path, name, code, predicted, **kw):
    return L.Planned(name, f"{name}.json", [sys.executable, "-c", code], predicted, **kw)


def test_a_step_past_its_cap_is_killed_keeping_its_output_and_a_step_that_does_not_fit_is_skipped(tmp_path,
                                                                                                    monkeypatch):
    monkeypatch.setattr(L, "GRACE_S", 0.5)
    out = tmp_path / "out"
    out.mkdir()
    ctx = L.Ctx(out=out, work=tmp_path, part=1, dry=True, env=dict(os.environ))
    stubborn = ("import json, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                f"json.dump({{'partial': 1}}, open({str(out / 'slow.json')!r}, 'w')); print('wrote', flush=True); "
                "time.sleep(120)")
    plan = [_fake(tmp_path, "quick", f"open({str(out / 'quick.json')!r}, 'w').write('{{}}')", 0.1),
            _fake(tmp_path, "slow", stubborn, 1.0),  # ignores SIGTERM: killed at its cap
            _fake(tmp_path, "late", "print('never')", 30.0)]  # predicted longer than what is left
    t0 = time.monotonic()
    log = L.Log(out / "lease.log", t0)
    results = L.run_steps(plan, ctx, t0 + 4.0, log)
    log.close()
    assert time.monotonic() - t0 < 30
    assert [(r["step"], r["status"]) for r in results] == [("quick", "ok"), ("slow", "timed_out"), ("late", "skipped")]
    slow = results[1]
    assert slow["seconds"] <= slow["cap_s"] + 2 and slow["cap_s"] <= 4.0
    assert json.loads((out / "slow.json").read_text()) == {"partial": 1}  # what it wrote before the cap is kept
    assert "needs ~30 s" in results[2]["reason"]
    text = (out / "lease.log").read_text()
    assert "wrote" in text and "cap of" in text and "skipped: needs ~30 s" in text and "never" not in text


def test_a_test_step_with_partial_output_starts_with_a_third_of_its_prediction():
    p = L.Planned("gpu_tests", "gpu_tests.json", ["true"], 90.0, partial=True)
    assert L.cap_for(p, 40.0) == 40.0 and 90.0 * L.MIN_PARTIAL <= 40.0
    q = L.Planned("bench_mh3", "bench_mh3.json", ["true"], 100.0)
    assert L.cap_for(q, 1000.0) == 260.0 and L.cap_for(q, 50.0) == 50.0


def test_every_steps_command_parses(tmp_path):
    """The options each step passes exist (a typo would cost a lease), on the GPU and in the dry run."""
    from mhmoe.cli import build_parser

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import triton_moe

    for part, steps in L.PARTS.items():
        for dry in (False, True):
            ctx = L.Ctx(out=tmp_path, work=tmp_path, part=part, dry=dry)
            files = {L.file_name(s, part) for s in steps} | {L.log_name(part), L.summary_name(part)}
            assert len(files) <= L.MAX_FILES
            for step in steps:
                cmd, post, _ = L.command(step, ctx, steps)
                if not cmd:
                    continue
                if cmd[1].endswith("gpu_lease_steps.py"):
                    assert S.build_parser().parse_args(cmd[2:]).what in ("machine", "bench", "train")
                elif cmd[1:3] == ["-m", "pytest"]:
                    assert post == "pytest" and all((ROOT / p).exists() for p in cmd if p.startswith("tests"))
                else:
                    triton_moe.build_parser().parse_args(cmd[2:])
    sci = L.science_command(sys.executable, tmp_path / "suite", 5.0, "cuda")
    args = build_parser().parse_args(sci[3:])
    assert args.suite == "decisive" and args.minutes == 5.0 and f"data.bundle={L.SCIENCE_BUNDLE}" in args.set
    cmd = L.science_cmd(L.Ctx(out=tmp_path, work=tmp_path, part=1, dry=False), 300.0)
    assert cmd[cmd.index("--minutes") + 1] == "3.5"  # 300 s less the start-up/evaluation reserve and the grace


@pytest.mark.parametrize("installed, used", [("3.20.0", True), (None, True), ("4.0.0", False)])
def test_a_filelock_older_than_4_is_replaced_by_the_carried_wheel(tmp_path, monkeypatch, installed, used):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "filelock-4.3.1-py3-none-any.whl").write_bytes(b"")
    monkeypatch.setattr(L, "_version", lambda name: installed)
    ctx = L.Ctx(out=tmp_path, work=tmp_path, part=1, dry=False)
    log = L.Log(tmp_path / "log", time.monotonic())
    env = L.step_env(ctx, log, wheels)
    log.close()
    first = env["PYTHONPATH"].split(os.pathsep)[0]
    assert first.endswith("filelock-4.3.1-py3-none-any.whl") == used
    assert str(ROOT / "src") in env["PYTHONPATH"] and env["TRITON_CACHE_DIR"].startswith(str(tmp_path))
    assert "TRITON_INTERPRET" not in env


def test_the_traffic_model_predicts_every_gpu_row(monkeypatch):
    """On an H100 every bench row gets the traffic model's predictions: they run here for every configuration,
    dtype and pass the lease measures (a CUDA device name is all they read), and an error in them is recorded in
    the row instead of costing its measurement."""
    import torch

    from mhmoe.research import bench as B

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(B, "predictions", B.predictions)  # restored after the test
    S._guard_predictions()
    for name, cfg in B.CONFIGS.items():
        for dtype in (torch.bfloat16, torch.float32):
            for pass_ in B.PASSES:
                hidden = B.aligned_hidden(B.layer_flops(cfg, 16384) / 16384, B.D_MODEL)
                got = B.predictions(cfg, 16384, dtype, pass_, hidden, torch.device("cuda"))
                assert "pred_error" not in got and got["pred_ms_triton"] > 0 and got["pred_ms_dense"] > 0, name
    import mhmoe.research.traffic as traffic

    monkeypatch.setattr(traffic, "layer_prediction", lambda *a, **k: 1 / 0)
    got = B.predictions(B.CONFIGS["mh3"], 16384, torch.bfloat16, "fwd", 2048, torch.device("cuda"))
    assert got == {"pred_error": "ZeroDivisionError: division by zero"}


def test_pytest_output_without_its_xml_still_counts():
    lines = ["tests/moe/test_cuda_paths.py::test_a[x] PASSED  [ 50%]", "noise",
             "tests/train/test_cuda_training.py::test_b FAILED [100%]"]
    got = S.pytest_lines_summary(lines)
    assert (got["tests"], got["passed"], got["failed"]) == (2, 1, 1)


def test_the_science_suite_is_collected_also_when_cut_short(tmp_path):
    run = tmp_path / "suite" / "SMoE" / "seed0"
    run.mkdir(parents=True)
    (tmp_path / "suite" / "results.json").write_text('{"rows": [1]}')
    (run / "eval.jsonl").write_text('{"step": 10, "kjv_ppl": 5.0}\n{"step": 20, "kjv_ppl": 4.0}\n')
    (run / "metrics.jsonl").write_text('{"step": 20, "loss": 1.5}\n{"step": 21, "lo')  # cut mid-line
    got = S.collect_science(tmp_path / "suite")
    assert got["files"]["results.json"] == {"rows": [1]}
    assert got["runs"]["SMoE/seed0"]["eval"] == {"lines": 2, "last": {"step": 20, "kjv_ppl": 4.0}}
    assert got["runs"]["SMoE/seed0"]["metrics"]["last"] is None


def test_the_docs_gpu_tables_fill_from_the_lease_files(dry_run, tmp_path):
    _, out, _ = dry_run
    results = tmp_path / "benchmarks" / "results" / "gpu" / "cpu-dry"
    results.mkdir(parents=True)
    for f in out.iterdir():
        (results / f.name).write_text(f.read_text())
    versions = json.loads((results / "versions.json").read_text())  # a synthetic GPU for the machine table
    versions["gpu"] = {"name": "NVIDIA H100 80GB HBM3", "sm_count": 132, "memory_gib": 79.19}
    versions["nvidia_smi"] = {"clocks.sm": "1980", "clocks.max.sm": "1980", "driver_version": "580.159.04"}
    (results / "versions.json").write_text(json.dumps(versions))
    doc = tmp_path / "PERFORMANCE.md"
    doc.write_text((ROOT / "docs" / "PERFORMANCE.md").read_text())
    before = [t for t in tables(doc) if t.rows and t.rows[0][0] == T.UNMEASURED]
    assert len(before) == 5  # machine, layer, train, tests, actmem: marked, empty, no numbers
    assert T.main([str(results), "--doc", str(doc), "--root", str(tmp_path)]) == 0
    filled = {t.header[0]: t for t in tables(doc) if t.source and "results/gpu/" in t.source[0]}
    assert sorted(filled) == ["GPU", "config", "model", "preset", "selection"]
    for t in filled.values():
        values = [v for s in t.source for v in source_values(tmp_path / s)]
        numbers = table_numbers(t)
        assert numbers and all(matches(n, values) for n in numbers), t.where
    assert len(filled["config"].rows) == 8 and len(filled["preset"].rows) == 3 and len(filled["model"].rows) == 3
    again = doc.read_text()
    assert T.main([str(results), "--doc", str(doc), "--root", str(tmp_path)]) == 0
    assert doc.read_text() == again  # filling twice changes nothing


@pytest.mark.parametrize("argv, message", [([], "SECONDS"), (["60", "--out", "{full}"], "not empty")])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    argv = [a.replace("{full}", str(tmp_path / "full")) for a in argv]
    assert L.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err
