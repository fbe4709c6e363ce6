"""Suite reports (compare / reproduce): the table in Markdown, CSV and JSON, mean ± std over seeds, one
curve per model; ``mhmoe plot`` collects runs and suites."""

from __future__ import annotations

import csv
import json

import pytest

from mhmoe.errors import ConfigError
from mhmoe.research.report import collect_curves, markdown_table, model_rows, run_dirs_of, write_suite_report


def _run(root, label, seed, ppl, tok_s=1000.0, params=3_344_064):
    run_dir = root / label / f"seed{seed}"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 5.0 - s + seed}) + "\n"
                                                   for s in (1, 2, 3)))
    (run_dir / "eval.jsonl").write_text(json.dumps({"step": 3, "kjv_ppl": ppl, "pydocs_ppl": 2 * ppl}) + "\n")
    return {"label": label, "seed": seed, "run_dir": str(run_dir), "preset": label, "params": params,
            "fwd_flops_per_token": 6_684_672.0, "tokens_per_s": tok_s, "train_s": 10.0,
            "eval": {"pydocs": {"ppl": 2 * ppl}, "kjv": {"ppl": ppl}}}


@pytest.fixture
def runs(tmp_path):
    return [_run(tmp_path, "tiny-dense", 0, 100.0, 3000.0), _run(tmp_path, "tiny-dense", 1, 110.0, 3100.0),
            _run(tmp_path, "tiny-mh3", 0, 90.0, params=7_485_504)]


def test_table_mean_and_std_over_seeds(runs):
    rows = model_rows(runs)
    assert [r["model"] for r in rows] == ["tiny-dense", "tiny-mh3"] and rows[0]["seeds"] == 2
    assert rows[0]["ppl"]["kjv"]["mean"] == pytest.approx(105.0) and rows[1]["ppl"]["kjv"]["std"] is None
    lines = markdown_table(runs).splitlines()
    assert lines[0] == "| model | params | fwd FLOPs/token | ppl kjv | ppl pydocs | train tok/s |"
    assert lines[2] == "| tiny-dense | 3.34M | 6.68M | 105.00 ± 7.07 | 210.00 ± 14.14 | 3,050 |"
    assert lines[3] == "| tiny-mh3 | 7.49M | 6.68M | 90.00 | 180.00 | 1,000 |"
    timed = markdown_table(runs, {"tiny-dense": 1234.4, "tiny-mh3": 987.6}).splitlines()  # round-robin timing
    assert timed[2].endswith("| 1,234 |") and timed[3].endswith("| 988 |")


def test_suite_report_files(runs, tmp_path):
    table = write_suite_report(runs, tmp_path, "compare: demo", {"wall_s": 12.5})
    md = (tmp_path / "results.md").read_text()
    assert md.startswith("# compare: demo") and table in md and "Seeds: 2 (mean ± std over seeds)." in md
    assert "machine load included" in md  # what the tok/s column is, without a timing
    rows = list(csv.reader((tmp_path / "results.csv").open()))
    assert rows[0][:3] == ["suite", "label", "seed"] and len(rows) == 4 and rows[1][-2:] == ["100.0000", "200.0000"]
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["wall_s"] == 12.5 and len(data["runs"]) == 3 and data["models"][0]["seeds"] == 2
    assert (tmp_path / "curves.png").read_bytes().startswith(b"\x89PNG")


def test_collect_curves_of_runs_and_suites(runs, tmp_path):
    assert len(run_dirs_of(tmp_path)) == 3
    suite = collect_curves([tmp_path])
    assert [c.label for c in suite] == ["tiny-dense", "tiny-mh3"]
    assert suite[0].train == [(1, 4.5), (2, 3.5), (3, 2.5)]  # seeds 0 and 1 averaged
    one = collect_curves([tmp_path / "tiny-mh3" / "seed0"], ["mine"])
    assert [c.label for c in one] == ["mine"]
    renamed = collect_curves([tmp_path], ["v1"])
    assert [c.label for c in renamed] == ["v1/tiny-dense", "v1/tiny-mh3"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="RUN"):
        collect_curves([tmp_path / "empty"])
