"""The CPU tables of docs/PERFORMANCE.md from the JSON files of one CPU (``benchmarks/cpu_suite.py``'s, tagged by
the CPU's ISA), in the docs' formats, each under the ``<!-- source: ... -->`` line that names its files.

    python benchmarks/cpu_tables.py --tag avx512bf16            # print them
    python benchmarks/cpu_tables.py --tag amx --write           # replace the tables under the same source lines

``--write`` replaces a table of docs/PERFORMANCE.md whose source line names exactly the generated table's files
(several tables under one source line: in order) and lists the tables it found no such line for, to be placed
by hand with the prose that goes with them. Tables: the layer benchmark (``mhmoe bench moe``, two runs), the
profile, the C++ ops (three), whole tiny and paper-size models, generation, the thin experts, the C++ loop's GEMMs
on at::mm against its own kernel (two), the allocator's two settings and the dispatch candidates (d=768 layers,
tiny presets' layers; ``cpu_dispatch.py --table`` writes ``auto``'s table in the source).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = "benchmarks/results"
DOC = ROOT / "docs" / "PERFORMANCE.md"
BUCKETS = ["router", "head/merge", "experts fwd", "experts dgrad", "experts wgrad", "elementwise", "gather/combine",
           "copies/alloc", "python/autograd", "other"]  # benchmarks/moe_profile.py's, in its order
EXPERT_SHAPES = {"tiny-mh3": "tiny h=3: 93 × 64 × 128, 396 rows each",
                 "d768-mh3": "d=768 h=3: 96 × 256 × 512, 192 rows each"}


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _table(head: list[str], rows: list[list[str]]) -> str:
    return "\n".join([_row(head), "|" + "---|" * len(head), *(_row(r) for r in rows)])


def bench(runs: list[dict[str, Any]]) -> str:
    """``mhmoe bench moe``: the first run in full, the second's ratios beside it."""
    paired = any("ratio_dense_auto_paired" in r for r in runs[0]["rows"])  # older files: medians only
    head = ["config", "dtype", "pass", "`auto` runs", "`auto` ms", "dense ms (scaled)", "dense/auto",
            "dense/auto, run 2", *(["dense/auto paired", "paired, run 2"] if paired else []), "fastest path",
            "dense/fastest", "st_moe/fastest", "auto vs SMoE", "auto vs SMoE, run 2",
            *(["auto vs SMoE paired", "paired, run 2"] if paired else [])]
    f2 = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    rows = []
    for r, s in zip(runs[0]["rows"], runs[1]["rows"], strict=True):
        if (r["config"], r["dtype"], r["pass"]) != (s["config"], s["dtype"], s["pass"]):
            raise ValueError("the two runs' rows differ")
        pair = [f2(r.get("ratio_dense_auto_paired")), f2(s.get("ratio_dense_auto_paired"))] if paired else []
        smoe = [f2(r.get("ratio_vs_smoe_paired")), f2(s.get("ratio_vs_smoe_paired"))] if paired else []
        rows.append([r["config"], r["dtype"], r["pass"], f"`{r['auto_impl']}`", f"{r['ms_' + r['auto_impl']]:.1f}",
                     f"{r['ms_dense_norm']:.1f}", f2(r["ratio_dense_auto"]), f2(s["ratio_dense_auto"]), *pair,
                     f"`{r['best_impl']}`", f2(r["ratio_dense"]), f2(r.get("ratio_peer_st_moe")),
                     f2(r["ratio_vs_smoe_auto"]), f2(s["ratio_vs_smoe_auto"]), *smoe])
    return _table(head, rows)


def profile(data: dict[str, Any]) -> str:
    """``moe_profile.py``: ms (share) per bucket, each layer above its dense FFN."""
    rows = []
    for r in data["rows"]:
        rows.append([r["config"], r["dtype"], f"{r['ms_total']:.0f}", f"{r['ratio_dense']:.2f}",
                     *(f"{r['ms'][b]:.0f} ({100 * r['ms'][b] / r['ms_total']:.0f}%)" for b in BUCKETS)])
        d = r["dense_ms"]
        rows.append([f"dense, F = {r['dense_hidden']}", r["dtype"], f"{r['dense_ms_total']:.0f}", "-",
                     *(f"{d[b]:.0f}" if d[b] else "-" for b in BUCKETS)])
    return _table(["layer", "dtype", "ms", "dense/layer", *BUCKETS], rows)


def throughput(files: list[dict[str, Any]], params: bool) -> str:
    """``train_throughput.py``, one file per dtype (``params``: with the parameter counts; the paired ratios where
    every file has them)."""
    paired = all(r.get("vs_dense_paired") is not None for f in files for r in f["rows"])
    extra = ["vs_dense_paired", "vs_dense_fwd_bwd"] if paired else []
    head = ["preset", "dtype", "tokens/step", *(["params"] if params else []), "fwd FLOPs/token", "tokens/s",
            "ms/step", "fwd+bwd ms", "optimizer ms", "vs dense",
            *(["vs dense paired", "fwd+bwd vs dense"] if paired else [])]
    rows = [[r["preset"], r["dtype"], f"{r['tokens_per_step']:,}",
             *([f"{r['params'] / 1e6:.2f}M"] if params else []), f"{r['fwd_flops_per_token'] / 1e6:.2f}M",
             f"{r['tokens_per_s']:,.0f}", f"{r['ms_per_step']:.1f}", f"{r['ms_fwd_bwd']:.1f}",
             f"{r['ms_optimizer']:.1f}", f"{r['vs_dense']:.2f}", *(f"{r[k]:.2f}" for k in extra)]
            for f in files for r in f["rows"]]
    return _table(head, rows)


GEMM_KINDS = {"up": "X · W1", "dgrad": "dY · W2^T", "wgrad_x": "X^T · dH", "wgrad_h": "dH^T · dY"}


def _pass_ns(ns: float | None) -> str:
    """A SwiGLU pass's ns per element, or where it has no pass of its own (computed inside the GEMM)."""
    return "in the GEMM" if ns is None else f"{ns:.2f}"


def native_ops(data: dict[str, Any]) -> list[str]:
    """``native_ops.py``: the top-k, the expert ops with their SwiGLU passes, the GEMMs' locality."""
    topk = _table(["experts", "k", "C++ ns/row", "`torch.topk` ns/row"],
                  [[f"`{r['experts']}`", f"`{r['k']}`", f"{r['ns_per_row_cpp']:.0f}", f"{r['ns_per_row_torch']:.0f}"]
                   for r in data["topk"]])
    loops = _table(["expert shapes", "dtype", "GEMMs", "forward ms", "GFLOP/s", "backward ms", "GFLOP/s",
                    "SwiGLU forward ns/element", "SwiGLU backward ns/element"],
                   [[EXPERT_SHAPES[r["shape"]], r["dtype"], "own kernel" if r.get("own_gemm") else "`at::mm`",
                     f"{r['ms_forward']:.2f}", f"{r['gflops_forward']:.0f}",
                     f"{r['ms_backward']:.2f}", f"{r['gflops_backward']:.0f}",
                     *[_pass_ns(r[f"ns_per_element_swiglu_{d}"]) for d in ("forward", "backward")]]
                    for r in data["expert_loop"]])
    gemms = _table(["expert shapes", "dtype", "each expert its own weight", "one weight for all",
                    "one GEMM of all the rows", "own kernel, each its own weight"],
                   [[EXPERT_SHAPES[r["shape"]], r["dtype"], f"{r['gflops_distinct']:.0f}", f"{r['gflops_shared']:.0f}",
                     f"{r['gflops_one_gemm']:.0f}",
                     f"{r['gflops_distinct_own_kernel']:.0f}" if "gflops_distinct_own_kernel" in r else "-"]
                    for r in data.get("gemm_locality", [])])
    kinds = _table(["expert shapes", "GEMM", "`at::mm` GFLOP/s", "own kernel GFLOP/s"],
                   [[EXPERT_SHAPES[r["shape"]], label, f"{r[f'gflops_{k}_aten']:.0f}", f"{r[f'gflops_{k}_own']:.0f}"]
                    for r in data.get("gemm_kinds", []) for k, label in GEMM_KINDS.items()])
    return [topk, loops] + ([gemms] if data.get("gemm_locality") else []) + ([kinds] if data.get("gemm_kinds") else [])


def generate(data: dict[str, Any]) -> str:
    """``generate_throughput.py``."""
    rows = [[r["preset"], f"{r['params'] / 1e6:.2f}M", str(r["batch"]), str(r["prompt"]), str(r["new_tokens"]),
             f"{r['tokens_per_s']:,.0f}", f"{r['ms_per_token']:.2f}",
             "-" if r["vs_dense"] is None else f"{r['vs_dense']:.2f}"] for r in data["rows"]]
    return _table(["preset", "params", "batch", "prompt", "new tokens", "tokens/s", "ms/token", "vs dense"], rows)


def thin(data: dict[str, Any]) -> str:
    """``thin_experts.py``: the parameter-parity layers on each path, time and saved activations."""
    rows = [[r["label"], str(r["d_in"]), str(r["d_hidden"]), r["dtype"], f"{r['ms_sorted']:.1f}",
             f"{r['ms_fused']:.1f}", f"{r['ms_chunked']:.1f}", f"{r['saved_mb_fused']:.1f}",
             f"{r['saved_mb_chunked']:.1f}"] for r in data["rows"]]
    return _table(["layer", "d/h", "F", "dtype", "`sorted` ms", "`fused` ms", "`chunked` ms", "saved MiB `fused`",
                   "saved MiB `chunked`"], rows)


def expert_gemm(data: dict[str, Any]) -> str:
    """``expert_gemm.py``: the C++ loop's GEMMs on at::mm against its own bf16 kernel, per layer or per preset."""
    rows = data["rows"]
    if rows and "preset" in rows[0]:  # --presets: whole training steps
        return _table(["preset", "GEMMs", "rows aligned to", "ms/step", "vs dense"],
                      [[r["preset"], "own kernel" if r["gemm"] == "own kernel" else "`at::mm`", str(r["align"] or "-"),
                        f"{r['ms_per_step']:.1f}", f"{r['vs_dense']:.2f}"] for r in rows])
    return _table(["layer", "experts", "expert (d_in × F)", "tokens", "`at::mm` ms", "own kernel ms", "speedup",
                   "tensors bit-identical", "`auto` uses"],
                  [[r["layer"], str(r["n_experts"]), f"{r['d_in']} × {r['d_hidden']}", f"{r['tokens']:,}",
                    f"{r['ms_aten']:.1f}", f"{r['ms_own']:.1f}", f"{r['speedup']:.2f}",
                    f"{r['tensors_equal']} of {r['tensors']}", "own kernel" if r["auto_uses_own"] else "`at::mm`"]
                   for r in rows])


CANDIDATES = ["fused:1", "fused:16", "fused:32", "fused:32:intra", "batched:16", "sorted", "chunked:32"]


def _fastest_ms(row: dict[str, Any]) -> float:
    """The fastest candidate's ms in one ``cpu_dispatch.py --measure`` row (the dense FFN is not a candidate)."""
    return min(v for k, v in dict(row["ms"]).items() if k != "dense")


def candidates(data: dict[str, Any]) -> str:
    """``cpu_dispatch.py --measure``: every candidate's ms per layer and dtype (the fastest in bold), the scaled dense
    FFN, its ratio to the fastest and the rows all-experts batching would pad."""
    rows = []
    for r in data["rows"]:
        ms, best = dict(r["ms"]), _fastest_ms(r)
        cells = [("**{:.1f}**" if ms[c] == best else "{:.1f}").format(ms[c]) if c in ms else "-" for c in CANDIDATES]
        rows.append([r["layer"], r["class"], r["dtype"], *cells, f"{r['dense_norm_ms']:.1f}",
                     f"{r['dense_norm_ms'] / best:.2f}", f"{r['padding_batched16']:.0%}"])
    return _table(["layer", "class", "dtype", *(f"`{c}`" for c in CANDIDATES), "dense (scaled)", "dense/fastest",
                   "padding if batched"], rows)


def allocator(glibc: dict[str, Any], tuned: dict[str, Any]) -> str:
    """Two ``cpu_dispatch.py --measure`` files, glibc's default ``malloc`` and ``MHMOE_MALLOC=tuned``: page faults
    per call (the MoE layer: the median over its candidates; the dense FFN) and the dense FFN's rate over the
    fastest candidate's, both ways."""
    def fastest(r: dict[str, Any]) -> float:
        return r["dense_norm_ms"] / _fastest_ms(r)

    rows = []
    for g, t in zip(glibc["rows"], tuned["rows"], strict=True):
        if (g["layer"], g["dtype"]) != (t["layer"], t["dtype"]):
            raise ValueError("the two files' rows differ")
        faults = sorted(v for k, v in dict(g["page_faults"]).items() if k != "dense")
        rows.append([g["layer"], g["dtype"], f"{faults[len(faults) // 2]:,}", f"{dict(g['page_faults'])['dense']:,}",
                     f"{fastest(g):.2f}", f"{fastest(t):.2f}"])
    return _table(["layer", "dtype", "page faults per call, MoE (glibc; middle of the candidates)",
                   "page faults per call, dense (glibc)", "dense/fastest, glibc", "dense/fastest, tuned"], rows)


def tables(tag: str, results: Path) -> list[tuple[list[str], str]]:
    """(source files, markdown table) for every table whose files exist for ``tag``, in the docs' order."""
    def name(stem: str) -> str:
        return f"{RESULTS}/{stem.format(tag=tag)}.json"

    kinds: list[tuple[list[str], Callable[..., str | list[str]]]] = [
        ([name("moe_cpu_{tag}_2core"), name("moe_cpu_{tag}_2core_run2")], lambda a, b: bench([a, b])),
        ([name("moe_profile_{tag}")], profile),
        ([name("native_ops_{tag}")], native_ops),
        ([name("train_throughput_tiny_{tag}_float32"), name("train_throughput_tiny_{tag}_bfloat16")],
         lambda *f: throughput(list(f), params=False)),
        ([name("train_throughput_paper_{tag}_float32"), name("train_throughput_paper_{tag}_bfloat16")],
         lambda *f: throughput(list(f), params=True)),
        ([name("generate_throughput_tiny_{tag}")], generate),
        ([name("thin_experts_{tag}_2core")], thin),
        ([name("expert_gemm_{tag}_2t")], expert_gemm),
        ([name("expert_gemm_models_{tag}_2t")], expert_gemm),
        ([name("cpu_dispatch_{tag}_2t"), name("cpu_dispatch_{tag}_2t_tuned")], allocator),
        ([name("cpu_dispatch_{tag}_2t_tuned")], candidates),
        ([name("cpu_dispatch_{tag}_tiny_2t_tuned")], candidates),
    ]
    out: list[tuple[list[str], str]] = []
    for files, render in kinds:
        paths = [results / Path(f).name for f in files]
        if not all(p.is_file() for p in paths):
            continue
        made = render(*(json.loads(p.read_text(encoding="utf-8")) for p in paths))
        out += [(files, t) for t in (made if isinstance(made, list) else [made])]
    return out


def marker(files: list[str]) -> str:
    return f"<!-- source: {' '.join(files)} -->"


def write(doc: str, made: list[tuple[list[str], str]]) -> tuple[str, list[str]]:
    """``doc`` with every table replaced that sits under its source line (the k-th table of a source under its
    k-th line); the source lines not found."""
    lines = doc.split("\n")
    missing, seen = [], {}
    for files, table in made:
        mark = marker(files)
        k = seen[mark] = seen.get(mark, -1) + 1
        at = [i for i, line in enumerate(lines) if line.strip() == mark]
        if len(at) <= k:
            missing.append(mark)
            continue
        start = end = at[k] + 1
        while end < len(lines) and lines[end].startswith("|"):
            end += 1
        lines[start:end] = table.split("\n")
    return "\n".join(lines), missing


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tag", required=True, help="the files' ISA tag: amx, avx512bf16, avx512, avx2 (cpu_suite.py)")
    ap.add_argument("--results", default=str(ROOT / RESULTS), metavar="DIR", help="where the JSON files are")
    ap.add_argument("--write", action="store_true", help="replace the tables in docs/PERFORMANCE.md")
    args = ap.parse_args(argv)
    made = tables(args.tag, Path(args.results))
    if not made:
        print(f"cpu_tables: error: no {args.tag} files in {args.results}", file=sys.stderr)
        return 2
    if not args.write:
        print("\n\n".join(f"{marker(files)}\n{table}" for files, table in made))
        return 0
    text, missing = write(DOC.read_text(encoding="utf-8"), made)
    DOC.write_text(text, encoding="utf-8")
    print(f"cpu_tables: {len(made) - len(missing)} of {len(made)} tables written to {DOC.relative_to(ROOT)}")
    for mark in missing:
        print(f"cpu_tables: no line {mark} in the docs: place that table by hand", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
