"""`mhmoe bench moe` JSON schema (tiny token count; speed is measured by the benchmark, not here)."""

import json

import pytest
import torch

from mhmoe.cli import main
from mhmoe.research.timing import time_fns


def test_bench_moe_json_schema(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "moe", "--configs", "smoe", "--dtypes", "float32", "--tokens", "32", "--repeats", "1",
                 "--peers", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {"cpu", "threads", "torch", "device", "isa", "malloc"} <= set(data["machine"])
    assert data["machine"]["isa"] in ("AMX", "AVX-512 BF16", "AVX-512", "AVX2", "other")
    assert len(data["machine"]["loadavg_before"]) == len(data["machine"]["loadavg_after"]) == 3
    assert {(r["config"], r["dtype"], r["pass"]) for r in data["rows"]} == {
        ("smoe", "float32", "fwd"), ("smoe", "float32", "fwd_bwd")}
    for r in data["rows"]:
        for key in ("tokens", "ms_ours", "ms_loop", "ms_dense", "ratio_dense", "ratio_loop", "ms_sorted", "ms_floor"):
            assert key in r
        assert r["dense_hidden"] % 64 == 0  # aligned (128 on CUDA: tensor cores)
        assert r["auto_impl"] == "fused" and r["ratio_dense_auto"] == r["ms_dense_norm"] / r["ms_fused"]
        assert r["ms_dense_norm"] == pytest.approx(r["ms_dense"] * r["flops_fwd"] / r["dense_flops_fwd"])
        assert r["ratio_dense"] == r["ms_dense_norm"] / r["ms_ours"] and r["tokens"] == 32
        assert r["ratio_floor"] == r["ms_floor"] / r["ms_ours"]
        assert r["ratio_vs_smoe"] == 1.0 and r["ratio_vs_smoe_auto"] == 1.0  # smoe against itself
        assert r["ratio_vs_smoe_paired"] == 1.0 and r["ratio_dense_auto_paired"] > 0
        assert r["ratio_vs_smoe_same_rounds"] == 1.0
    assert "| smoe | float32 | fwd |" in capsys.readouterr().out
    assert main(["bench", "moe", "--configs", "huge"]) == 2


def test_bench_times_the_smoe_layer_in_the_same_rounds(tmp_path, capsys):
    """Rows of the other configs time the SMoE layer (impl="auto") in every repeat: ``ratio_vs_smoe_same_rounds`` is
    auto's time over it, repeat by repeat (one repeat here: the ratio of the two times)."""
    out = tmp_path / "bench.json"
    assert main(["bench", "moe", "--configs", "mh2", "--dtypes", "float32", "--tokens", "32", "--repeats", "1",
                 "--no-loop", "--peers", "--json", str(out)]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert "auto vs smoe same rounds" in header and "| smoe ms |" not in header  # a reference, not a path
    for r in json.loads(out.read_text())["rows"]:
        assert r["ms_smoe"] > 0
        assert r["ratio_vs_smoe_same_rounds"] == pytest.approx(r[f"ms_{r['auto_impl']}"] / r["ms_smoe"])
    from mhmoe.research.bench import CONFIGS, bench_config  # the GPU lease's steps leave the SMoE layer out

    rows = bench_config(CONFIGS["mh2"], 32, torch.float32, torch.device("cpu"), 1, passes=("fwd",), with_loop=False,
                        with_smoe=False)
    assert "ms_smoe" not in rows[0] and "ratio_vs_smoe_same_rounds" not in rows[0]


def test_bench_peers_rows(tmp_path):
    """Peers (the `bench` extra) get their own columns where they can express the config (top-2 here)."""
    from mhmoe.research.bench_peers import installed_peers

    peers = [p for p in installed_peers() if p in ("st_moe", "hf_grouped_mm")]  # one of each family: fast
    if not peers:
        pytest.skip("no peer MoE package installed (pip install 'mhmoe[bench]')")
    out = tmp_path / "bench.json"
    assert main(["bench", "moe", "--configs", "fgmoe", "--dtypes", "float32", "--tokens", "32", "--repeats", "1",
                 "--no-loop", "--peers", *peers, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(peers) <= set(data["machine"]["peers"])
    for r in data["rows"]:
        for p in peers:
            assert r[f"ms_peer_{p}"] > 0 and r[f"ratio_peer_{p}"] == r[f"ms_peer_{p}"] / r["ms_ours"]
    assert main(["bench", "moe", "--peers", "nope"]) == 2


@pytest.mark.parametrize("heads, k", [(1, 2), (2, 2), (3, 3)])
def test_peer_layer_shapes_and_grads(heads, k):
    pytest.importorskip("st_moe_pytorch")
    import torch

    from mhmoe.research.bench_peers import build_peer

    layer = build_peer("st_moe", 48, 6, 32, k, heads, group=8)
    x = torch.randn(16, 48, requires_grad=True)
    out = layer(x)
    assert out.out.shape == (16, 48)
    (out.out.sum() + out.aux_loss).backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert build_peer("st_moe", 48, 6, 32, 1, heads, group=8) is None  # top-1: not expressible


def test_time_fns_round_robin_and_fallible_peers():
    calls: list[str] = []

    def fails():
        raise RuntimeError("cannot run this config\nmore detail")

    fns = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b"), "peer": fails}
    times, errors = time_fns(fns, torch.device("cpu"), repeats=3, warmup=1, fallible=frozenset({"peer"}))
    assert set(times) == {"a", "b"} and all(t >= 0 for t in times.values())
    assert errors == {"peer": "cannot run this config"}
    assert calls == ["a", "b"] + ["a", "b"] * 3  # warm-up, then one of each per repeat, in turn
    with pytest.raises(RuntimeError):  # our own paths must not fail silently
        time_fns({"ours": fails}, torch.device("cpu"), repeats=1)


def test_paired_ratio_cancels_a_machine_that_changes_speed():
    """Two functions timed in turn while the machine runs at 1x, then 3x slower: the ratio of the medians mixes the
    levels, the median of the per-repeat ratios does not; ``samples`` gets the times in repeat order."""
    from mhmoe.research.timing import paired_ratio

    dense = [10.0, 10.0, 30.0, 30.0, 30.0]
    ours = [20.0, 20.0, 60.0, 60.0, 60.0]
    assert paired_ratio(dense, ours) == 0.5
    assert paired_ratio([3.0, 1.0, 2.0], [1.0, 1.0, 1.0]) == 2.0  # the median, not the mean
    with pytest.raises(ValueError):
        paired_ratio([1.0], [1.0, 2.0])
    samples: dict[str, list[float]] = {}
    time_fns({"a": lambda: None, "b": lambda: None}, torch.device("cpu"), repeats=4, warmup=0, samples=samples)
    assert set(samples) == {"a", "b"} and all(len(v) == 4 for v in samples.values())


def test_bench_times_autos_path_right_before_the_dense_ffn(monkeypatch):
    """paired_ratio's pairs are adjacent: in every repeat auto's path is the last of ours, the dense FFN next."""
    import mhmoe.research.bench as bench

    orders: list[list[str]] = []
    real = bench.time_fns

    def spy(fns, *a, **kw):
        orders.append(list(fns))
        return real(fns, *a, **kw)

    monkeypatch.setattr(bench, "time_fns", spy)
    rows = bench.bench_config(bench.CONFIGS["smoe"], 32, torch.float32, torch.device("cpu"), 1, passes=("fwd",),
                              with_loop=False)
    auto = rows[0]["auto_impl"]
    order = orders[0]
    assert order.index("ms_dense") == order.index(f"ms_{auto}") + 1
    assert all(k.startswith("ms_") for k in order[: order.index("ms_dense")])


def test_aligned_dense_width_and_gemm_floor():
    from mhmoe.research.bench import CONFIGS, GemmFloor, aligned_hidden

    assert aligned_hidden(6 * 768 * 2051, 768) == 2048 and aligned_hidden(6 * 768 * 2200, 768) == 2176
    assert aligned_hidden(10.0, 768) == 128
    floor = GemmFloor(CONFIGS["mh3"], tokens=64)
    out = floor(torch.zeros(1, 768))
    assert out.shape == (96, 6, 256)  # 64 tokens x 3 heads x top-3 = 576 rows over 96 experts; d/h = 256


@pytest.mark.parametrize("heads, k", [(1, 1), (3, 3)])
def test_hf_peer_block_shapes_and_grads(heads, k):
    pytest.importorskip("transformers")
    from mhmoe.research.bench_peers import build_peer

    for backend in ("hf_eager", "hf_grouped_mm", "hf_batched_mm"):
        layer = build_peer(backend, 48, 6, 32, k, heads, group=8)
        x = torch.randn(16, 48, requires_grad=True)
        out = layer(x)
        assert out.out.shape == (16, 48) and float(out.aux_loss) == 0.0
        out.out.sum().backward()
        assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0, backend


@pytest.mark.parametrize("name", ["smoe", "mh3"])
def test_layer_flops_are_analytic_and_the_same_for_every_impl(name):
    """The FLOPs behind every "x dense" ratio: the analytic count, one number whatever path runs. PyTorch's
    counter agrees with it on a path it can count exactly (sorted: only routed rows, plain matmuls) and
    not on grouped_mm (no formula for torch._grouped_mm) or padded (counts the padding rows)."""
    from torch.utils.flop_counter import FlopCounterMode

    from mhmoe.moe.layers import build_ffn_layer
    from mhmoe.research.bench import CONFIGS, D_MODEL, available_impls, layer_flops

    cfg, tokens = CONFIGS[name], 64
    x = torch.randn(tokens, D_MODEL)
    counted = {}
    for impl in available_impls(torch.device("cpu")):
        torch.manual_seed(0)
        layer = build_ffn_layer(D_MODEL, cfg.moe_config(impl))
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            layer(x)
        counted[impl] = counter.get_total_flops()
    assert counted["sorted"] == layer_flops(cfg, tokens)  # the counter, where it is right, agrees
    if "grouped_mm" in counted:
        assert counted["grouped_mm"] < layer_flops(cfg, tokens)  # what the old FlopCounter-based ratio saw
    assert counted["padded"] >= layer_flops(cfg, tokens)
    out = bench_rows(name)
    assert {r["flops_fwd"] for r in out} == {layer_flops(cfg, tokens)}
    assert all(r["dense_flops_fwd"] == 6 * D_MODEL * r["dense_hidden"] * tokens for r in out)


def bench_rows(name: str) -> list[dict]:
    from mhmoe.research.bench import CONFIGS, bench_config

    return bench_config(CONFIGS[name], 64, torch.float32, torch.device("cpu"), repeats=1, passes=("fwd",),
                        with_loop=False)


def test_batched_mm_peer_memory_predicted_and_skipped(monkeypatch):
    """hf_batched_mm gathers the expert weights per routed slot: its predicted memory grows with tokens x
    d x F; a peer predicted past the free memory is skipped with a note in the row, not run."""
    from mhmoe.research import bench
    from mhmoe.research.bench_peers import peer_predicted_bytes

    mh3 = bench.CONFIGS["mh3"]
    args = (768, mh3.experts, mh3.d_expert, mh3.top_k, mh3.heads, 16384, torch.bfloat16)
    fwd_bwd = peer_predicted_bytes("hf_batched_mm", *args, backward=True)
    assert fwd_bwd == 4 * 16384 * 9 * 256 * 512 * 2  # 155 GB: more than an H100 has
    assert peer_predicted_bytes("hf_batched_mm", *args, backward=False) == 3 * fwd_bwd // 4
    assert peer_predicted_bytes("hf_grouped_mm", *args, backward=True) is None
    cpu = torch.device("cpu")
    why = bench.skipped_peers(mh3, 16384, torch.bfloat16, cpu, "fwd_bwd", ("hf_batched_mm", "hf_grouped_mm"), 80 << 30)
    assert set(why) == {"hf_batched_mm"} and "predicted 144.0 GiB for fwd_bwd" in why["hf_batched_mm"]
    assert bench.skipped_peers(mh3, 64, torch.float32, cpu, "fwd", ("hf_batched_mm",), 80 << 30) == {}
    assert bench.skipped_peers(mh3, 16384, torch.float32, cpu, "fwd", ("hf_batched_mm",), None) == {}
    # the 2,048-token mh3 layer in bf16 (18 GiB predicted) on a 24 GiB machine: the run was killed for memory
    assert set(bench.skipped_peers(mh3, 2048, torch.bfloat16, cpu, "fwd_bwd", ("hf_batched_mm",), 23 << 30))
    assert bench.free_memory_bytes(cpu) is None or bench.free_memory_bytes(cpu) > 0
    pytest.importorskip("transformers")
    monkeypatch.setattr(bench, "free_memory_bytes", lambda device: 1 << 20)  # 1 MiB free: skip it
    rows = bench.bench_config(bench.CONFIGS["fgmoe"], 32, torch.float32, cpu, repeats=1, with_loop=False,
                              peers=("hf_batched_mm", "hf_grouped_mm"))
    for r in rows:
        assert "hf_batched_mm" in r["peer_skipped"] and r["ms_peer_hf_batched_mm"] is None
        assert r["ratio_peer_hf_batched_mm"] is None and r["ms_peer_hf_grouped_mm"] > 0


@pytest.mark.gpu
def test_batched_mm_prediction_bounds_its_measured_peak():
    """On CUDA the prediction is an upper bound of the measured peak, and not a loose one."""
    pytest.importorskip("transformers")
    from mhmoe.research.bench import CONFIGS, _peak_mb, _runner
    from mhmoe.research.bench_peers import build_peer, peer_predicted_bytes

    cfg, tokens, dev = CONFIGS["fgmoe"], 1024, torch.device("cuda")
    layer = build_peer("hf_batched_mm", 768, cfg.experts, cfg.d_expert, cfg.top_k, cfg.heads, 1024)
    layer = layer.to(dev, torch.bfloat16)
    x = torch.randn(tokens, 768, device=dev, dtype=torch.bfloat16, requires_grad=True)
    for pass_ in ("fwd", "fwd_bwd"):
        fn = _runner(layer, x, pass_)
        fn()
        peak = _peak_mb({"ms_peer": fn}, dev)["mb_peer"] * 2**20
        want = peer_predicted_bytes("hf_batched_mm", 768, cfg.experts, cfg.d_expert, cfg.top_k, cfg.heads, tokens,
                                    torch.bfloat16, backward=pass_ == "fwd_bwd")
        assert 0.6 * want <= peak <= 1.25 * want, (pass_, peak / 2**20, want / 2**20)


def test_bench_moe_set_applies_moe_fields_to_every_layer(tmp_path, capsys, monkeypatch):
    """``--set FIELD=VALUE``: every benchmarked layer built with it, recorded in the JSON and under the table; the
    fields the benchmark sets itself, unknown fields and bad values are one-line errors (exit 2)."""
    from mhmoe.research import bench

    built = []
    real = bench.build_ffn_layer
    monkeypatch.setattr(bench, "build_ffn_layer", lambda d, cfg: built.append(cfg) or real(d, cfg))
    out = tmp_path / "bench.json"
    assert main(["bench", "moe", "--configs", "mh2", "--dtypes", "float32", "--tokens", "32", "--repeats", "1",
                 "--no-loop", "--peers", "--set", "router_dtype=model", "--set", "router=sigmoid",
                 "--set", "balance_loss_weight=0", "--json", str(out)]) == 0
    assert built and all(c.router_dtype == "model" and c.router == "sigmoid" and c.balance_loss_weight == 0
                         for c in built)  # the mh2 layers and the SMoE layer timed beside them
    assert {c.heads for c in built} == {1, 2} and sum(c.heads == 1 for c in built) == 1
    assert json.loads(out.read_text())["overrides"] == {"balance_loss_weight": 0, "router": "sigmoid",
                                                        "router_dtype": "model"}
    assert "every layer with balance_loss_weight=0, router=sigmoid, router_dtype=model" in capsys.readouterr().out
    for bad in (["n_experts=4"], ["router_dtyp=model"], ["router_dtype=fp16"], ["router_dtype"]):
        assert main(["bench", "moe", "--configs", "smoe", "--set", *bad]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
