"""The Triton dropless MoE path (:mod:`mhmoe.moe.dispatch.triton`) against ``grouped_mm`` / ``sorted`` on CUDA, and a
resource report of every kernel compiled for a GPU target (no GPU needed).

``--bench`` (CUDA): median ms of forward and forward + backward, and the peak memory above the inputs, of
``triton_moe`` (both backward designs: the fused act_dx, the default, and act_bwd + dx), ``grouped_moe``
(``torch._grouped_mm``) and ``sorted_moe`` at thin-expert shapes (D = 256..768, F = 512..2048), bf16 by
default, routing top-k softmax over E experts, round-robin timing.

``--aot`` (any machine with triton's NVIDIA backend, which ships ptxas; run it without TRITON_INTERPRET):
compiles every kernel x every candidate config x dtype x constexpr variant that the op may launch, for
``--arch`` (90 = H100, sm_90a), with each launch's real argument specialisation (16-byte alignment,
integers equal to 1), and reports per kernel x config: shared memory (and the autotuner's predicted
value), registers, spilled bytes, pipelined (cp.async) loads, wgmma. ``--check`` exits 1 if anything
fails an H100 (shared memory > 227 KiB, spills, unpipelined loads, no wgmma in bf16/tf32). ``--quick``:
the CI subset (the mh3 shape, SwiGLU, training and inference launches).

    python benchmarks/triton_moe.py --bench [--dtype bf16] [--repeats 20] [--json out.json]
    python benchmarks/triton_moe.py --aot [--arch 90] [--quick] [--check] [--json report.json]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import torch

# S tokens, K, E, D, F
SHAPES = [(16384, 2, 8, 256, 512), (16384, 2, 8, 256, 1024), (16384, 2, 16, 256, 2048),
          (8192, 2, 8, 384, 1024), (8192, 2, 8, 768, 2048), (49152, 3, 96, 256, 512)]


def _fwd_bwd(fn, args, grad) -> None:
    fn(*args).backward(grad)


def _fused(fn, on: bool = True):
    """``fn`` with the fused act_dx backward on (the default, MHMOE_TRITON_FUSE_DX=1) or off (act_bwd + dx) for the
    duration of each call: the benchmark's fwd_bwd runs the backward inside the call."""
    from mhmoe.moe.dispatch.triton import tiles

    def run(*args, **kwargs):
        old, tiles.FUSE_DX = tiles.FUSE_DX, on
        try:
            return fn(*args, **kwargs)
        finally:
            tiles.FUSE_DX = old

    return run


def bench(dtype: torch.dtype, repeats: int) -> dict:
    from mhmoe.moe.dispatch.grouped import grouped_moe
    from mhmoe.moe.dispatch.sorted import sorted_moe
    from mhmoe.moe.dispatch.triton import triton_moe
    from mhmoe.moe.experts import GroupedExperts
    from mhmoe.moe.routers import RouterOutput
    from mhmoe.research.timing import machine_info, time_fns

    dev = torch.device("cuda")
    machine = machine_info(dev)
    print(machine)
    rows = []
    fns = {"triton_act_bwd_dx": triton_moe, "triton_act_dx": triton_moe, "grouped_mm": grouped_moe,
           "sorted": sorted_moe}
    for S, K, E, D, F in SHAPES:
        torch.manual_seed(0)
        experts = GroupedExperts(E, D, F, init_std=D**-0.5).to(dev, dtype)
        x = torch.randn(S, D, device=dev, dtype=dtype, requires_grad=True)
        probs = torch.randn(S, E, device=dev).softmax(-1)
        w, idx = probs.topk(K)
        valid = torch.ones_like(idx, dtype=torch.bool)
        route = RouterOutput(w.requires_grad_(), idx, valid, probs, probs, None, valid[:, 0])
        g = torch.randn(S, D, device=dev, dtype=dtype)
        fwd = {n: functools.partial(f, x, route, experts) for n, f in fns.items()}
        both = {n: functools.partial(_fwd_bwd, f, (x, route, experts), g) for n, f in fns.items()}
        both["triton_act_dx"] = _fused(both["triton_act_dx"])  # the backward runs inside the call
        both["triton_act_bwd_dx"] = _fused(both["triton_act_bwd_dx"], on=False)
        t_fwd, _ = time_fns(fwd, dev, repeats)
        t_both, _ = time_fns(both, dev, repeats)
        mem = {}
        for n, fn in both.items():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fn()
            torch.cuda.synchronize()
            mem[n] = (torch.cuda.max_memory_allocated() - base) / 2**20
        line = "  ".join(f"{n} {t_fwd[n]:.3f}/{t_both[n]:.3f} ms {mem[n]:.0f} MiB" for n in fns)
        print(f"S={S} K={K} E={E} D={D} F={F} (fwd/fwd+bwd, peak): {line}")
        rows.append({"S": S, "K": K, "E": E, "D": D, "F": F, "dtype": str(dtype).replace("torch.", ""),
                     **{f"ms_fwd_{n}": t_fwd[n] for n in fns}, **{f"ms_fwd_bwd_{n}": t_both[n] for n in fns},
                     **{f"mb_{n}": mem[n] for n in fns}})
    return {"machine": machine, "rows": rows}


def warm(json_path: str | None) -> dict:
    """Compile and autotune the Triton path at the benchmark shapes (the parity layers at 16,384 tokens, bf16
    and fp32, forward without autograd and forward + backward; mh3 bf16 also with act_bwd + dx): the first calls,
    timed. With a shared TRITON_CACHE_DIR (benchmarks/gpu_lease.py sets one) later processes reuse the compiles."""
    from mhmoe.moe.layers import build_ffn_layer
    from mhmoe.research.bench import CONFIGS, D_MODEL

    dev, rows = torch.device("cuda"), []
    for name, cfg in CONFIGS.items():
        for dtype in (torch.bfloat16, torch.float32):
            layer = build_ffn_layer(D_MODEL, cfg.moe_config("triton")).to(dev, dtype)
            x = torch.randn(16384, D_MODEL, device=dev, dtype=dtype, requires_grad=True)
            variants = {"fwd": None, "fwd_bwd": None} | ({"fwd_bwd_act_bwd_dx": False} if
                                                         name == "mh3" and dtype == torch.bfloat16 else {})
            def step(variant: str, layer=layer, x=x) -> None:
                if variant == "fwd":
                    with torch.no_grad():
                        layer(x)
                    return
                out = layer(x)
                (out.out.float().sum() + out.aux_loss).backward()

            for variant, fused in variants.items():
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                (step if fused is None else _fused(step, fused))(variant)
                torch.cuda.synchronize()
                rows.append({"config": name, "dtype": str(dtype).replace("torch.", ""), "variant": variant,
                             "first_call_s": time.perf_counter() - t0})
                print(rows[-1], flush=True)
    result = {"machine": _machine(), "rows": rows}
    if json_path:
        import json

        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return result


def _machine() -> dict:
    from mhmoe.research.timing import machine_info

    return machine_info(torch.device("cuda"))


def aot(arch: int, quick: bool, check: bool, json_path: str | None) -> int:
    from mhmoe.moe.dispatch.triton import aot as A

    kw = dict(shapes=["mh3"], ffns=("swiglu",), scenarios=["train", "inference"]) if quick else {}
    t0 = time.time()
    def progress(r) -> None:
        print(f"  {time.time() - t0:5.0f}s {r.kernel} {r.dtype} {r.precision} [{r.variant}] {r.tile}", file=sys.stderr)

    reports = A.report(arch=arch, progress=progress, **kw)
    import triton

    print(f"triton {triton.__version__}: {len(reports)} kernel x config x specialisation compiles for sm_{arch}a in "
          f"{time.time() - t0:.0f} s")
    print(A.format_report(reports))
    problems = sorted({p for r in reports for p in r.problems()})
    for p in problems:
        print("PROBLEM:", p)
    if json_path:
        import json

        with open(json_path, "w", encoding="utf-8") as f:
            json.dump({"arch": arch, "triton": triton.__version__, "quick": quick, "summary": A.summary(reports),
                       "compiles": A.as_dicts(reports), "problems": problems}, f, indent=2)
    return 1 if check and problems else 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--aot", action="store_true")
    ap.add_argument("--warm", action="store_true", help="compile + autotune at the benchmark shapes (CUDA)")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--quick", action="store_true", help="--aot: the CI subset (mh3 shape, SwiGLU, train + inference)")
    ap.add_argument("--check", action="store_true", help="--aot: exit 1 if a compile fails an H100")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", metavar="PATH", help="also write the rows / the compile report as JSON")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    rc = 0
    if args.aot:
        if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            raise SystemExit("--aot needs the compiled kernels: unset TRITON_INTERPRET")
        rc = aot(args.arch, args.quick, args.check, args.json)
    if args.warm:
        warm(args.json)
    if args.bench:
        result = bench({"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype], args.repeats)
        if args.json:
            import json

            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(result, f, indent=2)
    if not (args.aot or args.bench or args.warm):
        ap.print_help()
    return rc


if __name__ == "__main__":
    sys.exit(main())
