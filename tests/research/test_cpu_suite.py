"""benchmarks/cpu_suite.py: every step's command parses with its script's own options, names its JSON as the docs'
tables do, and the suite runs bf16 only where the CPU has native bf16 (nothing is measured here)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

from mhmoe.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


suite = _load("cpu_suite")


class _Parsed(Exception):
    """Raised by the patched parse_args once a script's parser accepted its arguments."""


def _parses(argv: tuple[str, ...], monkeypatch) -> None:
    """The step's arguments go through its program's real parser (and nothing else of the program runs)."""
    if argv[:2] == ("-m", "mhmoe"):
        build_parser().parse_args(list(argv[2:]))
        return
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        original(self, args, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    module = _load(Path(argv[0]).stem)
    with pytest.raises(_Parsed):
        module.main(list(argv[1:]))
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", original)


@pytest.mark.parametrize("isa", sorted(suite.TAGS))
def test_every_step_parses_and_names_its_results(isa, monkeypatch):
    steps = suite.steps_for(isa)
    assert len({s.name for s in steps}) == len(steps)
    for step in steps:
        _parses(step.argv, monkeypatch)
        for out in step.outputs:
            assert out.startswith("benchmarks/results/") and out.endswith(".json") and suite.TAGS[isa] in out
            assert out in step.argv  # the file the step writes is the one it is given
    names = " ".join(" ".join(s.argv) for s in steps)
    assert ("bfloat16" in names) == (isa in ("amx", "avx512_bf16"))  # bf16 only with native bf16
    assert ("expert_gemm" in names) == (isa in ("amx", "avx512_bf16"))  # the own kernel: dot product or AMX tiles


def test_dispatch_steps_time_every_layer_once():
    """The two dispatch files together hold every layer cpu_dispatch.py knows, none twice (the table averages the
    rows of all files of an ISA), the first as cpu_dispatch.py's default."""
    dispatch = _load("cpu_dispatch")
    assert suite.LAYERS == dispatch.default_layers()
    assert list(suite.TINY_LAYERS) == list(dispatch.TINY_LAYERS)
    assert sorted(suite.LAYERS + suite.TINY_LAYERS) == sorted(dispatch.layer_configs())


def test_outputs_match_the_files_the_docs_cite():
    """This CPU family's files as PERFORMANCE.md cites them: the suite re-measures what the tables show."""
    docs = (ROOT / "docs" / "PERFORMANCE.md").read_text(encoding="utf-8")
    outputs = {o for s in suite.steps_for("avx512_bf16") for o in s.outputs}
    assert outputs and all(o in docs for o in outputs), sorted(o for o in outputs if o not in docs)


def test_another_folder_leaves_the_checkout_alone(tmp_path):
    steps = suite.steps_for("avx512_bf16", str(tmp_path))
    assert all(o.startswith(str(tmp_path) + "/") for s in steps for o in s.outputs)
    assert "table" not in {s.name for s in steps}  # auto's table is rebuilt from the checkout's files only
    assert "table" in {s.name for s in suite.steps_for("avx512_bf16")}


def test_dry_run_and_bad_input(capsys):
    assert suite.main(["--dry-run", "--isa", "amx", "--steps", "bench", "profile"]) == 0
    out = capsys.readouterr().out
    assert "moe_cpu_amx_2core.json" in out and "moe_profile_amx.json" in out and "native_ops" not in out
    assert suite.main(["--dry-run", "--steps", "nonsense"]) == 2
    assert "unknown steps" in capsys.readouterr().err


def test_skip_existing_runs_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(suite, "ROOT", tmp_path)
    step = suite.Step("x", ("-c", "raise SystemExit(3)"), ("benchmarks/results/x.json",))
    assert suite.run([step], skip_existing=False) == 1  # a failing step fails the suite
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "x.json").write_text("{}")
    assert suite.run([step], skip_existing=True) == 0
    assert "skipped" in capsys.readouterr().out


tables = _load("cpu_tables")


def test_cpu_tables_reproduce_the_docs_tables():
    """The generator gives the EPYC's and the Xeon's tables of PERFORMANCE.md character for character (so after a
    suite run on another CPU, ``cpu_tables.py --write`` puts that CPU's numbers in the same form)."""
    doc = tables.DOC.read_text(encoding="utf-8")
    # bench, profile, four C++ op tables, tiny, paper, generation, thin experts, the two GEMM back ends (two), the
    # dispatch candidates (d=768, tiny); the Xeon also the allocator's two settings
    for tag, count in (("avx512bf16", 14), ("amx", 15)):
        made = tables.tables(tag, ROOT / "benchmarks" / "results")
        assert len(made) == count, tag
        text, missing = tables.write(doc, made)
        assert not missing and text == doc, tag


def test_cpu_tables_place_only_under_their_source_line(tmp_path):
    doc = "intro\n" + tables.marker(["a.json"]) + "\n| x |\n|---|\n| 1 |\n\ntext\n"
    text, missing = tables.write(doc, [(["a.json"], "| x |\n|---|\n| 2 |"), (["b.json"], "| y |\n|---|\n| 3 |")])
    assert text == doc.replace("| 1 |", "| 2 |") and missing == [tables.marker(["b.json"])]
    assert tables.main(["--tag", "nonesuch", "--results", str(tmp_path)]) == 2
