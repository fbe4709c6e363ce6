"""The measurements behind the CPU dispatch table (:mod:`mhmoe.moe.dispatch.cpu_table`), and the table built from them.

``--measure`` times forward + backward (parameter and input gradients) of MoE layers under each CPU candidate
path, round-robin in one process (every repeat runs every candidate once in turn; medians), beside the
aligned same-FLOPs dense FFN, and writes a JSON file that names the CPU (model, ISA, flags), the thread
count and the load averages before and after. Layers: the ``bench moe`` configurations (shape class ``few``:
smoe; ``many``: fgmoe, mh2, mh3) at d=768, two thin, wide icml-table5 layers (``thin_wide``: h=2, h=4) and the
MoE layers of the tiny presets (d=192, their own 4,096 tokens; ``few``: tiny-smoe, ``many``: the others). Every
candidate sees the same random batches, so the routing (and the row count of every expert) changes from call
to call as in training: ``--pool`` batches warm every candidate up, then every timed call gets a batch none has
seen (the same one for every candidate in a repeat). So shapes that repeat are timed as they are in a long run
(oneDNN's kernels built and cached), while a path whose GEMM shapes follow the row counts exactly pays for new
kernels on most calls, as it does in training.

Candidates: ``fused:A`` (rows per expert rounded up to a multiple of A; whole experts spread over the threads),
``fused:A:intra`` (the same with every GEMM split over the threads instead), ``batched:A`` (every expert padded
to the largest, one bmm per matrix), ``sorted``, ``chunked:A`` (thin_wide only).

``--table`` rebuilds the table from every ``benchmarks/results/cpu_dispatch_*.json`` and rewrites it in
``cpu_table.py``; ``--check`` exits 1 when the file's table differs from the one the measurements give.
Per (ISA, dtype, shape class): the candidate with the smallest geometric mean of (time / the layer's fastest
time) over the class's layers and all files of that ISA; the batched threshold is the padding up to which the
batched GEMMs are picked, a threshold on the layers' measured paddings that best separates the layers where
batched was faster from those where the chosen ``fused`` was (:func:`batch_threshold`). A CPU of an ISA outranks
emulations of it: where files from such a CPU exist, the emulated files of that ISA are not used. ISAs or dtypes
without a file take the entry of the nearest measured ISA (:func:`_distance`; named in the entry's source), bf16
on a CPU without native bf16 the same ISA's float32 entry. ``ONEDNN_MAX_CPU_ISA`` (with ``MKL_ENABLE_INSTRUCTIONS``
and ``ATEN_CPU_CAPABILITY`` for AVX2) measures a narrower ISA on a wider CPU: the file's ISA follows the cap::

    python benchmarks/cpu_dispatch.py --measure --threads 2 --json benchmarks/results/cpu_dispatch_amx_2t.json
    MHMOE_MALLOC=tuned python benchmarks/cpu_dispatch.py --measure ...   # glibc malloc without page faults
    ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 python benchmarks/cpu_dispatch.py --measure ...   # no AMX tiles
    ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 python benchmarks/cpu_dispatch.py \
        --measure --dtypes float32 ...                                                # AVX2 only
    python benchmarks/cpu_dispatch.py --table
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import resource
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from mhmoe.config.flops import moe_layer_flops
from mhmoe.config.moe import MoEConfig
from mhmoe.moe.dispatch.cpu_table import DTYPES, FALLBACK_CLASS, SHAPE_CLASSES, CpuChoice, classify, shape_class
from mhmoe.moe.dispatch.fused import chunk_rows, expert_workers, fused_moe
from mhmoe.moe.dispatch.layout import batch_padding
from mhmoe.moe.experts import DenseFFN
from mhmoe.moe.layers import build_ffn_layer
from mhmoe.runtime.cpu import ISAS, cpu_info, cpu_isa
from mhmoe.runtime.cpu_malloc import malloc_from_env

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TABLE_FILE = ROOT / "src" / "mhmoe" / "moe" / "dispatch" / "cpu_table.py"
DENSE_ALIGN = 64  # the dense reference's hidden width is a multiple of this
CANDIDATES = {"few": ["fused:1", "fused:16", "fused:32", "fused:32:intra", "batched:16"],
              "many": ["fused:1", "fused:16", "fused:32", "batched:16"],
              "small": ["fused:1", "fused:16", "fused:32", "batched:16"],
              "thin_wide": ["sorted", "fused:1", "fused:32", "chunked:32"]}
AVX512_FAMILY = ("amx", "avx512_bf16", "avx512")  # the same float32 kernels (AVX-512)
NO_NATIVE_BF16 = ("avx512", "avx2", "other")  # bf16 converted in software: ~5-100x slower than float32, not measured
ISA_CAPS = ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY")  # set: the ISA is emulated
ENV_KEYS = (*ISA_CAPS, "MHMOE_MALLOC")


TINY_LAYERS = ("tiny-smoe", "tiny-fgmoe", "tiny-mh2", "tiny-mh3")  # the presets CPU runs train most


def layer_configs() -> dict[str, tuple[int, MoEConfig, int | None]]:
    """name -> (d_model, MoEConfig, tokens per call or None for ``--tokens``): the ``bench moe`` configurations,
    the icml-table5 h=2 and h=4 layers, and the MoE layers of the tiny presets at their own batch (16 x 256
    tokens, d=192: small experts, where the row alignment that suits d=768 need not)."""
    from mhmoe.config.presets import get_preset
    from mhmoe.research.bench import CONFIGS, D_MODEL
    from mhmoe.research.reproduce import SUITES

    out: dict[str, tuple[int, MoEConfig, int | None]] = {
        name: (D_MODEL, c.moe_config("fused"), None) for name, c in CONFIGS.items()}
    for row in SUITES["icml-table5"]:
        run = row.build("tiny")
        if run.model.moe.heads in (2, 4):
            out[f"icml-h{run.model.moe.heads}"] = (run.model.d_model, replace(run.model.moe, impl="fused"), None)
    for name in TINY_LAYERS:
        run = get_preset(name)
        out[name] = (run.model.d_model, replace(run.model.moe, impl="fused"), run.train.batch_size * run.train.seq_len)
    return out


def candidate_layer(d: int, moe: MoEConfig, cand: str, dtype: torch.dtype) -> torch.nn.Module:
    """The layer with its routed experts run by candidate ``cand`` (same weights for every candidate: seed 0)."""
    torch.manual_seed(0)
    name, _, arg = cand.partition(":")
    layer = build_ffn_layer(d, replace(moe, impl="sorted" if name == "sorted" else "fused")).to(dtype=dtype)
    if name == "sorted":
        return layer
    align, _, intra = arg.partition(":")
    inner = layer.moe if hasattr(layer, "moe") else layer
    chunk = chunk_rows(moe.d_expert, dtype.itemsize) if name == "chunked" else 0
    pad = math.inf if name == "batched" else -1.0
    workers = 1 if intra else None  # None: expert threads (expert_workers)

    def dispatch(xs: torch.Tensor, route) -> torch.Tensor:
        w = workers
        if w is None and name != "batched":
            w = expert_workers(row_counts(route, inner.experts.n_experts), xs.device)
        return fused_moe(xs, route, inner.experts, chunk=chunk, workers=w, align=int(align), max_batch_padding=pad)

    inner.dispatch = dispatch
    return layer


def row_counts(route, n_experts: int) -> list[int]:
    """Valid (token, slot) pairs per expert of a routing (host ints)."""
    return torch.bincount(route.experts[route.valid], minlength=n_experts).tolist()


def dense_reference(d: int, moe: MoEConfig, dtype: torch.dtype) -> tuple[torch.nn.Module, float]:
    """(SwiGLU dense FFN at the layer's FLOPs, hidden width a multiple of 64; layer FLOPs / dense FLOPs)."""
    flops = sum(moe_layer_flops(moe, d).values())
    hidden = max(DENSE_ALIGN, round(flops / (6 * d) / DENSE_ALIGN) * DENSE_ALIGN)
    torch.manual_seed(0)
    return DenseFFN(d, hidden).to(dtype=dtype), flops / (6 * d * hidden)


def _step(module: torch.nn.Module, x: torch.Tensor) -> None:
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out = module(x)
    y, aux = (out.out, out.aux_loss) if hasattr(out, "out") else (out, 0.0)
    (y.float().sum() + aux).backward()


def _minor_faults() -> int:
    """Minor page faults of this process so far (fresh memory the kernel mapped and zeroed: 4 KiB each)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def measure_layer(name: str, d: int, moe: MoEConfig, dtype: torch.dtype, tokens: int, pool: int,
                  repeats: int) -> dict:
    """One row: median wall and CPU ms of every candidate and of the dense reference, round-robin on fresh batches,
    and the median minor page faults per call (``page_faults``: fresh memory the kernel zero-fills)."""
    probe = build_ffn_layer(d, moe)
    cls = shape_class(probe.moe.experts if hasattr(probe, "moe") else probe.experts)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(tokens, d, generator=gen).to(dtype) for _ in range(pool + repeats)]  # warm-up, then fresh
    mods = {c: candidate_layer(d, moe, c, dtype) for c in CANDIDATES[cls]}
    dense, flop_ratio = dense_reference(d, moe, dtype)
    mods["dense"] = dense
    pads = []
    with torch.no_grad():
        for x in xs[pool:]:
            counts = mods[CANDIDATES[cls][1]](x).stats.counts.tolist()
            pads.append(batch_padding(counts, 16))
    for i in range(pool):  # warm-up: every shape of the pool built once
        for m in mods.values():
            _step(m, xs[i])
    wall: dict[str, list[float]] = {k: [] for k in mods}
    cpu: dict[str, list[float]] = {k: [] for k in mods}
    faults: dict[str, list[int]] = {k: [] for k in mods}
    for r in range(repeats):
        for k, m in mods.items():
            t0, c0, f0 = time.perf_counter(), time.process_time(), _minor_faults()
            _step(m, xs[pool + r])
            wall[k].append((time.perf_counter() - t0) * 1e3)
            cpu[k].append((time.process_time() - c0) * 1e3)
            faults[k].append(_minor_faults() - f0)
    ms = {k: statistics.median(v) for k, v in wall.items()}
    row = {"layer": name, "class": cls, "dtype": str(dtype).removeprefix("torch."), "tokens": tokens,
           "experts": moe.n_experts, "top_k": moe.top_k, "heads": moe.heads, "d_in": d // moe.heads,
           "d_hidden": moe.d_expert, "ffn": moe.ffn, "padding_batched16": statistics.mean(pads),
           "ms": ms, "cpu_ms": {k: statistics.median(v) for k, v in cpu.items()},
           "page_faults": {k: statistics.median(v) for k, v in faults.items()},
           "dense_hidden": dense.experts.d_hidden, "dense_norm_ms": ms["dense"] * flop_ratio}
    row["ratio_dense"] = {k: row["dense_norm_ms"] / v for k, v in ms.items() if k != "dense"}
    return row


def machine() -> dict:
    model, flags = cpu_info()
    return {"cpu": model, "isa": cpu_isa(), "flags": sorted(f for f in flags if f.startswith(("avx", "amx", "fma"))),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "env": {k: os.environ[k] for k in ENV_KEYS if k in os.environ}}


def default_layers() -> list[str]:
    """What ``--measure`` times without ``--layers``: every layer but the tiny presets' (each set in a file of its
    own, so that no layer is counted twice in the table)."""
    return [name for name in layer_configs() if name not in TINY_LAYERS]


def run_measure(args: argparse.Namespace) -> int:
    malloc_from_env()  # MHMOE_MALLOC=tuned, as the mhmoe command (recorded in the file's machine.env)
    if args.threads:
        torch.set_num_threads(args.threads)
    configs = layer_configs()
    names = args.layers or default_layers()
    bad = [n for n in names if n not in configs]
    if bad or args.tokens < 1 or args.repeats < 1 or args.pool < 1:
        print(f"cpu_dispatch: error: invalid layers {bad} or sizes: allowed {list(configs)}, >= 1", file=sys.stderr)
        return 2
    result = {"machine": machine(), "date": datetime.date.today().isoformat(),
              "command": "python benchmarks/cpu_dispatch.py " + " ".join(sys.argv[1:]),
              "loadavg_before": list(os.getloadavg()), "tokens": args.tokens, "pool": args.pool,
              "repeats": args.repeats, "rows": []}
    for name in names:
        d, moe, tokens = configs[name]
        for dt in args.dtypes:
            row = measure_layer(name, d, moe, getattr(torch, dt), tokens or args.tokens, args.pool, args.repeats)
            result["rows"].append(row)
            best = min(row["ms"], key=lambda k: row["ms"][k] if k != "dense" else math.inf)
            print(f"[cpu_dispatch] {name} {dt}: " + " ".join(f"{k} {v:.0f}" for k, v in row["ms"].items())
                  + f" ms; best {best}, x dense {row['ratio_dense'][best]:.2f}; load {os.getloadavg()[0]:.2f}",
                  file=sys.stderr, flush=True)
    result["loadavg_after"] = list(os.getloadavg())
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


def _choice(cand: str, threshold: float, source: str) -> CpuChoice:
    name, _, arg = cand.partition(":")
    if name == "sorted":
        return CpuChoice("sorted", 1, -1.0, True, source)
    align, _, intra = arg.partition(":")
    return CpuChoice("chunked" if name == "chunked" else "fused", int(align), threshold, not intra, source)


def choose(rows: list[dict], source: str) -> CpuChoice:
    """The entry for one (ISA, dtype, class) from its measured rows (see the module docstring)."""
    cands = [c for c in rows[0]["ms"] if c != "dense" and all(c in r["ms"] for r in rows)]

    def score(c: str) -> float:
        return statistics.geometric_mean(r["ms"][c] / min(r["ms"][k] for k in cands) for r in rows)

    best = min((c for c in cands if not c.startswith("batched")), key=score)
    threshold = -1.0
    if "batched:16" in cands and best.startswith("fused"):
        threshold = batch_threshold(rows, best, "batched:16")
    return _choice(best, threshold, source)


def batch_threshold(rows: list[dict], loop: str, batched: str) -> float:
    """The padding up to which the batched GEMMs are chosen: a threshold on the rows' paddings (a decision stump)
    minimising the geometric mean of (time of the path it picks / the row's faster of the two), placed halfway
    to the next row's padding; -1 (never) when no threshold beats never batching."""
    pads = sorted({r["padding_batched16"] for r in rows})

    def score(tau: float) -> float:
        return statistics.geometric_mean(
            r["ms"][batched if r["padding_batched16"] <= tau else loop] / min(r["ms"][loop], r["ms"][batched])
            for r in rows)

    tau = min([-1.0, *pads], key=score)  # ties: the smaller threshold (never batching first)
    if tau < 0:
        return -1.0
    above = [p for p in pads if p > tau]
    return round((tau + above[0]) / 2 if above else tau, 2)


def row_class(row: dict) -> str:
    """A measured row's shape class by the table's current rule, from the layer's recorded shape (the ``class``
    stored in older files followed the rule of their day)."""
    return classify(row["experts"], row["d_in"], row["d_hidden"])


def emulated(measurement: dict) -> bool:
    """Whether a measurement file's ISA was emulated: a wider CPU capped by ``ONEDNN_MAX_CPU_ISA`` (and MKL, ATen)."""
    return any(k in measurement["machine"].get("env", {}) for k in ISA_CAPS)


def _distance(a: str, b: str, dtype: str) -> int:
    """How far apart two ISAs are for filling a table gap: their distance in ISAS; in float32 (no AMX or bf16
    instructions: AVX-512 on all three AVX-512 ISAs) any AVX-512 ISA is nearer than AVX2 or other."""
    far = dtype == "float32" and ((a in AVX512_FAMILY) != (b in AVX512_FAMILY))
    return abs(ISAS.index(a) - ISAS.index(b)) + (len(ISAS) if far else 0)


def build_table(paths: list[Path]) -> dict[tuple[str, str, str], CpuChoice]:
    """The full table from measurement files: measured entries, then the gaps from the nearest measured ISA."""
    data = [(p.name, json.loads(p.read_text(encoding="utf-8"))) for p in sorted(paths)]
    table: dict[tuple[str, str, str], CpuChoice] = {}
    for isa in ISAS:
        files = [(n, d) for n, d in data if d["machine"]["isa"] == isa]
        native = [(n, d) for n, d in files if not emulated(d)]
        files = native or files  # a CPU of that ISA outranks a wider one capped to it
        for dt in DTYPES:
            for cls in SHAPE_CLASSES:
                rows = [r for _, d in files for r in d["rows"] if r["dtype"] == dt and row_class(r) == cls]
                used = sorted({n for n, d in files for r in d["rows"] if r["dtype"] == dt and row_class(r) == cls})
                if rows:
                    table[(isa, dt, cls)] = choose(rows, ", ".join(used))
    measured = dict(table)
    for isa in ISAS:
        for dt in DTYPES:
            for cls in SHAPE_CLASSES:
                if (isa, dt, cls) in table:
                    continue
                if dt == "bfloat16" and isa in NO_NATIVE_BF16 and (isa, "float32", cls) in table:
                    src = table[(isa, "float32", cls)]  # no native bf16: no oneDNN bf16 kernels, as float32
                    # (the float32 entry: measured, or filled just before, since DTYPES lists float32 first)
                    table[(isa, dt, cls)] = replace(src, source=f"as float32 (no native bf16): {src.source}")
                    continue
                own = (isa, dt, FALLBACK_CLASS.get(cls, cls))
                if own in measured:  # this ISA's own entry for the class these experts would otherwise have
                    src = table[own]
                    table[(isa, dt, cls)] = replace(src, source=f"not measured; as {own[2]}: {src.source}")
                    continue
                near = sorted((i for i in ISAS if (i, dt, cls) in measured), key=lambda i: _distance(i, isa, dt))
                if near:
                    src = table[(near[0], dt, cls)]
                    table[(isa, dt, cls)] = replace(src, source=f"not measured; as {near[0]}: {src.source}")
    return table


def _wrapped(text: str, indent: int, width: int = 96) -> str:
    """``text`` as adjacent string literals of at most ``width`` characters, one per line, indented."""
    parts, cur = [], ""
    for word in text.split(" "):
        if cur and len(cur) + 1 + len(word) > width:
            parts.append(cur + " ")
            cur = word
        else:
            cur = f"{cur} {word}" if cur else word
    parts.append(cur)
    return "\n".join(" " * indent + repr(p) for p in parts)


def render(table: dict[tuple[str, str, str], CpuChoice]) -> str:
    lines = ["TABLE: dict[tuple[str, str, str], CpuChoice] = {"]
    for isa in ISAS:
        for dt in DTYPES:
            for cls in SHAPE_CLASSES:
                c = table[(isa, dt, cls)]
                lines.append(f"    ({isa!r}, {dt!r}, {cls!r}):\n        CpuChoice({c.impl!r}, {c.align}, "
                             f"{c.max_batch_padding!r}, {c.expert_threads!r},\n{_wrapped(c.source, 18)}),")
    return "\n".join(lines + ["}"])


BEGIN, END = "# BEGIN TABLE", "# END TABLE"


def table_source(text: str) -> str:
    """The table block of cpu_table.py's text (between the marker lines, markers excluded)."""
    a, b = text.index(BEGIN), text.index(END)
    return text[text.index("\n", a) + 1:b].rstrip("\n")


def run_table(check: bool) -> int:
    paths = sorted(RESULTS.glob("cpu_dispatch_*.json"))
    if not paths:
        print("cpu_dispatch: error: no benchmarks/results/cpu_dispatch_*.json", file=sys.stderr)
        return 2
    new = render(build_table(paths))
    text = TABLE_FILE.read_text(encoding="utf-8")
    if check:
        same = table_source(text) == new
        print("the table matches the measurements" if same else "the table differs from the measurements")
        return 0 if same else 1
    a, b = text.index(BEGIN), text.index(END)
    TABLE_FILE.write_text(text[:text.index("\n", a) + 1] + new + "\n" + text[b:], encoding="utf-8")
    print(new)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--measure", action="store_true", help="time the candidates on this CPU")
    mode.add_argument("--table", action="store_true", help="rewrite the table in cpu_table.py from the results")
    mode.add_argument("--check", action="store_true", help="exit 1 if the table differs from the results")
    ap.add_argument("--layers", nargs="+", help="layers to time (default: the d=768 ones, smoe fgmoe mh2 mh3 icml-h2 "
                    "icml-h4; the tiny presets' tiny-smoe tiny-fgmoe tiny-mh2 tiny-mh3 go in a file of their own)")
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES), help="dtypes to time")
    ap.add_argument("--tokens", type=int, default=2048,
                    help="tokens per layer call (the tiny-* layers: their presets' batch, 4,096)")
    ap.add_argument("--pool", type=int, default=4, help="random batches every candidate is warmed up on")
    ap.add_argument("--repeats", type=int, default=7, help="timed calls per candidate (median reported)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--json", metavar="PATH", help="write the measurements here")
    args = ap.parse_args(argv)
    if args.measure:
        return run_measure(args)
    return run_table(args.check)


if __name__ == "__main__":
    sys.exit(main())
