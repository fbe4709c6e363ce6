"""FIFOs, links to /dev/zero, oversized files and symlinked directories planted in a suite folder or a run
store: every research reader (results.json, summary.json, budget.json, run records, results.md) refuses
them in one line naming the file, before reading a byte and without blocking; a symlinked row, seed or
run directory never leads a reader out of its folder.

Before: these files were read whole with ``Path.read_text()`` (a FIFO blocked forever, ``summary.json ->
/dev/zero`` was read until memory ran out, a 1 GB results.json was read whole), or a FIFO or a link to a
device was taken for a missing file."""

from __future__ import annotations

import json

import pytest
from helpers import plant, within

from mhmoe.cli import main
from mhmoe.config.run import RunConfig
from mhmoe.research import analysis, budget, power, report, reproduce, scaling, store
from mhmoe.runtime.bounded import MAX_JSON_CHARS, BoundedLoadError

# (kind, what the one-line refusal says): files inside a suite folder are never followed
KINDS = (("fifo", "is a FIFO"), ("zero", "is a symlink"), ("large", "more than the 67,108,864 allowed"))
READERS = {  # reader of a suite folder -> the file it reads there
    "results.json": [power.suite_power, store.suite_run_dirs, lambda d: report.collect_curves([d])],
    "summary.json": [scaling.scaling_table, analysis._suite_runs],
    "budget.json": [lambda d: budget.suite_budget(d, "s", {}, {}, 1.0, lambda label, k: None)],
}


def _one_line(exc: BaseException, path, what: str) -> None:
    msg = str(exc)
    assert "\n" not in msg and str(path) in msg and what in msg, msg


@pytest.mark.parametrize("kind,what", KINDS)
def test_suite_files_are_refused_in_one_line_never_read(tmp_path, kind, what):
    for name, readers in READERS.items():
        for i, reader in enumerate(readers):
            suite = tmp_path / f"{name}-{i}"
            path = plant(suite / name, kind, MAX_JSON_CHARS + 1)
            with pytest.raises(BoundedLoadError) as info:
                within(lambda: reader(suite), fifos=[path])  # noqa: B023 -- called at once
            _one_line(info.value, path, what)


@pytest.mark.parametrize("kind,what", KINDS[:2] + (("large", "more than the 16,777,216 allowed"),))
def test_results_md_is_refused_in_one_line(tmp_path, kind, what):
    path = plant(tmp_path / "results.md", kind, report.MAX_RESULTS_MD_BYTES + 1)
    with pytest.raises(BoundedLoadError) as info:
        within(lambda: report.read_results_md(tmp_path), fifos=[path])
    _one_line(info.value, path, what)
    (tmp_path / "results.md").unlink()
    (tmp_path / "results.md").write_text("| model | ppl |\n")
    assert report.read_results_md(tmp_path) == "| model | ppl |\n"


@pytest.mark.parametrize("kind,what", KINDS)
def test_store_records_and_results_are_refused(tmp_path, capsys, kind, what):
    """A run record: reported in one line and ignored, like a damaged one; a finished run's results.json:
    refused in one line."""
    run = RunConfig()
    s = store.RunStore(tmp_path / "store")
    record = plant(s.record_path(store.run_key(run)), kind, MAX_JSON_CHARS + 1)
    assert within(lambda: s.load_record(run), fifos=[record]) is None
    err = capsys.readouterr().err.strip()
    assert err.startswith("mhmoe: warning: ignoring run record"), err
    _one_line(Exception(err), record, what.replace("allowed", "allowed for a run record"))
    results = plant(s.run_dir(store.run_key(run)) / "results.json", kind, MAX_JSON_CHARS + 1)
    with pytest.raises(BoundedLoadError) as info:
        within(lambda: s.finished(run), fifos=[results])
    _one_line(info.value, results, what)


def test_symlinked_run_directories_lead_nowhere_else(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "seed0").mkdir(parents=True)
    (elsewhere / "seed0" / "results.json").write_text(json.dumps({"step": 1}))
    suite = tmp_path / "suite"
    (suite / "MH-MoE" / "seed0").mkdir(parents=True)
    (suite / "MH-MoE" / "seed0" / "results.json").write_text(json.dumps({"step": 1}))
    (suite / "SMoE").symlink_to(elsewhere)  # a symlinked row
    (suite / "Dense").mkdir()
    (suite / "Dense" / "seed0").symlink_to(elsewhere / "seed0")  # a symlinked seed
    assert store.suite_run_dirs(suite) == [("MH-MoE", 0, suite / "MH-MoE" / "seed0")]
    run = RunConfig()
    s = store.RunStore(tmp_path / "store")
    s.run_dir("x").parent.mkdir(parents=True)
    s.run_dir(store.run_key(run)).symlink_to(elsewhere / "seed0")  # a symlinked store run
    with pytest.raises(BoundedLoadError) as info:
        s.finished(run)
    _one_line(info.value, s.run_dir(store.run_key(run)), "is a symlink")
    assert not s.record_path(store.run_key(run)).exists()
    row = reproduce.suite_rows("v2-table5")[0]  # an older suite folder's OUT/<label>/seed<k>/, row symlinked
    old = tmp_path / "old"
    old.mkdir()
    (old / reproduce.run_dir_name(row.label)).symlink_to(elsewhere)
    with pytest.raises(BoundedLoadError) as info:
        reproduce.run_suite("v2-table5", old, seeds=1, progress=False, train_missing=False)
    _one_line(info.value, old / reproduce.run_dir_name(row.label), "is a symlink")


def test_the_cli_says_which_file_in_one_line_and_exits_2(tmp_path, capsys):
    fifo = plant(tmp_path / "pilot" / "results.json", "fifo")
    zero = plant(tmp_path / "fig6" / "summary.json", "zero")
    for args, path, what in ((["analyze", "--suite", str(fifo.parent), "--power"], fifo, "is a FIFO"),
                             (["analyze", "--suite", str(zero.parent), "--scaling"], zero, "is a symlink"),
                             (["plot", str(fifo.parent), "--out", str(tmp_path / "c.png")], fifo, "is a FIFO")):
        assert within(lambda: main(args), fifos=[fifo]) == 2  # noqa: B023 -- called at once
        err = capsys.readouterr().err.strip()
        _one_line(Exception(err), path, what)
