"""benchmarks/cpu_memory.py: the byte counts follow the shapes, the loop's cases time the C++ ops with the weights
each case names, and the tables carry every measurement (tiny shapes; nothing is compared against a speed)."""

from __future__ import annotations

import pytest
import torch
from helpers import load_script

from mhmoe.moe.dispatch import native
from mhmoe.research.bench import CONFIGS, BenchConfig

cpu_memory = load_script("benchmarks/cpu_memory.py")


def test_traffic_counts_the_bytes_of_the_shapes():
    r = cpu_memory.traffic("smoe", torch.bfloat16, 2048)
    weights = 8 * 3 * 768 * 2048 * 2  # E x (W1, W3, W2) of 768 x 2048, bf16
    hidden = 2 * 2048 * 2048 * 2  # h1, h3 of 2,048 routed rows (top-1)
    rows = 2048 * 768 * 2
    assert r["weights_mb"] * 1e6 == pytest.approx(weights)
    assert r["hidden_mb"] * 1e6 == pytest.approx(hidden)
    assert r["traffic_mb"] * 1e6 == pytest.approx(3 * weights + 2 * hidden + 9 * rows)
    assert r["dense_hidden"] == 2048  # SMoE top-1 of 2048-wide experts: the dense FFN of its FLOPs
    dense = 3 * (3 * 768 * 2048 * 2) + 2 * (2 * 2048 * 2048 * 2) + 5 * 2048 * 768 * 2
    assert r["dense_traffic_mb"] * 1e6 == pytest.approx(dense)
    assert r["traffic_ratio"] == pytest.approx(r["traffic_mb"] / r["dense_traffic_mb"])
    mh3 = cpu_memory.traffic("mh3", torch.float32, 2048)
    assert mh3["rows"] == 2048 * 3 * 3 and mh3["hidden_mb"] * 1e6 == pytest.approx(2 * mh3["rows"] * 512 * 4)

def test_bandwidth_rows_per_thread_count_and_size():
    rows = cpu_memory.bandwidth([1, 2], [1, 2], passes=1)
    assert [(r["threads"], r["mib"]) for r in rows] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert all(r["read_gbs"] > 0 and r["copy_gbs"] > 0 for r in rows)

@pytest.mark.skipif(native.expert_ops(torch.float32) is None, reason="the C++ expert loop is not available")
def test_loop_times_every_case_and_the_tables_show_them(monkeypatch):
    monkeypatch.setitem(CONFIGS, "tiny-test", BenchConfig("tiny-test", 4, 64, 2, 2))
    r = cpu_memory.loop("tiny-test", torch.float32, tokens=32, threads=1, rounds=2)
    cases = ("fwd", "fwd_hot", "fwd_nokeep", "fwd_nokeep_hot", "bwd", "bwd_hot")
    assert all(0 < r[f"ms_{c}_min"] <= r[f"ms_{c}_median"] for c in cases)
    assert r["rows_per_expert"] == 32 and r["gemm"] == "at::mm"  # 32 tokens x 2 heads x top-2 / 4 experts
    text = cpu_memory.markdown({"bandwidth": [{"threads": 1, "mib": 4, "read_gbs": 12.34, "copy_gbs": 5.0}],
                                "traffic": [cpu_memory.traffic("tiny-test", torch.float32, 32)], "loop": [r]})
    assert "| 1 | 4 | 12.3 | 5.0 |" in text and "| tiny-test | float32 | at::mm |" in text
    assert f"{r['ms_bwd_hot_min']:.1f} ({r['ms_bwd_hot_median']:.1f})" in text
