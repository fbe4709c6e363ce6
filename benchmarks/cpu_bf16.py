"""bfloat16 vs float32 on this CPU: a square matmul and an SMoE layer forward, with the CPU's bf16 flags.

Without native bf16 instructions (x86 ``avx512_bf16`` / ``amx_bf16``, Arm ``bf16``) PyTorch's CPU bf16
kernels convert in software and run far slower than float32; this script measures by how much, and
is the source of the slowdown the ``mhmoe`` command quotes in its warning (mhmoe.runtime.cpu)::

    python benchmarks/cpu_bf16.py --json benchmarks/results/cpu_bf16_avx2.json

Timing: one warm-up call, then the median of ``--repeats`` calls (bf16 layer calls: ``--bf16-layer-repeats``,
they take seconds each without native bf16).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from mhmoe.config.moe import MoEConfig
from mhmoe.moe.layers import build_ffn_layer
from mhmoe.runtime.cpu import cpu_info, native_bf16

D_MODEL = 768


def median_s(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_row(n: int, dtype: torch.dtype, repeats: int) -> dict:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    s = median_s(lambda: a @ b, repeats)
    return {"op": f"matmul {n}x{n}x{n}", "dtype": str(dtype).removeprefix("torch."), "seconds": s,
            "gflops": 2 * n**3 / s / 1e9}


def layer_row(tokens: int, dtype: torch.dtype, repeats: int) -> dict:
    """SMoE 8 x 2048 top-1 (SwiGLU) at d=768: the v2 paper's baseline layer, forward only, weights in ``dtype``."""
    layer = build_ffn_layer(D_MODEL, MoEConfig(n_experts=8, top_k=1, d_expert=2048)).to(dtype).eval()
    x = torch.randn(1, tokens, D_MODEL, dtype=dtype)
    with torch.no_grad():
        s = median_s(lambda: layer(x, mask=None), repeats)
    return {"op": f"SMoE 8x2048 top-1 forward, {tokens} tokens", "dtype": str(dtype).removeprefix("torch."),
            "seconds": s}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=1024, help="matmul size n (n x n x n)")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per layer forward")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats (float32, bf16 matmul)")
    ap.add_argument("--bf16-layer-repeats", type=int, default=1, help="timed repeats of the bf16 layer forward")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = ap.parse_args(argv)
    rows = [matmul_row(args.size, torch.float32, args.repeats), matmul_row(args.size, torch.bfloat16, args.repeats),
            layer_row(args.tokens, torch.float32, args.repeats),
            layer_row(args.tokens, torch.bfloat16, args.bf16_layer_repeats)]
    model, flags = cpu_info()
    result = {
        "machine": {"cpu": model, "native_bf16": native_bf16(), "bf16_flags": sorted(f for f in flags if "bf16" in f),
                    "avx512": any(f.startswith("avx512") for f in flags), "threads": torch.get_num_threads(),
                    "torch": torch.__version__, "python": platform.python_version()},
        "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/cpu_bf16.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "rows": rows,
        "slowdown_matmul": rows[1]["seconds"] / rows[0]["seconds"],
        "slowdown_layer": rows[3]["seconds"] / rows[2]["seconds"],
    }
    for r in rows:
        extra = f"  {r['gflops']:.1f} GFLOP/s" if "gflops" in r else ""
        print(f"{r['op']:<45} {r['dtype']:<9} {r['seconds'] * 1e3:10.1f} ms{extra}")
    print(f"bf16 / fp32 time: matmul {result['slowdown_matmul']:.1f}x, layer {result['slowdown_layer']:.1f}x "
          f"({model}, native bf16: {result['machine']['native_bf16']})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
