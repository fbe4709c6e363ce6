"""Where the time of one MoE layer goes, kernel by kernel: ``torch.profiler`` over forward + backward.

For each configuration of ``mhmoe bench moe`` (d=768; default 2,048 tokens) and dtype, one layer (weights in
that dtype, input gradient on) and the aligned same-FLOPs dense FFN run forward + backward on a pool of random
batches (the routing changes from call to call, as in training); after the pool has run once (kernels built),
``--steps`` more calls are profiled and every ATen op's self CPU time is put into one bucket:

- ``router``: the router GEMM, softmax/top-k/sort/counts and the auxiliary losses (with their backward);
- ``head/merge``: the MH-MoE head and merge projections (forward and backward GEMMs);
- ``experts fwd`` / ``experts dgrad`` / ``experts wgrad``: the expert GEMMs of the forward, the backward's
  input-side GEMMs and its weight-gradient GEMMs;
- ``elementwise``: SwiGLU / ReLU and their backward, the routing-weight products and sums;
- ``gather/combine``: row gathers and fills by expert, the weighted combine (``embedding_bag``) both ways;
- ``copies/alloc``: dtype casts, copies, allocation and fills;
- ``python/autograd``: self time of autograd nodes and of the custom Function bodies (Python, per-expert loop);
- ``other``: views, reshapes and the rest.

The profile runs with ``--threads`` torch threads (default 1: the CPU path's expert threads are not seen by the
profiler, and one thread attributes every kernel cleanly); ``--impl`` picks the path (``auto``, or ``fused:A``
for the fused path with rows aligned to A and never batched: ``fused:1`` is the unaligned per-expert loop).
Times are the profiler's (wall clock of each op, averaged over the profiled calls), so the columns add up to
the layer's time under the profiler; the load average is recorded beside them::

    python benchmarks/moe_profile.py --impl fused:1 auto --json benchmarks/results/moe_profile_amx.json
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from mhmoe.moe.dispatch import fused as fused_mod
from mhmoe.moe.dispatch.fused import fused_moe
from mhmoe.moe.experts import DenseFFN
from mhmoe.moe.layers import build_ffn_layer
from mhmoe.research.bench import CONFIGS, D_MODEL, layer_flops
from mhmoe.runtime.cpu import cpu_info, cpu_isa
from mhmoe.runtime.cpu_malloc import malloc_from_env

BUCKETS = ["router", "head/merge", "experts fwd", "experts dgrad", "experts wgrad", "elementwise", "gather/combine",
           "copies/alloc", "python/autograd", "other"]
GEMMS = {"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm", "aten::baddbmm_"}
ELEMENTWISE = ("silu", "relu", "threshold", "mul", "sum", "add", "div", "sigmoid", "neg", "exp", "log", "pow", "sub")
GATHERS = ("index_select", "index_fill", "index_copy", "embedding_bag", "gather", "scatter", "index_put", "index_add",
           "_embedding_bag")
ROUTER = ("topk", "softmax", "_softmax", "argsort", "sort", "bincount", "one_hot", "where", "logsumexp", "clamp",
          "eq", "ne", "lt", "ge", "histc", "scatter_add", "mean", "square", "masked", "nonzero", "cumsum", "max",
          "arange")
COPIES = ("copy_", "_to_copy", "to", "clone", "contiguous", "empty", "zero", "fill", "full", "ones", "new_", "resize")
_PATCHED = "mhmoe::wgrad"
OWN_GEMMS = ("mhmoe::dot_gemm", "mhmoe::amx_gemm")  # the C++ loop's own bf16 GEMM kernels (dot product, AMX tiles)
WORK_LABELS = ("mhmoe::swiglu", *OWN_GEMMS)  # labels around C++ work of their own: their self time counts (the
# expert loop's SwiGLU passes and its own bf16 GEMMs; the AMX kernel's padded copies are ATen ops inside it)


def _label_wgrad() -> None:
    """Wrap the fused path's weight-gradient GEMM helper in a profiler label (this script only)."""
    inner = fused_mod._wgrad

    def labelled(*args):
        with record_function(_PATCHED):
            return inner(*args)

    fused_mod._wgrad = labelled


def gemm_operands(ev) -> tuple[list[int], list[int]]:
    s = ev.input_shapes
    return (s[1], s[2]) if "add" in ev.name else (s[0], s[1])


def autograd_wgrads(events) -> set[int]:
    """Ids of the weight-gradient GEMMs autograd runs for ``mm``/``addmm``: in every ``MmBackward0`` /
    ``AddmmBackward0`` node the input's gradient comes first, the weight's second (PyTorch's derivative order)."""
    children: dict[int, list] = collections.defaultdict(list)
    for ev in events:
        p = ev.cpu_parent
        if ev.name in GEMMS and p is not None and p.name in ("MmBackward0", "AddmmBackward0"):
            children[p.id].append(ev)
    return {sorted(evs, key=lambda e: e.time_range.start)[-1].id for evs in children.values() if len(evs) > 1}


def counted(name: str, self_us: float) -> bool:
    """Whether an event's self time is work of its own: ATen ops and the C++ loop's element-wise passes, not the
    labels of this script or the fused path that only wrap other ops (their self time is the profiler's)."""
    return self_us > 0 and (not name.startswith("mhmoe::") or name.startswith(WORK_LABELS))


def classify(ev, ancestors: list[str], dims: dict, wgrads: set[int] = frozenset()) -> str:
    """The bucket of one profiled op (see the module docstring); ``dims``: d_model, d_in, d_hidden, experts, tokens;
    ``wgrads``: :func:`autograd_wgrads`."""
    name = ev.name
    bwd = any("ackward" in a for a in ancestors)
    if name in GEMMS:
        a, b = gemm_operands(ev)
        if dims["experts"] in (a[-1], b[-1], a[-2]):
            return "router"
        dm, t = dims["d_model"], dims["tokens"]
        if dims["heads"] > 1 and b[-1] == dm and ((a[-1] == b[-2] == dm) or (a[-2] == dm and a[-1] == t)):
            return "head/merge"
        if _PATCHED in ancestors or ev.id in wgrads:
            return "experts wgrad"
        if len(a) == 3 and bwd and (a[1], b[2]) in ((dims["d_in"], dims["d_hidden"]), (dims["d_hidden"], dims["d_in"])):
            return "experts wgrad"
        return "experts dgrad" if bwd else "experts fwd"
    if name in OWN_GEMMS:  # one expert GEMM on the C++ loop's own kernel (mhmoe.moe.dispatch.native)
        if _PATCHED in ancestors:
            return "experts wgrad"
        return "experts dgrad" if any(a.endswith("expert_backward") for a in ancestors) else "experts fwd"
    short = name.removeprefix("aten::")
    if name.startswith("mhmoe::swiglu"):  # the C++ loop's fused SwiGLU passes (mhmoe.moe.dispatch.native)
        return "elementwise"
    if any(ancestor.startswith("mhmoe::router") for ancestor in ancestors):
        return "router"
    if any(s and s[-1] == dims["experts"] for s in ev.input_shapes or []):  # [S, E] scores and their gradients
        return "router"
    if any(g in short for g in GATHERS):
        return "gather/combine"
    if short.startswith(ELEMENTWISE) or short in ("silu_backward", "threshold_backward"):
        return "elementwise"
    if any(short.startswith(r) for r in ROUTER):
        return "router"
    if name in ("_FusedMoE", "_FusedMoEBackward") or name.startswith("autograd::") or name.endswith("Backward0"):
        return "python/autograd"
    if any(short.startswith(c) for c in COPIES):
        return "copies/alloc"
    return "other"


def _label_router(layer: torch.nn.Module) -> None:
    """Profiler labels around the router and its losses (hooks on the MoE layer's router and losses)."""
    moe = layer.moe if hasattr(layer, "moe") else layer
    fwd_router = moe.router.forward
    losses = moe.router_losses

    def router(*a, **k):
        with record_function("mhmoe::router"):
            return fwd_router(*a, **k)

    def router_losses(*a, **k):
        with record_function("mhmoe::router_losses"):
            return losses(*a, **k)

    moe.router.forward, moe.router_losses = router, router_losses


def make_layer(name: str, impl: str, dtype: torch.dtype) -> torch.nn.Module:
    cfg = CONFIGS[name]
    torch.manual_seed(0)
    kind, _, arg = impl.partition(":")
    layer = build_ffn_layer(D_MODEL, cfg.moe_config("auto" if kind == "auto" else kind)).to(dtype=dtype)
    if kind == "fused" and arg:
        moe = layer.moe if hasattr(layer, "moe") else layer
        moe.dispatch = lambda xs, route: fused_moe(xs, route, moe.experts, align=int(arg), max_batch_padding=-1.0)
    _label_router(layer)
    return layer


def dense_layer(name: str, tokens: int, dtype: torch.dtype) -> tuple[torch.nn.Module, float]:
    flops = layer_flops(CONFIGS[name], tokens)
    hidden = max(64, round(flops / tokens / (6 * D_MODEL) / 64) * 64)
    torch.manual_seed(0)
    return DenseFFN(D_MODEL, hidden).to(dtype=dtype), flops / (6 * D_MODEL * hidden * tokens)


def _step(module: torch.nn.Module, x: torch.Tensor) -> None:
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out = module(x)
    y, aux = (out.out, out.aux_loss) if hasattr(out, "out") else (out, 0.0)
    (y.float().sum() + aux).backward()


def profile_modules(mods: dict[str, tuple[torch.nn.Module, dict]], xs: list[torch.Tensor],
                    steps: int) -> dict[str, dict[str, float]]:
    """ms per call in every bucket for each module, averaged over ``steps`` profiled calls. The modules run in
    turn within every step (round-robin, so load changes hit them alike), after one pass over the pool."""
    for x in xs:
        for m, _ in mods.values():
            _step(m, x)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for i in range(steps):
            for name, (m, _) in mods.items():
                with record_function(f"mhmoe::cand::{name}"):
                    _step(m, xs[i % len(xs)])
    events = prof.events()
    wgrads = autograd_wgrads(events)
    out = {name: collections.defaultdict(float) for name in mods}
    for ev in events:
        if not counted(ev.name, ev.self_cpu_time_total):
            continue
        ancestors, e = [], ev.cpu_parent
        while e is not None:
            ancestors.append(e.name)
            e = e.cpu_parent
        cand = next((a.removeprefix("mhmoe::cand::") for a in ancestors if a.startswith("mhmoe::cand::")), None)
        if cand is None:
            continue
        out[cand][classify(ev, ancestors, mods[cand][1], wgrads)] += ev.self_cpu_time_total / steps / 1e3
    return {name: {b: out[name].get(b, 0.0) for b in BUCKETS} for name in mods}


def profile_config(name: str, impl: str, dtype: torch.dtype, tokens: int, pool: int, steps: int) -> dict:
    cfg = CONFIGS[name]
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(tokens, D_MODEL, generator=gen).to(dtype) for _ in range(pool)]
    dims = {"d_model": D_MODEL, "d_in": D_MODEL // cfg.heads, "d_hidden": cfg.d_expert, "experts": cfg.experts,
            "tokens": tokens, "heads": cfg.heads}
    dense_mod, scale = dense_layer(name, tokens, dtype)
    dense_dims = {**dims, "heads": 1, "experts": -1, "d_hidden": dense_mod.experts.d_hidden}
    res = profile_modules({"layer": (make_layer(name, impl, dtype), dims), "dense": (dense_mod, dense_dims)}, xs,
                          steps)
    layer, dense = res["layer"], res["dense"]
    total, dense_total = sum(layer.values()), sum(dense.values())
    return {"config": name, "dtype": str(dtype).removeprefix("torch."), "impl": impl, "tokens": tokens,
            "ms": layer, "ms_total": total, "share": {b: v / total for b, v in layer.items()},
            "dense_ms": dense, "dense_ms_total": dense_total,
            "dense_hidden": dense_mod.experts.d_hidden, "ratio_dense": dense_total * scale / total,
            "loadavg": list(os.getloadavg())}


def format_rows(rows: list[dict]) -> str:
    head = ["config", "dtype", "impl", "total ms", "x dense"] + BUCKETS
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["config"], r["dtype"], r["impl"], f"{r['ms_total']:.0f}", f"{r['ratio_dense']:.2f}"]
        cells += [f"{r['ms'][b]:.0f} ({100 * r['ms'][b] / r['ms_total']:.0f}%)" for b in BUCKETS]
        lines.append("| " + " | ".join(cells) + " |")
        d = r["dense_ms"]
        cells = [f"dense {r['dense_hidden']}", r["dtype"], "-", f"{r['dense_ms_total']:.0f}", "1.00"]
        cells += [f"{d[b]:.0f}" if d[b] else "-" for b in BUCKETS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS), help="layers to profile")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--impl", nargs="+", default=["auto"], help="auto, or fused:A (rows aligned to A, never batched)")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per layer call")
    ap.add_argument("--pool", type=int, default=4, help="random batches (routings) cycled through")
    ap.add_argument("--steps", type=int, default=4, help="profiled calls")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    malloc_from_env()  # MHMOE_MALLOC=tuned, as the mhmoe command
    _label_wgrad()
    rows = []
    for name in args.configs:
        for dt in args.dtypes:
            for impl in args.impl:
                rows.append(profile_config(name, impl, getattr(torch, dt), args.tokens, args.pool, args.steps))
                r = rows[-1]
                print(f"[profile] {name} {dt} {impl}: {r['ms_total']:.0f} ms, x dense {r['ratio_dense']:.2f}, "
                      f"load {r['loadavg'][0]:.2f}", file=sys.stderr, flush=True)
    model, flags = cpu_info()
    result = {"machine": {"cpu": model, "isa": cpu_isa(), "threads": torch.get_num_threads(),
                          "torch": torch.__version__,
                          "flags": sorted(f for f in flags if f.startswith(("avx512_bf16", "amx", "avx2", "avx512f")))},
              "date": datetime.date.today().isoformat(),
              "command": "python benchmarks/moe_profile.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "rows": rows}
    print(format_rows(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
