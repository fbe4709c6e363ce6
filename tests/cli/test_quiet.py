"""Third-party output stays out of ours, checked on real ``python -m mhmoe`` processes: ``eval --tasks``
prints no git message and no datasets / lm-eval bars (one bar of ours), ``export --hf`` no transformers
bars or deprecation lines; ``mhmoe --help`` / ``--version`` answer without importing torch."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from ecosystem_helpers import tiny_checkpoint

import mhmoe

SRC = Path(mhmoe.__file__).resolve().parents[1]  # the subprocess runs the sources this test imported
OURS = re.compile(r"^(lm-eval: scoring:|mhmoe: warning: )")  # what may appear on stderr


def _mhmoe(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
           "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "GIT_CEILING_DIRECTORIES": str(cwd.parent)}  # cwd is not in a git checkout
    return subprocess.run([sys.executable, "-m", "mhmoe", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def _frames(err: str) -> list[str]:
    return [f.strip() for f in re.split(r"[\r\n]", err) if f.strip()]


def test_eval_tasks_prints_no_git_message_and_no_library_bars(tmp_path):
    pytest.importorskip("lm_eval")
    ck = tiny_checkpoint(tmp_path / "run")
    proc = _mhmoe("eval", "--checkpoint", str(ck), "--tasks", "mhmoe_kjv_cloze", "--limit", "3", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    others = [f for f in _frames(proc.stderr) if not OURS.match(f)]
    assert not others, others  # no "fatal: not a git repository", "Generating test split", "Tokenizing inputs"
    assert "lm-eval: scoring:" in proc.stderr and "mhmoe_kjv_cloze" in proc.stdout


def test_export_hf_prints_no_library_bars_or_deprecations(tmp_path):
    pytest.importorskip("transformers")
    ck = tiny_checkpoint(tmp_path / "run")
    proc = _mhmoe("export", "--hf", str(ck), str(tmp_path / "hf"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    others = [f for f in _frames(proc.stderr) if not OURS.match(f)]
    assert not others, others  # no "Loading weights", "Writing model shards", "[transformers] ... deprecated"
    assert "transformers model (step 3" in proc.stdout


def test_help_and_version_import_no_torch(tmp_path):
    code = ("import sys, contextlib, io\nfrom mhmoe.cli import main\n"
            "for argv in (['--help'], ['--version']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):\n"
            "        main(argv)\n"
            "    print(out.getvalue().splitlines()[0])\n"
            "print('torch' in sys.modules)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    usage, version, torch_loaded = proc.stdout.splitlines()
    assert usage.startswith("usage: mhmoe [-h] [--version] COMMAND")
    assert re.fullmatch(rf"mhmoe {re.escape(mhmoe.__version__)} \(torch \S+, Python \S+\)", version)
    assert torch_loaded == "False"  # lazy: the --help listing costs no torch import
