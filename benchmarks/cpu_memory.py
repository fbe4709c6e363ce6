"""Memory traffic on a CPU: how much of the MoE layers' distance to the dense FFN is the bytes they move.

Three parts, in one process:

1. **bandwidth**: the machine's stream bandwidth by working-set size (``--sizes``, MiB): a read (the sum of an fp32
   tensor) and a copy (read + write, both counted), on 1 thread and on ``--threads``, the best of ``--passes``.
2. **traffic** (counted from the shapes, nothing timed): the bytes one forward + backward of each d=768 layer's
   experts moves at least, against the aligned same-FLOPs dense FFN's. Weights: read forward, read backward, their
   gradient written (3x). SwiGLU pre-activations h1, h3 (the backward's input): written, read back (2x). Rows: the
   gathered expert inputs (written by the gather, read forward and backward), the expert outputs (written, read by
   the combine), their gradients (written, read) and the input gradients (written, read by the scatter): 9x one
   [rows, d_in] block; the dense FFN's x (read twice), y, dy and dx: 5x [tokens, d]. Padding rows, the head and
   merge projections and the router are left out (a few [tokens, d] blocks and 2.4 MB of weights). The working set
   (weights + pre-activations) says which bandwidth level of part 1 applies.
3. **loop**: the C++ expert loop of ``--loop-configs`` in each dtype, its GEMMs where ``auto`` puts them, every
   expert on the same number of rows (routed rows / E): with every expert its own weights (as in training) against
   one weight for all (which stays in cache: the loop as it would run if its weights cost no memory traffic), the
   forward with and without keeping the pre-activations for the backward (as in training / as in inference), and
   the backward. Round-robin over ``--rounds``; the fastest and the median.

::

    MHMOE_MALLOC=tuned python benchmarks/cpu_memory.py --json benchmarks/results/cpu_memory_amx.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

from mhmoe.moe.dispatch import native
from mhmoe.research.bench import CONFIGS, CPU_ALIGN, D_MODEL, DTYPES, aligned_hidden, layer_flops
from mhmoe.runtime.cpu import cpu_info, cpu_isa
from mhmoe.runtime.cpu_malloc import malloc_from_env

MB = 1e6  # traffic in decimal megabytes; bandwidth in GB/s (1e9 bytes)


def _best(f: Callable[[], object], passes: int) -> float:
    """The fastest of ``passes`` calls of f, in seconds (after one warm-up call)."""
    f()
    best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best


def bandwidth(sizes_mib: list[int], threads: list[int], passes: int) -> list[dict]:
    """Read and copy bandwidth (GB/s) for each working-set size and thread count."""
    rows = []
    for n in threads:
        torch.set_num_threads(n)
        for mib in sizes_mib:
            src = torch.ones(mib * 2**20 // 4)
            dst = torch.empty_like(src)
            nbytes = src.numel() * 4
            read = _best(src.sum, passes)
            copy = _best(lambda src=src, dst=dst: dst.copy_(src), passes)
            rows.append({"threads": n, "mib": mib, "read_gbs": nbytes / read / 1e9,
                         "copy_gbs": 2 * nbytes / copy / 1e9})
    return rows


def traffic(name: str, dtype: torch.dtype, tokens: int) -> dict:
    """Bytes one fwd+bwd of the layer's experts and of the aligned same-FLOPs dense FFN moves at least (module
    docstring), in MB, with their working sets."""
    cfg, b = CONFIGS[name], torch.finfo(dtype).bits // 8
    d_in, rows = D_MODEL // cfg.heads, tokens * cfg.heads * cfg.top_k
    weights = cfg.experts * 3 * d_in * cfg.d_expert * b
    hidden = 2 * rows * cfg.d_expert * b
    row_block = rows * d_in * b
    d_hidden = aligned_hidden(layer_flops(cfg, tokens) / tokens, D_MODEL, CPU_ALIGN)
    dense_weights, dense_hidden = 3 * D_MODEL * d_hidden * b, 2 * tokens * d_hidden * b
    moe = 3 * weights + 2 * hidden + 9 * row_block
    dense = 3 * dense_weights + 2 * dense_hidden + 5 * tokens * D_MODEL * b
    return {"config": name, "dtype": str(dtype).removeprefix("torch."), "tokens": tokens, "rows": rows,
            "weights_mb": weights / MB, "hidden_mb": hidden / MB, "rows_mb": row_block / MB,
            "traffic_mb": moe / MB, "working_set_mb": (weights + hidden) / MB, "dense_hidden": d_hidden,
            "dense_traffic_mb": dense / MB, "dense_working_set_mb": (dense_weights + dense_hidden) / MB,
            "traffic_ratio": moe / dense}


def _loop_tensors(name: str, dtype: torch.dtype, tokens: int) -> tuple[dict, list[int], list[int]]:
    """Random rows, weights and buffers of the layer's experts, every expert on rows / E rows (a multiple of 16)."""
    cfg = CONFIGS[name]
    E, D, F = cfg.experts, D_MODEL // cfg.heads, cfg.d_expert
    per = max(16, tokens * cfg.heads * cfg.top_k // E // 16 * 16)
    sizes, starts = [per] * E, [per * e for e in range(E)]
    R = per * E
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    t = {"xs": rand(R, D), "dy": rand(R, D), "w1": rand(E, D, F, scale=0.05), "w3": rand(E, D, F, scale=0.05),
         "w2": rand(E, F, D, scale=0.05)}
    t.update({k: torch.empty(R, n, dtype=dtype) for k, n in (("h1", F), ("h3", F), ("ys", D), ("dxs", D))})
    return t, starts, sizes


def loop(name: str, dtype: torch.dtype, tokens: int, threads: int, rounds: int) -> dict:
    """The expert loop with cold (each expert its own) and hot (one shared) weights: ms, fastest and median."""
    ops = native.expert_ops(dtype)
    if ops is None:
        raise SystemExit("cpu_memory: the C++ expert loop is not available (MHMOE_NATIVE=0 or no compiler)")
    torch.set_num_threads(threads)
    t, starts, sizes = _loop_tensors(name, dtype, tokens)
    E, D, F = t["w1"].shape
    gemm = native.expert_gemm(dtype, D, F)
    hot = {k: t[k][:1].expand_as(t[k]) for k in ("w1", "w2", "w3")}

    def fwd(w: dict, keep: bool) -> Callable[[], object]:
        h1, h3 = (t["h1"], t["h3"]) if keep else (None, None)
        return lambda: ops.expert_forward(t["xs"], w["w1"], w["w2"], w["w3"], h1, h3, t["ys"], starts, sizes,
                                          threads, gemm)

    def bwd(w: dict) -> Callable[[], object]:
        return lambda: ops.expert_backward(t["xs"], t["h1"], t["h3"], t["dy"], w["w1"], w["w2"], w["w3"], t["dxs"],
                                           starts, sizes, threads, gemm)

    cases = {"fwd": fwd(t, True), "fwd_hot": fwd(hot, True), "fwd_nokeep": fwd(t, False),
             "fwd_nokeep_hot": fwd(hot, False), "bwd": bwd(t), "bwd_hot": bwd(hot)}
    times: dict[str, list[float]] = {k: [] for k in cases}
    for f in cases.values():
        f()  # warm-up (the backward reads the forward's h1, h3: any forward with keep wrote them)
    for _ in range(rounds):
        for k, f in cases.items():
            t0 = time.perf_counter()
            f()
            times[k].append((time.perf_counter() - t0) * 1e3)
    out = {"config": name, "dtype": str(dtype).removeprefix("torch."), "threads": threads, "rounds": rounds,
           "rows_per_expert": sizes[0], "gemm": {0: "at::mm", 1: "dot", 2: "amx"}.get(gemm, str(gemm))}
    for k, v in times.items():
        out[f"ms_{k}_min"], out[f"ms_{k}_median"] = min(v), statistics.median(v)
    return out


def markdown(result: dict) -> str:
    """The three tables as Markdown."""
    lines = ["| threads | MiB | read GB/s | copy GB/s |", "|---|---|---|---|"]
    lines += [f"| {r['threads']} | {r['mib']} | {r['read_gbs']:.1f} | {r['copy_gbs']:.1f} |"
              for r in result["bandwidth"]]
    lines += ["", "| config | dtype | weights MB | pre-activations MB | traffic MB | working set MB | dense traffic MB "
              "| dense working set MB | traffic / dense |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['config']} | {r['dtype']} | {r['weights_mb']:.1f} | {r['hidden_mb']:.1f} | {r['traffic_mb']:.0f} "
              f"| {r['working_set_mb']:.1f} | {r['dense_traffic_mb']:.0f} | {r['dense_working_set_mb']:.1f} "
              f"| {r['traffic_ratio']:.2f} |" for r in result["traffic"]]
    keys = ("fwd", "fwd_hot", "fwd_nokeep", "fwd_nokeep_hot", "bwd", "bwd_hot")
    lines += ["", "| config | dtype | GEMMs | " + " | ".join(f"{k} ms" for k in keys) + " |",
              "|---|---|---|" + "---|" * len(keys)]
    lines += [f"| {r['config']} | {r['dtype']} | {r['gemm']} | "
              + " | ".join(f"{r[f'ms_{k}_min']:.1f} ({r[f'ms_{k}_median']:.1f})" for k in keys) + " |"
              for r in result["loop"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[4, 16, 64, 256], help="working sets to stream, MiB")
    p.add_argument("--threads", type=int, default=2, help="threads of the multi-thread bandwidth and of the loop")
    p.add_argument("--passes", type=int, default=9, help="bandwidth: passes per measurement (the fastest counts)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per layer call")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS), help="layers to count")
    p.add_argument("--loop-configs", nargs="*", default=["mh3", "smoe"], choices=list(CONFIGS),
                   help="layers whose expert loop is timed (none: skip the loop)")
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES), help="dtypes")
    p.add_argument("--rounds", type=int, default=15, help="loop: round-robin rounds")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    args = p.parse_args(argv)
    malloc_from_env()
    dtypes = [DTYPES[d] for d in args.dtypes]
    result = {
        "machine": {"cpu": cpu_info()[0], "isa": cpu_isa(), "threads": args.threads, "torch": torch.__version__},
        "date": datetime.date.today().isoformat(), "command": "python benchmarks/cpu_memory.py " + " ".join(
            sys.argv[1:] if argv is None else argv),
        "bandwidth": bandwidth(args.sizes, sorted({1, args.threads}), args.passes),
        "traffic": [traffic(c, d, args.tokens) for c in args.configs for d in dtypes],
        "loop": [loop(c, d, args.tokens, args.threads, args.rounds) for c in args.loop_configs for d in dtypes],
    }
    print(markdown(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
