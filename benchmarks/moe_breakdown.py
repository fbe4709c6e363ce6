"""Where the time of one MoE layer goes: forward + backward split into its parts, timed round-robin.

For each config of `mhmoe bench moe` (d=768, 4,096 tokens) and dtype, times forward + backward
(parameter and input gradients) of:

- ``layer``: the whole layer as the model runs it (``impl="auto"``);
- ``no_experts``: the same layer with the expert computation replaced by a weighted identity
  (head/merge projections + router + aux losses + reshapes);
- ``head_merge``: the head and merge projections alone (MH-MoE only);
- ``experts``: the dispatched experts alone (:func:`mhmoe.moe.dispatch.fused.fused_moe` on balanced routing:
  gathers, expert GEMMs, SwiGLU, combine);
- ``expert_gemms``: only the expert GEMMs of ``experts`` (3 forward + 6 backward per expert, same
  rows, same expert threads) -- the floor for ``experts``.

Derived: router + losses = no_experts - head_merge; dispatch + element-wise = experts - expert_gemms.

    python benchmarks/moe_breakdown.py [--configs mh3 ...] [--dtypes bfloat16 ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from mhmoe.moe.dispatch.fused import _blocks, _run_blocks, expert_workers, fused_moe
from mhmoe.moe.layers import build_ffn_layer
from mhmoe.moe.routers import RouterOutput
from mhmoe.research.bench import CONFIGS, D_MODEL, DTYPES, _runner
from mhmoe.research.timing import machine_info, time_fns
from mhmoe.runtime.cpu_malloc import malloc_from_env


def balanced_route(S: int, E: int, K: int) -> RouterOutput:
    """Every expert gets S*K/E rows: token s, slot k -> expert (s*K + k) mod E."""
    experts = (torch.arange(S * K) % E).view(S, K)
    weights = torch.full((S, K), 1.0 / K, requires_grad=True)
    valid = torch.ones(S, K, dtype=torch.bool)
    logits = torch.zeros(S, E)
    return RouterOutput(weights, experts, valid, logits, logits.softmax(-1), torch.bincount(experts.flatten(),
                        minlength=E), torch.ones(S, dtype=torch.bool))


def gemm_only(xs: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, counts: list[int]):
    """The 9 GEMMs per expert of a SwiGLU fwd+bwd, into preallocated buffers, no element-wise work."""
    N, Fh = xs.shape[0], w1.shape[2]
    h1, h3, ys = xs.new_empty(N, Fh), xs.new_empty(N, Fh), torch.empty_like(xs)
    g, dx = torch.randn_like(xs), torch.empty_like(xs)
    gw1, gw2, gw3 = torch.empty_like(w1), torch.empty_like(w2), torch.empty_like(w3)
    blocks, workers = _blocks(counts, 0), expert_workers(counts, xs.device)

    def work(e: int, r: slice) -> None:
        torch.mm(xs[r], w1[e], out=h1[r])
        torch.mm(xs[r], w3[e], out=h3[r])
        torch.mm(h1[r], w2[e], out=ys[r])
        da = torch.mm(g[r], w2[e].t())
        torch.mm(h1[r].t(), g[r], out=gw2[e])
        torch.mm(xs[r].t(), da, out=gw3[e])
        torch.mm(xs[r].t(), da, out=gw1[e])
        torch.mm(da, w3[e].t(), out=dx[r])
        dx[r].addmm_(da, w1[e].t())

    return lambda: _run_blocks(blocks, work, workers)


def breakdown(name: str, dtype: torch.dtype, tokens: int, repeats: int) -> dict:
    cfg = CONFIGS[name]
    torch.manual_seed(0)
    x = torch.randn(tokens, D_MODEL, dtype=dtype, requires_grad=True)
    layer = build_ffn_layer(D_MODEL, cfg.moe_config("auto")).to(dtype=dtype)
    bare = build_ffn_layer(D_MODEL, cfg.moe_config("auto")).to(dtype=dtype)
    moe = bare.moe if hasattr(bare, "moe") else bare
    moe.dispatch = lambda xs, route: xs * route.weights.sum(1, keepdim=True).to(xs.dtype)
    fns = {"layer": _runner(layer, x, "fwd_bwd"), "no_experts": _runner(bare, x, "fwd_bwd")}
    if cfg.heads > 1:
        projections = torch.nn.Sequential(layer.head, layer.merge)
        fns["head_merge"] = _runner(projections, x, "fwd_bwd")
    experts = moe.experts
    S, K, E = tokens * cfg.heads, cfg.top_k, cfg.experts
    xs = torch.randn(S, D_MODEL // cfg.heads, dtype=dtype, requires_grad=True)
    route = balanced_route(S, E, K)

    def run_experts() -> None:
        experts.zero_grad(set_to_none=True)
        xs.grad = route.weights.grad = None
        fused_moe(xs, route, experts).float().sum().backward()

    fns["experts"] = run_experts
    rows = torch.randn(S * K // E * E, D_MODEL // cfg.heads, dtype=dtype)
    fns["expert_gemms"] = gemm_only(rows, experts.w1.detach(), experts.w2.detach(), experts.w3.detach(),
                                    [S * K // E] * E)
    ms, _ = time_fns(fns, x.device, repeats)
    row = {"config": name, "dtype": str(dtype).replace("torch.", ""), "tokens": tokens,
           **{f"ms_{k}": v for k, v in ms.items()}}
    row["ms_router_losses"] = ms["no_experts"] - ms.get("head_merge", 0.0)
    row["ms_dispatch_elementwise"] = ms["experts"] - ms["expert_gemms"]
    gemm_flops = 9 * 2 * S * K * (D_MODEL // cfg.heads) * cfg.d_expert
    row["expert_gemm_gflops"] = gemm_flops / ms["expert_gemms"] / 1e6
    return row


COLUMNS = ["layer", "no_experts", "head_merge", "router_losses", "experts", "expert_gemms", "dispatch_elementwise"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json")
    args = ap.parse_args()
    malloc_from_env()
    rows = []
    for name in args.configs:
        for dt in args.dtypes:
            print(f"[breakdown] {name} {dt}", file=sys.stderr)
            rows.append(breakdown(name, DTYPES[dt], args.tokens, args.repeats))
    head = ["config", "dtype"] + [f"{c} ms" for c in COLUMNS] + ["expert GEMM GFLOP/s"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        cells = [r["config"], r["dtype"]] + [f"{r[f'ms_{c}']:.1f}" if f"ms_{c}" in r else "-" for c in COLUMNS]
        print("| " + " | ".join(cells + [f"{r['expert_gemm_gflops']:.0f}"]) + " |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"machine": machine_info(torch.device("cpu")), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
