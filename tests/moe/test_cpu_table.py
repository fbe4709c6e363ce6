"""The CPU dispatch table: an entry for every ISA x dtype x shape class, ``impl="auto"`` doing what the entry
says, and the table being the one the recorded measurements (benchmarks/results/cpu_dispatch_*.json) give."""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from mhmoe.moe import dispatch
from mhmoe.moe.dispatch import cpu_table, fused, resolve_impl
from mhmoe.moe.dispatch.cpu_table import CPU_IMPLS, DTYPES, SHAPE_CLASSES, TABLE, cpu_choice, shape_class
from mhmoe.moe.experts import GroupedExperts
from mhmoe.moe.routers import RouterOutput
from mhmoe.runtime.cpu import ISAS

ROOT = Path(__file__).resolve().parents[2]
EXPERTS = {"few": GroupedExperts(4, 128, 256), "many": GroupedExperts(16, 128, 256),
           "small": GroupedExperts(16, 16, 32), "thin_wide": GroupedExperts(4, 8, cpu_table.WIDE_HIDDEN)}


FEW = {"experts": 4, "d_in": 128, "d_hidden": 256}  # a measured row's layer shape: the class "few"


def _cpu_dispatch():
    spec = importlib.util.spec_from_file_location("cpu_dispatch", ROOT / "benchmarks" / "cpu_dispatch.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_shape_classes():
    """The boundaries: thin, wide experts first, then small ones (d_in * F < 32,768), then by the expert count;
    the tiny presets' h=2 and h=3 experts are small, the d=768 bench layers' are not."""
    classify = cpu_table.classify
    assert classify(8, 127, 1024) == classify(8, 16, 1024) == "thin_wide"
    assert classify(8, 128, 1024) == "few" and classify(16, 128, 1024) == "many"
    assert classify(93, 64, 128) == classify(41, 96, 192) == classify(4, 127, 256) == "small"
    assert classify(16, 128, 256) == "many" and classify(16, 192, 256) == "many" and classify(96, 256, 512) == "many"
    assert set(cpu_table.FALLBACK_CLASS) <= set(SHAPE_CLASSES) >= set(cpu_table.FALLBACK_CLASS.values())


def test_every_isa_dtype_and_shape_class_has_an_entry():
    assert set(TABLE) == {(i, d, c) for i in ISAS for d in DTYPES for c in SHAPE_CLASSES}
    for key, entry in TABLE.items():
        assert entry.impl in CPU_IMPLS and entry.align >= 1 and entry.source, key
        assert entry.max_batch_padding < 0 or entry.impl == "fused", key  # batched GEMMs: the fused function only
    assert {c: shape_class(e) for c, e in EXPERTS.items()} == {c: c for c in EXPERTS}


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_runs_what_the_table_says(isa, dtype, monkeypatch):
    monkeypatch.setattr(dispatch, "cpu_isa", lambda: isa)
    monkeypatch.setattr(cpu_table, "cpu_isa", lambda: isa)
    seen = []
    real_layout = fused.row_layout
    monkeypatch.setattr(fused, "row_layout", lambda *a: seen.append(a[3:]) or real_layout(*a))
    for cls, experts in EXPERTS.items():
        entry = TABLE[(isa, cpu_table.dtype_key(dtype), cls)]
        x = torch.randn(6, experts.d_in, dtype=dtype)
        assert cpu_choice(dtype, experts) == entry
        assert resolve_impl("auto", x, experts) == entry.impl
        biased = GroupedExperts(experts.n_experts, experts.d_in, experts.d_hidden, bias=True)
        assert resolve_impl("auto", x, biased) == "sorted"  # the fused function has no biases
        if entry.impl != "fused":
            continue
        E = experts.n_experts
        ids = torch.arange(6 * 2).view(6, 2) % E
        route = RouterOutput(torch.full((6, 2), 0.5, dtype=dtype), ids, torch.ones(6, 2, dtype=torch.bool),
                             torch.zeros(6, E), torch.zeros(6, E), torch.bincount(ids.flatten(), minlength=E),
                             torch.ones(6, dtype=torch.bool))
        ex = GroupedExperts(E, experts.d_in, experts.d_hidden).to(dtype)
        seen.clear()
        dispatch.choose_impl("auto", x, ex)(x, route, ex)
        assert seen == [(entry.align, entry.max_batch_padding)], (isa, cls)


def test_the_table_is_built_from_the_recorded_measurements():
    """The entries between the markers of cpu_table.py are what benchmarks/cpu_dispatch.py --table writes from the
    JSON files; every measured entry names files that exist and record this ISA."""
    mod = _cpu_dispatch()
    paths = sorted((ROOT / "benchmarks" / "results").glob("cpu_dispatch_*.json"))
    assert paths, "no benchmarks/results/cpu_dispatch_*.json"
    built = mod.build_table(paths)
    assert built == TABLE
    assert mod.render(built) == mod.table_source((ROOT / "src/mhmoe/moe/dispatch/cpu_table.py").read_text())
    isas = {p.name: json.loads(p.read_text())["machine"]["isa"] for p in paths}
    for (isa, _, _), entry in TABLE.items():
        if entry.source.startswith(("not measured", "as float32")):
            continue
        files = entry.source.split(", ")
        assert all(isas.get(f) == isa for f in files), (isa, entry.source)


def test_table_choice_rules():
    """The selection rule on made-up rows: the smallest geometric mean of time / row best, and the batched
    threshold between the paddings where batched won and lost (never when it lost everywhere)."""
    mod = _cpu_dispatch()
    rows = [{"ms": {"fused:1": 10.0, "fused:16": 8.0, "batched:16": 7.0, "dense": 5.0}, "padding_batched16": 0.1},
            {"ms": {"fused:1": 20.0, "fused:16": 18.0, "batched:16": 30.0, "dense": 9.0}, "padding_batched16": 0.5}]
    entry = mod.choose(rows, "f.json")
    assert (entry.impl, entry.align, entry.expert_threads) == ("fused", 16, True)
    assert entry.max_batch_padding == 0.3  # batched won at padding 0.1, lost at 0.5: halfway
    rows[0]["ms"]["batched:16"] = 9.0
    assert mod.choose(rows, "f.json").max_batch_padding == -1.0  # lost everywhere: never
    rows[0]["ms"]["batched:16"], rows[1]["ms"]["batched:16"] = 7.0, 17.0
    assert mod.choose(rows, "f.json").max_batch_padding == 0.5  # won everywhere: up to the largest padding seen
    intra = [{"ms": {"fused:32": 10.0, "fused:32:intra": 9.0, "sorted": 12.0}, "padding_batched16": math.inf}]
    assert mod.choose(intra, "f.json").expert_threads is False


def test_table_gaps_from_the_nearest_measured_isa(tmp_path):
    """Entries without measurements: float32 from an AVX-512 ISA before AVX2 (the same float32 kernels), bf16
    without native bf16 as that ISA's float32, the rest from the nearest measured ISA; sources say so."""
    mod = _cpu_dispatch()

    def row(dtype: str, best: str) -> dict:
        ms = {"fused:1": 12.0, "fused:16": 12.0, "batched:16": 20.0, "dense": 9.0, best: 10.0}
        return {"dtype": dtype, **FEW, "ms": ms, "padding_batched16": 0.3}

    for name, isa, rows in (("cpu_dispatch_a.json", "amx", [row("float32", "fused:16"), row("bfloat16", "fused:1")]),
                            ("cpu_dispatch_b.json", "avx2", [row("float32", "fused:1")])):
        (tmp_path / name).write_text(json.dumps({"machine": {"isa": isa}, "rows": rows}))
    table = mod.build_table(sorted(tmp_path.glob("*.json")))
    assert table[("amx", "float32", "few")].align == 16 and table[("avx2", "float32", "few")].align == 1
    assert table[("avx512", "float32", "few")].source == "not measured; as amx: cpu_dispatch_a.json"
    assert table[("avx512", "bfloat16", "few")].source == ("as float32 (no native bf16): not measured; as amx: "
                                                           "cpu_dispatch_a.json")
    assert table[("avx2", "bfloat16", "few")].source == "as float32 (no native bf16): cpu_dispatch_b.json"
    assert table[("avx512_bf16", "bfloat16", "few")].source == "not measured; as amx: cpu_dispatch_a.json"
    assert table[("other", "float32", "few")].source == "not measured; as avx2: cpu_dispatch_b.json"
    assert ("amx", "float32", "many") not in table  # a class measured nowhere stays a gap


def test_small_experts_fall_back_to_their_isas_many_entry(tmp_path):
    """A class measured on one ISA only (small experts: the tiny presets) fills another ISA's gap from that ISA's own
    entry for the class the experts would otherwise have (many); rows are classed by their recorded shape."""
    mod = _cpu_dispatch()

    def row(shape: dict, best: str) -> dict:
        ms = {"fused:1": 12.0, "fused:16": 12.0, "fused:32": 12.0, "batched:16": 20.0, "dense": 9.0, best: 10.0}
        return {"dtype": "bfloat16", "class": "many", **shape, "ms": ms, "padding_batched16": 0.3}

    small, many = {"experts": 93, "d_in": 64, "d_hidden": 128}, {"experts": 96, "d_in": 256, "d_hidden": 512}
    for name, isa, rows in (("cpu_dispatch_a.json", "amx", [row(many, "fused:16")]),
                            ("cpu_dispatch_b.json", "avx512_bf16", [row(small, "fused:32"), row(many, "fused:1")])):
        (tmp_path / name).write_text(json.dumps({"machine": {"isa": isa}, "rows": rows}))
    table = mod.build_table(sorted(tmp_path.glob("*.json")))
    assert table[("avx512_bf16", "bfloat16", "small")].align == 32  # the stored "class" is not what counts
    assert table[("avx512_bf16", "bfloat16", "many")].align == 1
    entry = table[("amx", "bfloat16", "small")]
    assert (entry.align, entry.source) == (16, "not measured; as many: cpu_dispatch_a.json")


def test_a_native_measurement_outranks_an_emulated_one(tmp_path):
    """Files from a CPU of the ISA decide its entries; files from a wider CPU capped to it only where none exist."""
    mod = _cpu_dispatch()

    def write(name: str, env: dict, best: str) -> None:
        ms = {"fused:1": 12.0, "fused:16": 12.0, "batched:16": 20.0, "dense": 9.0, best: 10.0}
        rows = [{"dtype": "bfloat16", **FEW, "ms": ms, "padding_batched16": 0.3}]
        (tmp_path / name).write_text(json.dumps({"machine": {"isa": "avx512_bf16", "env": env}, "rows": rows}))

    write("cpu_dispatch_emulated.json", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "MHMOE_MALLOC": "tuned"}, "fused:16")
    table = mod.build_table(sorted(tmp_path.glob("*.json")))
    assert table[("avx512_bf16", "bfloat16", "few")].source == "cpu_dispatch_emulated.json"
    assert table[("avx512_bf16", "bfloat16", "few")].align == 16
    write("cpu_dispatch_native.json", {"MHMOE_MALLOC": "tuned"}, "fused:1")
    table = mod.build_table(sorted(tmp_path.glob("*.json")))
    entry = table[("avx512_bf16", "bfloat16", "few")]
    assert (entry.source, entry.align) == ("cpu_dispatch_native.json", 1)


def test_a_flop_count_leaves_the_tables_padding_out(monkeypatch):
    """Under FlopCounterMode the fused path runs without the entry's row padding or batching, so a model's
    measured FLOPs are the same on every CPU (an entry aligning rows to 16 would count the zero rows too)."""
    from torch.utils.flop_counter import FlopCounterMode

    experts = GroupedExperts(4, 16, 32)
    padded = cpu_table.CpuChoice("fused", 16, math.inf, True, "test")
    monkeypatch.setattr(fused, "cpu_choice", lambda dtype, ex: padded)
    ids = torch.tensor([[0], [1], [1], [2], [3], [3]])
    route = RouterOutput(torch.ones(6, 1), ids, torch.ones(6, 1, dtype=torch.bool), torch.zeros(6, 4),
                         torch.zeros(6, 4), torch.bincount(ids.flatten(), minlength=4), torch.ones(6, dtype=torch.bool))
    x = torch.randn(6, 16)
    with FlopCounterMode(display=False) as counter:
        fused.fused_moe(x, route, experts)
    assert counter.get_total_flops() == 6 * 3 * 2 * 16 * 32  # 6 rows, three GEMMs of 16 x 32
    assert torch.allclose(fused.fused_moe(x, route, experts), fused.fused_moe(x, route, experts, align=1))
