"""What stands between one MoE layer and the dense FFN's FLOP rate: forward + backward split into its parts, each
timed in the same rounds as the dense FFN, and what the experts would need for a target ratio.

For each config of ``mhmoe bench moe`` (d=768) and dtype, forward + backward (parameter and input gradients),
round-robin in one process over ``--repeats`` rounds:

- ``layer``: the whole layer (``impl="auto"``);
- ``dense``: the aligned same-FLOPs dense SwiGLU FFN of ``mhmoe bench moe``, its time scaled to the layer's FLOPs;
- ``outside``: the same layer with its experts replaced by a weighted identity (head and merge projections, router,
  router losses, reshapes);
- ``head_merge``: the head and merge projections alone (MH-MoE only);
- ``experts``: the routed experts alone on balanced routing (``fused_moe``: gathers, the expert loop, combine);
- ``loop`` / ``loop_hot``: the C++ expert loop alone (``torch.ops.mhmoe_cpu``, on the GEMMs ``auto`` gives it) on
  the same rows, each expert with its own weights / all experts with one weight, which stays in cache: the loop as
  it would run if its weights cost no memory traffic (where the C++ loop is built);
- ``floor``: the expert GEMMs alone as batched GEMMs (``torch.bmm``: oneDNN / MKL) on pre-gathered equal blocks,
  the ``floor`` of ``mhmoe bench moe``.

Derived, each the median over the rounds of that round's times over its own dense time (paired, as the layer
benchmark's paired ratio: this machine's speed may move between rounds):

- ``ratio``: dense / layer (1.00: the layer runs at the dense FFN's FLOP rate);
- ``share_<part>``: the part's time over the dense FFN's (scaled to the layer's FLOPs);
- ``ceiling_dense_rate``: the ratio if the experts, gathers included, ran at the dense FFN's FLOP rate and the rest
  took what it takes: ``1 / (share_outside + expert FLOP share)``;
- ``ceiling_hot``: the ratio if the loop's weights cost no traffic: ``dense / (layer - loop + loop_hot)``;
- ``speedup_needed``: how many times faster the experts, gathers included, would have to run for ``--target`` with
  the rest as it is: ``experts / (dense / target - outside)`` (``inf``: the rest alone takes the budget).

::

    MHMOE_MALLOC=tuned python benchmarks/moe_breakdown.py --tokens 2048 --repeats 15 \\
        --json benchmarks/results/moe_breakdown_amx.json
    python benchmarks/moe_breakdown.py --table benchmarks/results/moe_breakdown_amx.json   # its table again
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import replace

import torch

from mhmoe.config.flops import moe_layer_flops
from mhmoe.errors import ConfigError
from mhmoe.moe.dispatch import native
from mhmoe.moe.dispatch.fused import fused_moe
from mhmoe.moe.experts import DenseFFN
from mhmoe.moe.layers import build_ffn_layer
from mhmoe.moe.routers import RouterOutput
from mhmoe.research import bench
from mhmoe.research.bench import CONFIGS, D_MODEL, DTYPES, BenchConfig, layer_flops, moe_overrides
from mhmoe.research.timing import machine_info, time_fns
from mhmoe.runtime.cpu import cpu_isa
from mhmoe.runtime.cpu_malloc import malloc_from_env

PARTS = ("layer", "outside", "head_merge", "experts", "loop", "loop_hot", "floor")


def balanced_route(S: int, E: int, K: int) -> RouterOutput:
    """Every expert gets S*K/E rows (one more for the first S*K mod E): token s, slot k -> expert (s*K + k) mod E."""
    experts = (torch.arange(S * K) % E).view(S, K)
    weights = torch.full((S, K), 1.0 / K, requires_grad=True)
    valid = torch.ones(S, K, dtype=torch.bool)
    logits = torch.zeros(S, E)
    return RouterOutput(weights, experts, valid, logits, logits.softmax(-1), torch.bincount(experts.flatten(),
                        minlength=E), torch.ones(S, dtype=torch.bool))


def expert_flops(cfg: BenchConfig, tokens: int) -> int:
    """Forward FLOPs of the config's routed experts on ``tokens`` tokens (the ``experts`` part of
    :func:`mhmoe.config.flops.moe_layer_flops`, which :func:`~mhmoe.research.bench.layer_flops` sums)."""
    return round(tokens * moe_layer_flops(cfg.moe_config("auto"), D_MODEL)["experts"])


def loop_fns(experts: torch.nn.Module, counts: list[int], dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    """``loop`` and ``loop_hot``: forward + backward of the C++ expert loop on random rows, ``counts`` rows per
    expert, with the experts' weights / one weight for all ({} where the C++ loop is not built)."""
    ops = native.expert_ops(dtype)
    if ops is None:
        return {}
    w = {k: None if getattr(experts, k) is None else getattr(experts, k).detach() for k in ("w1", "w2", "w3")}
    E, D, F = w["w1"].shape
    gemm = native.expert_gemm(dtype, D, F)
    starts = [sum(counts[:e]) for e in range(E)]
    R, threads = sum(counts), torch.get_num_threads()
    xs, dy = torch.randn(R, D, dtype=dtype), torch.randn(R, D, dtype=dtype)
    h1, ys, dxs = (torch.empty(R, n, dtype=dtype) for n in (F, D, D))
    h3 = None if w["w3"] is None else torch.empty(R, F, dtype=dtype)  # SwiGLU only (ReLU experts have no W3)

    def run(wt: dict[str, torch.Tensor | None]) -> Callable[[], object]:
        def step() -> object:
            ops.expert_forward(xs, wt["w1"], wt["w2"], wt["w3"], h1, h3, ys, starts, counts, threads, gemm)
            return ops.expert_backward(xs, h1, h3, dy, wt["w1"], wt["w2"], wt["w3"], dxs, starts, counts, threads,
                                       gemm)
        return step

    hot = {k: None if v is None else v[:1].expand_as(v) for k, v in w.items()}
    return {"loop": run(w), "loop_hot": run(hot)}


def timed_parts(cfg: BenchConfig, dtype: torch.dtype, tokens: int) -> tuple[dict[str, Callable[[], object]], dict]:
    """The functions to time (``dense`` and the parts of the module docstring) and the row's fixed facts."""
    torch.manual_seed(0)
    x = torch.randn(tokens, D_MODEL, dtype=dtype, requires_grad=True)
    layer = build_ffn_layer(D_MODEL, cfg.moe_config("auto")).to(dtype=dtype)
    bare = build_ffn_layer(D_MODEL, cfg.moe_config("auto")).to(dtype=dtype)
    moe = bare.moe if hasattr(bare, "moe") else bare
    moe.dispatch = lambda xs, route: xs * route.weights.sum(1, keepdim=True).to(xs.dtype)
    flops = layer_flops(cfg, tokens)
    hidden = bench.aligned_hidden(flops / tokens, D_MODEL, bench.CPU_ALIGN)
    dense = DenseFFN(D_MODEL, hidden).to(dtype=dtype)
    fns = {"dense": bench._runner(dense, x, "fwd_bwd"), "layer": bench._runner(layer, x, "fwd_bwd"),
           "outside": bench._runner(bare, x, "fwd_bwd")}
    if cfg.heads > 1:
        fns["head_merge"] = bench._runner(torch.nn.Sequential(layer.head, layer.merge), x, "fwd_bwd")
    experts = (layer.moe if hasattr(layer, "moe") else layer).experts
    S, K, E = tokens * cfg.heads, cfg.top_k, cfg.experts
    xs = torch.randn(S, D_MODEL // cfg.heads, dtype=dtype, requires_grad=True)
    route = balanced_route(S, E, K)

    def run_experts() -> None:
        experts.zero_grad(set_to_none=True)
        xs.grad = route.weights.grad = None
        fused_moe(xs, route, experts).float().sum().backward()

    fns["experts"] = run_experts
    auto = bench.auto_path(layer, x)
    if auto == "fused":
        fns.update(loop_fns(experts, route.counts.tolist(), dtype))
    fns["floor"] = bench._runner(bench.GemmFloor(cfg, tokens).to(dtype=dtype), x, "fwd_bwd")
    facts = {"config": cfg.name, "overrides": dict(cfg.overrides), "dtype": str(dtype).removeprefix("torch."),
             "tokens": tokens, "auto_impl": auto, "flops_fwd": flops, "expert_flops_fwd": expert_flops(cfg, tokens),
             "dense_hidden": hidden, "dense_scale": flops / bench.dense_flops(hidden, tokens)}
    return fns, facts


def derive(samples: dict[str, list[float]], facts: dict, target: float) -> dict:
    """The paired shares, ratio and ceilings of the module docstring from every function's times by round."""
    dense = [t * facts["dense_scale"] for t in samples["dense"]]
    out: dict = {}
    for part in PARTS:
        if part in samples:
            out[f"share_{part}"] = statistics.median(t / d for t, d in zip(samples[part], dense, strict=True))
    out["ratio"] = statistics.median(d / t for t, d in zip(samples["layer"], dense, strict=True))
    expert_share = facts["expert_flops_fwd"] / facts["flops_fwd"]
    out["expert_flop_share"] = expert_share
    out["ceiling_dense_rate"] = 1.0 / (out["share_outside"] + expert_share)

    def needed(e: float, o: float, d: float) -> float:
        budget = d / target - o
        return e / budget if budget > 0 else float("inf")

    out["speedup_needed"] = statistics.median(needed(e, o, d) for e, o, d in zip(
        samples["experts"], samples["outside"], dense, strict=True))
    if "loop_hot" in samples:
        out["ceiling_hot"] = statistics.median(d / (t - c + h) for t, c, h, d in zip(
            samples["layer"], samples["loop"], samples["loop_hot"], dense, strict=True))
    fb = 3 * facts["flops_fwd"] / 1e9  # GFLOP of forward + backward (the backward twice the forward's)
    out["dense_tflops"] = fb / statistics.median(dense)
    out["experts_tflops"] = 3 * facts["expert_flops_fwd"] / 1e9 / statistics.median(samples["experts"])
    return out


def breakdown(cfg: BenchConfig, dtype: torch.dtype, tokens: int, repeats: int, target: float) -> dict:
    """One row: every part timed round-robin with the dense FFN, its medians (ms, the dense FFN's scaled) and the
    derived values of :func:`derive`."""
    fns, row = timed_parts(cfg, dtype, tokens)
    samples: dict[str, list[float]] = {}
    times, _ = time_fns(fns, torch.device("cpu"), repeats, samples=samples)
    row.update({f"ms_{k}": v for k, v in times.items()})
    row["ms_dense"] *= row["dense_scale"]
    row.update(derive(samples, row, target))
    return row


COLUMNS = (("ms_dense", "dense ms", ".1f"), ("ratio", "dense/layer", ".2f"), ("share_outside", "outside", ".2f"),
           ("share_head_merge", "head/merge", ".2f"), ("share_experts", "experts", ".2f"),
           ("share_loop", "loop", ".2f"), ("share_loop_hot", "loop, hot", ".2f"), ("share_floor", "floor", ".2f"),
           ("ceiling_dense_rate", "ceiling: experts at dense rate", ".2f"),
           ("ceiling_hot", "ceiling: hot loop", ".2f"), ("speedup_needed", "experts' speed-up needed", ".2f"))


def markdown(rows: list[dict], target: float) -> str:
    """The table of every row (its --set fields, and its tokens in backticks: a label, not a measurement): the
    dense FFN's scaled time, the paired ratio, each part's time as a share of the dense FFN's, the two ceilings and
    the experts' speed-up needed for ``target`` ('-' where a part was not timed)."""
    head = ["config", "--set", "dtype", "tokens"] + [label.replace("needed", f"needed for {target:.2f}")
                                                     for _, label, _ in COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        settings = " ".join(f"`{k}={v}`" for k, v in r.get("overrides", {}).items()) or "-"
        cells = [r["config"], settings, r["dtype"], f"`{r['tokens']}`"] + [
            format(r[k], f) if k in r else "-" for k, _, f in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS), help="layers to split")
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES), help="dtypes to run")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per layer call (default: 2048)")
    ap.add_argument("--repeats", type=int, default=15, help="round-robin rounds (default: 15)")
    ap.add_argument("--target", type=float, default=0.85, help="the ratio speedup_needed is for (default: 0.85)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", dest="overrides",
                    help="a MoEConfig field for every layer, as for mhmoe bench moe (e.g. --set router_dtype=model)")
    ap.add_argument("--json", help="write the rows and the machine to this file")
    ap.add_argument("--table", nargs="+", metavar="JSON", help="print the table of these result files and exit")
    args = ap.parse_args(argv)
    if args.table:
        runs = [json.loads(open(path, encoding="utf-8").read()) for path in args.table]
        print(markdown([r for run in runs for r in run["rows"]], runs[0].get("target", args.target)))
        return 0
    try:
        overrides = tuple(sorted(moe_overrides(args.overrides).items()))
    except ConfigError as e:
        print(f"moe_breakdown: {e}", file=sys.stderr)
        return 2
    malloc_from_env()
    rows = []
    for name in args.configs:
        for dt in args.dtypes:
            print(f"[breakdown] {name} {dt}", file=sys.stderr)
            cfg = replace(CONFIGS[name], overrides=overrides)
            rows.append(breakdown(cfg, DTYPES[dt], args.tokens, args.repeats, args.target))
    print(markdown(rows, args.target))
    if args.json:
        meta = {"machine": machine_info(torch.device("cpu")), "isa": cpu_isa(), "threads": torch.get_num_threads(),
                "date": datetime.date.today().isoformat(), "repeats": args.repeats, "target": args.target,
                "command": "python benchmarks/moe_breakdown.py " + " ".join(argv if argv is not None else sys.argv[1:])}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({**meta, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
