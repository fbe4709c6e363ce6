"""docs/results/paired-comparisons.json (the paired re-reading of RESULTS.md's suites) is regenerated from the
per-seed perplexities in docs/results/ and must equal the file."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_paired_comparisons_source_is_current():
    spec = importlib.util.spec_from_file_location("paired_tables", ROOT / "scripts" / "paired_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    table = module.table()
    assert table == json.loads((ROOT / "docs" / "results" / "paired-comparisons.json").read_text())
    v2 = table["suites"]["v2-table1"]
    assert v2["separation"]["compared"] == 30 and v2["primary"][0]["a"] == "MH-MoE (head=3)"
    assert table["all"]["expected_by_chance"] == round(0.05 * table["all"]["compared"], 2)
