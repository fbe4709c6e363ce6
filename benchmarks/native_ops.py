"""Op-level timings of the C++ CPU ops (:mod:`mhmoe.moe.dispatch.native`), one thread by default.

- **router top-k**: ``torch.ops.mhmoe_cpu.topk_rows`` against ``torch.topk`` on 12,288 softmax rows, ns per row,
  round-robin, for (experts, k) pairs;
- **expert loop**: ``expert_forward`` / ``expert_backward`` at the expert shapes of the tiny h=3 preset (93 experts
  of 64 x 128, 396 rows each) and the d=768 h=3 layer (96 of 256 x 512, 192 rows), SwiGLU, float32 and
  bfloat16: ms per call and GFLOP/s of their GEMMs, and the fused SwiGLU passes alone (the ops label them for the
  profiler: ``mhmoe::swiglu_forward`` / ``mhmoe::swiglu_backward``) in ns per hidden element -- in bf16 a table
  lookup on AVX-512 builds, in fp32 exp and divisions;
- **GEMM locality**: ATen's GEMM (``torch.mm``, oneDNN / MKL) at the same expert shapes, the up-projection
  [rows, D] x [D, F] of every expert, GFLOP/s three ways, round-robin: each expert with its own weight and rows
  (what the expert loop sees: E weights that do not stay in cache), every expert reusing one weight and one
  block of rows (the same calls on cache-hot operands), and the same FLOPs as one [E * rows, D] x [D, F] GEMM
  (a dense layer's shape). The gap between the first two is what the operands' locality costs per call. Where
  ``auto`` runs the loop's own bf16 kernel (:func:`mhmoe.moe.dispatch.native.expert_gemm`), the first way again on it
  (``expert_matmul``; the expert loop above runs its GEMMs on it too);
- **GEMM kinds** (where the loop uses its own kernel): the loop's four kinds of bf16 expert GEMM (the
  up-projection, the backward's product with a transposed weight, the two weight gradients), each expert with
  its own operands, on at::mm and on the own kernel, GFLOP/s, round-robin.

::

    python benchmarks/native_ops.py --json benchmarks/results/native_ops_avx512bf16.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from mhmoe.moe.dispatch import native
from mhmoe.research.timing import machine_info, time_fns
from mhmoe.runtime.cpu_malloc import malloc_from_env

if str(Path(__file__).resolve().parent) not in sys.path:  # the table formatter next to this script
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpu_tables  # noqa: E402

TOPK_CASES = [(8, 1), (16, 2), (64, 2), (64, 6), (96, 3), (256, 8)]
EXPERT_CASES = {"tiny-mh3": (93, 64, 128, 396), "d768-mh3": (96, 256, 512, 192)}  # E, D, F, rows per expert
LABELS = ("mhmoe::swiglu_forward", "mhmoe::swiglu_backward")


def topk_rows(rows: int, repeats: int) -> list[dict]:
    ops, out = native._ops(), []
    gen = torch.Generator().manual_seed(0)
    for E, k in TOPK_CASES:
        scores = torch.randn(rows, E, generator=gen).softmax(-1)
        ms, _ = time_fns({"cpp": lambda s=scores, k=k: ops.topk_rows(s, k),
                          "torch": lambda s=scores, k=k: torch.topk(s, k)}, torch.device("cpu"), repeats)
        out.append({"experts": E, "k": k, "rows": rows, "ns_per_row_cpp": ms["cpp"] * 1e6 / rows,
                    "ns_per_row_torch": ms["torch"] * 1e6 / rows})
    return out


def expert_loop(name: str, dtype: torch.dtype, repeats: int, scale: float) -> dict:
    E, D, F, C = EXPERT_CASES[name]
    C = max(2, int(C * scale))
    ops, R = native._ops(), E * C
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    xs, dy, w1, w3, w2 = rand(R, D), rand(R, D), rand(E, D, F, std=0.125), rand(E, D, F, std=0.125), rand(E, F, D)
    h1, h3, ys, dxs = (torch.empty(R, F, dtype=dtype), torch.empty(R, F, dtype=dtype),
                       torch.empty(R, D, dtype=dtype), torch.empty(R, D, dtype=dtype))
    starts, sizes = [e * C for e in range(E)], [C] * E
    gemm = native.expert_gemm(dtype, D, F)  # the GEMMs where `auto` runs them (the loop's own kernel or at::mm)

    def fwd() -> None:
        ops.expert_forward(xs, w1, w2, w3, h1, h3, ys, starts, sizes, 1, gemm)

    def bwd() -> None:
        ops.expert_backward(xs, h1, h3, dy, w1, w2, w3, dxs, starts, sizes, 1, gemm)

    fwd()
    ms, _ = time_fns({"forward": fwd, "backward": bwd}, torch.device("cpu"), repeats)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            fwd()
            bwd()
    passes = {label: 0.0 for label in LABELS}
    for ev in prof.events():
        if ev.name in passes:
            passes[ev.name] += ev.cpu_time_total / repeats  # us per call of the op
    flops = 2 * R * D * F * 3
    return {"shape": name, "dtype": str(dtype).removeprefix("torch."), "experts": E, "d_in": D, "d_hidden": F,
            "rows": R, "own_gemm": gemm != native.GEMM_ATEN, "ms_forward": ms["forward"], "ms_backward": ms["backward"],
            "gflops_forward": flops / ms["forward"] / 1e6, "gflops_backward": 2 * flops / ms["backward"] / 1e6,
            # None: no pass of its own (the AMX kernel computes the forward's activation inside the up-projection)
            "ns_per_element_swiglu_forward": passes[LABELS[0]] * 1e3 / (R * F) if passes[LABELS[0]] else None,
            "ns_per_element_swiglu_backward": passes[LABELS[1]] * 1e3 / (R * F) if passes[LABELS[1]] else None}


def gemm_locality(name: str, dtype: torch.dtype, repeats: int, scale: float) -> dict:
    E, D, F, C = EXPERT_CASES[name]
    C = max(2, int(C * scale))
    gen = torch.Generator().manual_seed(0)
    xs, w = torch.randn(E, C, D, generator=gen).to(dtype), torch.randn(E, D, F, generator=gen).to(dtype)
    out = torch.empty(E, C, F, dtype=dtype)
    flat_x, flat_out = xs.view(E * C, D), out.view(E * C, F)

    def each_own() -> None:
        for e in range(E):
            torch.mm(xs[e], w[e], out=out[e])

    def all_one() -> None:
        for e in range(E):
            torch.mm(xs[0], w[0], out=out[e])

    fns = {"distinct": each_own, "shared": all_one, "one_gemm": lambda: torch.mm(flat_x, w[0], out=flat_out)}
    own = native.expert_gemm(dtype, D, F)
    if own != native.GEMM_ATEN:  # the loop's own kernel on the same calls as each_own
        ops = native._ops()

        def each_own_kernel() -> None:
            for e in range(E):
                ops.expert_matmul(xs[e], w[e], out[e], False, own)

        fns["distinct_own_kernel"] = each_own_kernel
    ms, _ = time_fns(fns, torch.device("cpu"), repeats)
    flops = 2 * E * C * D * F
    return {"shape": name, "dtype": str(dtype).removeprefix("torch."), "experts": E, "rows_per_expert": C,
            "d_in": D, "d_hidden": F, **{f"gflops_{k}": flops / v / 1e6 for k, v in ms.items()}}


def gemm_kinds(name: str, repeats: int, scale: float) -> dict:
    """The loop's four kinds of bf16 expert GEMM, each expert with its own operands, on at::mm and on the own kernel
    (``expert_matmul``, as the loop calls them): the up-projection X · W1, the backward's dY · W2^T (a transposed
    weight), the weight gradients X^T · dH (at::mm: with the loop's contiguous X^T copy) and dH^T · dY."""
    E, D, F, C = EXPERT_CASES[name]
    C = max(2, int(C * scale))
    gen = torch.Generator().manual_seed(0)
    ops = native._ops()

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    w1, w2, x, h, g = rand(E, D, F), rand(E, F, D), rand(E, C, D), rand(E, C, F), rand(E, C, D)
    out_h, out_w1, out_w2 = (torch.empty(E, C, F, dtype=torch.bfloat16), torch.empty(E, D, F, dtype=torch.bfloat16),
                             torch.empty(E, F, D, dtype=torch.bfloat16))
    kinds = {"up": lambda e, own: (x[e], w1[e], out_h[e]),
             "dgrad": lambda e, own: (g[e], w2[e].t(), out_h[e]),
             "wgrad_x": lambda e, own: (x[e].t() if own else x[e].t().contiguous(), h[e], out_w1[e]),
             "wgrad_h": lambda e, own: (h[e].t(), g[e], out_w2[e])}

    def loop(kind: str, own: bool) -> Callable[[], None]:
        def run() -> None:
            for e in range(E):
                a, b, out = kinds[kind](e, own)
                ops.expert_matmul(a, b, out, False, native.own_gemm() if own else native.GEMM_ATEN, own)
        return run

    fns = {f"{k}_{'own' if own else 'aten'}": loop(k, own) for k in kinds for own in (False, True)}
    ms, _ = time_fns(fns, torch.device("cpu"), repeats)
    flops = 2 * E * C * D * F
    return {"shape": name, "experts": E, "rows_per_expert": C, "d_in": D, "d_hidden": F,
            **{f"gflops_{k}": flops / v / 1e6 for k, v in ms.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the expert ops run one lane)")
    ap.add_argument("--repeats", type=int, default=10, help="timed round-robin repeats")
    ap.add_argument("--rows", type=int, default=12288, help="top-k rows")
    ap.add_argument("--scale", type=float, default=1.0, help="rows per expert x this (smaller: a quick run)")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    malloc_from_env()  # MHMOE_MALLOC=tuned, as the mhmoe command
    if native._ops() is None:
        print("the C++ ops are not available here", file=sys.stderr)
        return 2
    topk = topk_rows(args.rows, args.repeats)
    loops = [expert_loop(n, dt, args.repeats, args.scale) for n in EXPERT_CASES
             for dt in (torch.float32, torch.bfloat16)]
    gemms = [gemm_locality(n, dt, args.repeats, args.scale) for n in EXPERT_CASES
             for dt in (torch.float32, torch.bfloat16)]
    result = {"machine": machine_info(torch.device("cpu")), "topk": topk, "expert_loop": loops,
              "gemm_locality": gemms}
    if native.expert_gemm(torch.bfloat16, 64, 128) != native.GEMM_ATEN:  # a CPU where the loop uses its own kernel
        result["gemm_kinds"] = [gemm_kinds(n, args.repeats, args.scale) for n in EXPERT_CASES]
    print("\n\n".join(cpu_tables.native_ops(result)))  # as docs/PERFORMANCE.md shows them
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
