"""benchmarks/activation_memory.py on tiny shapes: one row per mode that recomputes something (a dense model has no
``moe`` row), the ratios are against its own ``none`` row, the table and the JSON carry every row (nothing is
compared against a speed)."""

from __future__ import annotations

import json

import pytest
from helpers import load_script

from mhmoe.runtime.cpu_malloc import held_bytes

activation_memory = load_script("benchmarks/activation_memory.py")


@pytest.mark.skipif(held_bytes() is None, reason="needs glibc's mallinfo2")
def test_rows_table_and_json(tmp_path, capsys):
    out = tmp_path / "am.json"
    assert activation_memory.main(["--presets", "tiny-dense", "tiny-mh3", "--batch-size", "2", "--seq-len", "32",
                                   "--vocab", "300", "--rounds", "1", "--threads", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["preset"], r["mode"]) for r in rows] == [("tiny-dense", "none"), ("tiny-dense", "blocks"),
                                                        ("tiny-mh3", "none"), ("tiny-mh3", "moe"),
                                                        ("tiny-mh3", "blocks")]
    mh3 = {r["mode"]: r for r in rows if r["preset"] == "tiny-mh3"}
    assert mh3["none"]["held_vs_none"] == 1.0
    assert mh3["blocks"]["held_mib"] < mh3["moe"]["held_mib"] < mh3["none"]["held_mib"]
    assert all(r["ms"] > 0 and r["peak_mib"] is None and r["dtype"] == "float32" for r in rows)
    table = capsys.readouterr().out
    assert table.count("| tiny-mh3 | float32 |") == 3 and "| tiny-dense | float32 | blocks |" in table
