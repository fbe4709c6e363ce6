"""Thin, wide experts: the MH-MoE layers of ``mhmoe reproduce icml-table5`` under each CPU path.

At parameter parity with X-MoE, MH-MoE with h heads has experts of input width d/h and hidden
width ~ h * 4d * (8 experts, top-2, ReLU): at tiny scale (d=192) h=8 gives 24 -> 5,952 -> 24. Such
GEMMs do little arithmetic per hidden element, so the [N, F] hidden tensors (N = tokens * h * k
routed rows: 65,536 x 5,952 floats = 1.5 GB per layer at h=8) and the passes over them dominate.
This script times one layer of every row of the suite (the layer exactly as the suite builds it:
router, head/merge MLPs, experts) forward + backward, on ``--tokens`` tokens, for the ``sorted``,
``fused`` and ``chunked`` paths, and records what each keeps for the backward (bytes of the
tensors autograd saves, via ``saved_tensors_hooks``)::

    MHMOE_MALLOC=tuned python benchmarks/thin_experts.py --json benchmarks/results/thin_experts_avx512bf16_2core.json

Prints a markdown table (docs/PERFORMANCE.md, "Thin experts").
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

from mhmoe.moe.layers import build_ffn_layer
from mhmoe.research.bench import _autocast, _runner
from mhmoe.research.reproduce import SUITES
from mhmoe.research.timing import machine_info, time_fns
from mhmoe.runtime.cpu_malloc import malloc_from_env

IMPLS = ("sorted", "fused", "chunked")


def saved_bytes(layer: torch.nn.Module, x: torch.Tensor, dtype: torch.dtype) -> int:
    """Bytes of the tensors autograd saves for the backward in one forward (distinct storages, the
    layer's own parameters excluded -- they exist either way)."""
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _autocast(lambda: layer(x), x.device, dtype)() if dtype != torch.float32 else layer(x)
    return sum(seen.values())


def bench_rows(tokens: int, dtypes: list[str], repeats: int, scale: str = "tiny") -> list[dict]:
    rows = []
    for suite_row in SUITES["icml-table5"]:
        run = suite_row.build(scale)
        d, moe = run.model.d_model, run.model.moe
        for dname in dtypes:
            dtype = getattr(torch, dname)
            row = {"label": suite_row.label, "heads": moe.heads, "d_in": d // moe.heads, "d_hidden": moe.d_expert,
                   "experts": moe.n_experts, "top_k": moe.top_k, "dtype": dname, "tokens": tokens}
            layers, fns = {}, {}
            x = torch.randn(tokens, d, requires_grad=True)
            for impl in IMPLS:
                torch.manual_seed(0)
                layers[impl] = build_ffn_layer(d, replace(moe, impl=impl))
                fn = _runner(layers[impl], x, "fwd_bwd")
                fns[impl] = _autocast(fn, x.device, dtype) if dtype != torch.float32 else fn
            times, _ = time_fns(fns, x.device, repeats, warmup=1)  # round-robin over the paths
            for impl, layer in layers.items():
                row[f"ms_{impl}"] = times[impl]
                row[f"saved_mb_{impl}"] = saved_bytes(layer, x, dtype) / 2**20
                print(f"{suite_row.label} {dname} {impl}: {row[f'ms_{impl}']:.0f} ms, "
                      f"{row[f'saved_mb_{impl}']:.0f} MB saved", file=sys.stderr, flush=True)
            row["speedup_chunked"] = row["ms_sorted"] / row["ms_chunked"]
            rows.append(row)
    return rows


def format_rows(rows: list[dict]) -> str:
    head = ["row", "d_in -> F", "dtype", "sorted ms", "fused ms", "chunked ms", "sorted/chunked",
            "saved MB sorted", "saved MB fused", "saved MB chunked"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        out.append(f"| {r['label']} | {r['d_in']} -> {r['d_hidden']} | {r['dtype']} | {r['ms_sorted']:.0f} | "
                   f"{r['ms_fused']:.0f} | {r['ms_chunked']:.0f} | {r['speedup_chunked']:.2f} | "
                   f"{r['saved_mb_sorted']:.0f} | {r['saved_mb_fused']:.0f} | {r['saved_mb_chunked']:.0f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per layer call (the suite's 16 x 256)")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    malloc_from_env()  # as the mhmoe command does (MHMOE_MALLOC=tuned, docs/PERFORMANCE.md)
    if args.tokens < 1 or args.repeats < 1:
        print("thin_experts: error: invalid --tokens/--repeats: allowed >= 1", file=sys.stderr)
        return 2
    rows = bench_rows(args.tokens, args.dtypes, args.repeats)
    machine = machine_info(torch.device("cpu"))
    print(format_rows(rows))
    print(f"\nmachine: {machine}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "rows": rows}, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
