"""The Triton dropless MoE path (:mod:`mhmoe.moe.dispatch.triton`) against ``grouped_mm`` / ``sorted`` on CUDA, and an
offline compile check of every kernel variant for a GPU target (no GPU needed).

``--bench`` (CUDA): median ms of forward and forward + backward, and the peak memory above the inputs, of
``triton_moe``, ``grouped_moe`` (``torch._grouped_mm``) and ``sorted_moe`` at thin-expert shapes
(D = 256..768, F = 512..2048), bf16 by default, routing top-k softmax over E experts, round-robin timing.

``--aot`` (any machine with triton's NVIDIA backend, which ships ptxas): compiles every kernel for
every autotune config, dtype and constexpr variant to a cubin for ``--arch`` (90 = H100) and prints
the largest shared-memory users (configs above the GPU's limit are skipped by the autotuner at run
time). Catches compile errors that the interpreter cannot see. Run it without TRITON_INTERPRET.

    python benchmarks/triton_moe.py --bench [--dtype bf16] [--repeats 20]
    python benchmarks/triton_moe.py --aot [--arch 90] [--quick]
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import torch

# S tokens, K, E, D, F
SHAPES = [(16384, 2, 8, 256, 512), (16384, 2, 8, 256, 1024), (16384, 2, 16, 256, 2048),
          (8192, 2, 8, 384, 1024), (8192, 2, 8, 768, 2048), (49152, 3, 96, 256, 512)]


def _fwd_bwd(fn, args, grad) -> None:
    fn(*args).backward(grad)


def bench(dtype: torch.dtype, repeats: int) -> dict:
    from mhmoe.moe.dispatch.grouped import grouped_moe
    from mhmoe.moe.dispatch.sorted import sorted_moe
    from mhmoe.moe.dispatch.triton import triton_moe
    from mhmoe.moe.experts import GroupedExperts
    from mhmoe.moe.routers import RouterOutput
    from mhmoe.research.bench import machine_info, time_fns

    dev = torch.device("cuda")
    machine = machine_info(dev)
    print(machine)
    rows = []
    fns = {"triton": triton_moe, "grouped_mm": grouped_moe, "sorted": sorted_moe}
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


def aot(arch: int, quick: bool) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mhmoe.moe.dispatch.triton import kernels as k

    assert not k.INTERPRETED, "run without TRITON_INTERPRET"
    target = GPUTarget("cuda", arch, 32)
    i32_ptrs = {"order_ptr", "tile_expert_ptr", "tile_row_ptr", "ends_ptr", "starts_ptr"}
    shared, n, t0 = [], 0, time.time()

    def compile_(fn, dt, consts, cfg=None):
        nonlocal n

        def ty(name):
            if name in consts:
                return "constexpr"
            if name in i32_ptrs:
                return "*i32"
            if name in ("weights_ptr", "part_ptr"):
                return "*fp32"
            if name == "valid_ptr":
                return "*u8"
            return "*" + dt if name.endswith("_ptr") else "i32"

        opts = {"num_warps": cfg.num_warps if cfg else 4, "num_stages": cfg.num_stages if cfg else 1}
        src = ASTSource(fn, {a: ty(a) for a in fn.arg_names}, constexprs=consts)
        kern = triton.compile(src, target=target, options=opts)
        shared.append((kern.metadata.shared, fn.__name__, dt, dict(consts), opts))
        n += 1

    def cfgs(lst):
        return lst[:1] if quick else lst

    for dt in ("bf16", "fp32"):
        prec = "ieee" if dt == "fp32" else "tf32"
        for gated in (True, False):
            for c in cfgs(k._UP_CFGS):
                tiles = dict(BM=k.BLOCK_M, BN=c.kwargs["BN"], BK=c.kwargs["BK"], PREC=prec, GATED=gated)
                for pre in (True, False):
                    compile_(k._up_fwd_kernel, dt, dict(tiles, STORE_PRE=pre, STORE_ACT=not pre), c)
                for dh, dw in ((True, True), (False, True), (True, False)):
                    compile_(k._act_bwd_kernel, dt, dict(tiles, PART=k.PART, NEED_DH=dh, NEED_DW=dw), c)
            for c in cfgs(k._DOWN_CFGS):
                tiles = dict(BM=k.BLOCK_M, BN=c.kwargs["BN"], BK=c.kwargs["BK"], PREC=prec)
                for act in (0, 1) if gated else (0, 2):
                    compile_(k._down_fwd_kernel, dt, dict(tiles, ACT=act), c)
                compile_(k._dx_kernel, dt, dict(tiles, GATED=gated), c)
            for c in cfgs(k._WGRAD_CFGS):
                compile_(k._wgrad_up_kernel, dt, dict(c.kwargs, GATED=gated, PREC=prec), c)
                compile_(k._wgrad_down_kernel, dt, dict(c.kwargs, GATED=gated, PREC=prec), c)
        compile_(k._ksum_kernel, dt, dict(BS=16, BD=128))
    print(f"triton {triton.__version__}: compiled {n} kernel variants for sm_{arch} in {time.time() - t0:.0f} s")
    for row in sorted(shared, key=lambda r: -r[0])[:8]:
        print(f"  shared {row[0] / 1024:.0f} KiB: {row[1]} {row[2]} {row[3]} {row[4]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--aot", action="store_true")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--quick", action="store_true", help="--aot: first autotune config of each kernel only")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", metavar="PATH", help="--bench: also write the rows and machine as JSON")
    args = ap.parse_args()
    if args.aot:
        if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            raise SystemExit("--aot needs the compiled kernels: unset TRITON_INTERPRET")
        aot(args.arch, args.quick)
    if args.bench:
        result = bench({"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype], args.repeats)
        if args.json:
            import json

            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(result, f, indent=2)
    if not (args.aot or args.bench):
        ap.print_help()


if __name__ == "__main__":
    main()
