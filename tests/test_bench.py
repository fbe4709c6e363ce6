"""`mhmoe bench moe` JSON schema (tiny token count; speed is measured by the benchmark, not here)."""

import json

from mhmoe.cli import main


def test_bench_moe_json_schema(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "moe", "--configs", "smoe", "--dtypes", "float32", "--tokens", "32", "--repeats", "1",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {"cpu", "threads", "torch", "device"} <= set(data["machine"])
    assert {(r["config"], r["dtype"], r["pass"]) for r in data["rows"]} == {
        ("smoe", "float32", "fwd"), ("smoe", "float32", "fwd_bwd")}
    for r in data["rows"]:
        for key in ("tokens", "ms_ours", "ms_loop", "ms_dense", "ratio_dense", "ratio_loop", "ms_sorted"):
            assert key in r
        assert r["ratio_dense"] == r["ms_dense"] / r["ms_ours"] and r["tokens"] == 32
    assert "| smoe | float32 | fwd |" in capsys.readouterr().out
    assert main(["bench", "moe", "--configs", "huge"]) == 2
