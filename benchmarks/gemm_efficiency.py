"""GEMM throughput at the shapes the MoE benchmark runs, vs the dense-equivalent FFN's GEMMs.

Explains the MoE/dense ratios in docs/PERFORMANCE.md: with T tokens, an expert of config C sees
rows = T*h*k/E rows (balanced routing), input width d/h and hidden F. Prints GFLOP/s per shape.

``--cold``: also each expert's up-projection GEMM (``torch.mm``: MKL in fp32, oneDNN in bf16) as the expert loop
meets it, swept over the E experts: with every operand shared by all experts (``hot``: in cache), with one kind of
operand each expert's own (``rows``, ``weight``, ``output``: that one comes from memory) and with all three each
expert's own (``cold``, as in training); ms per GEMM, the fastest of ``--repeats`` sweeps, on the current torch
threads.

    python benchmarks/gemm_efficiency.py [--tokens 4096] [--repeats 20] [--cold] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from mhmoe.runtime.cpu import cpu_info, cpu_isa
from mhmoe.runtime.cpu_malloc import malloc_from_env

D = 768
CONFIGS = {"smoe": (8, 2048, 1, 1), "fgmoe": (16, 1024, 2, 1), "mh2": (40, 768, 2, 2), "mh3": (96, 512, 3, 3)}


def gflops(m: int, k: int, n: int, dtype: torch.dtype, repeats: int) -> float:
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    for _ in range(3):
        a @ b
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        ts.append(time.perf_counter() - t)
    return 2 * m * k * n / statistics.median(ts) / 1e9


COLD_CASES = {"hot": (), "rows": ("rows",), "weight": ("weight",), "output": ("output",),
              "cold": ("rows", "weight", "output")}


def sweep_ms(m: int, k: int, n: int, dtype: torch.dtype, experts: int, own: tuple[str, ...], sweeps: int) -> float:
    """ms per GEMM of out [m, n] = rows [m, k] @ weight [k, n] over ``experts`` GEMMs in a row, the operands named in
    ``own`` ("rows", "weight", "output") each GEMM's own and the others one shared by all; fastest of ``sweeps``."""
    def operands(name: str, shape: tuple[int, int]) -> list[torch.Tensor]:
        return [torch.randn(shape, dtype=dtype) for _ in range(experts if name in own else 1)]

    a, b, c = operands("rows", (m, k)), operands("weight", (k, n)), operands("output", (m, n))
    best = float("inf")
    for _ in range(sweeps + 1):  # the first sweep warms up
        t = time.perf_counter()
        for e in range(experts):
            torch.mm(a[e % len(a)], b[e % len(b)], out=c[e % len(c)])
        best = min(best, (time.perf_counter() - t) / experts)
    return best * 1e3


def cold_rows(tokens: int, sweeps: int, dtypes: tuple[torch.dtype, ...]) -> list[dict]:
    """The --cold table's rows: every config's up-projection, every case of COLD_CASES (ms per GEMM)."""
    out = []
    for dtype in dtypes:
        for name, (E, F, k, h) in CONFIGS.items():
            m = tokens * h * k // E
            row = {"dtype": str(dtype)[6:], "config": name, "experts": E, "m": m, "k_in": D // h, "n_hidden": F}
            for case, own in COLD_CASES.items():
                row[f"ms_{case}"] = sweep_ms(m, D // h, F, dtype, E, own, sweeps)
            out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per layer call (default: 4096)")
    ap.add_argument("--repeats", type=int, default=20, help="timed calls per shape / sweeps per case (default: 20)")
    ap.add_argument("--cold", action="store_true", help="also the up-projections with cold operands (see above)")
    ap.add_argument("--json", help="write the rows to this JSON file")
    args = ap.parse_args()
    malloc_from_env()
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for name, (E, F, k, h) in CONFIGS.items():
            m = args.tokens * h * k // E
            up, down = gflops(m, D // h, F, dtype, args.repeats), gflops(m, F, D // h, dtype, args.repeats)
            rows.append({"dtype": str(dtype)[6:], "shape": f"{name} expert", "m": m, "k_in": D // h, "n_hidden": F,
                         "gflops_up": up, "gflops_down": down})
        dense_f = 2048
        up, down = gflops(args.tokens, D, dense_f, dtype, args.repeats), gflops(args.tokens, dense_f, D, dtype,
                                                                               args.repeats)
        rows.append({"dtype": str(dtype)[6:], "shape": "dense FFN", "m": args.tokens, "k_in": D, "n_hidden": dense_f,
                     "gflops_up": up, "gflops_down": down})
    print("| dtype | GEMM | rows m | in | hidden | GFLOP/s up (m x in x hidden) | GFLOP/s down |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dtype']} | {r['shape']} | {r['m']} | {r['k_in']} | {r['n_hidden']} | {r['gflops_up']:.0f} | "
              f"{r['gflops_down']:.0f} |")
    cold = cold_rows(args.tokens, args.repeats, (torch.float32, torch.bfloat16)) if args.cold else []
    if cold:
        print("\n| dtype | config | rows m | in | hidden | " + " | ".join(f"{c} ms" for c in COLD_CASES) + " |")
        print("|---|---|---|---|---|" + "---|" * len(COLD_CASES))
        for r in cold:
            print(f"| {r['dtype']} | {r['config']} | {r['m']} | {r['k_in']} | {r['n_hidden']} | "
                  + " | ".join(f"{r[f'ms_{c}']:.3f}" for c in COLD_CASES) + " |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"threads": torch.get_num_threads(), "torch": torch.__version__, "tokens": args.tokens,
                       "cpu": cpu_info()[0], "isa": cpu_isa(), "rows": rows, "cold": cold}, f, indent=2)


if __name__ == "__main__":
    main()
