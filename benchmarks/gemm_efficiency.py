"""GEMM throughput at the shapes the MoE benchmark runs, vs the dense-equivalent FFN's GEMMs.

Explains the MoE/dense ratios in docs/PERFORMANCE.md: with T tokens, an expert of config C sees
rows = T*h*k/E rows (balanced routing), input width d/h and hidden F. Prints GFLOP/s per shape.

    python benchmarks/gemm_efficiency.py [--tokens 4096] [--repeats 20] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args()
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
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"threads": torch.get_num_threads(), "torch": torch.__version__, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
