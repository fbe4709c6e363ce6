"""The traffic model of the Triton MoE kernels (:mod:`mhmoe.research.traffic`) for the four parity configs:
per kernel the FLOPs, the bytes between L2 and the SMs and to DRAM, the config the model would pick and
the predicted time on an H100 SXM, then the layer's predicted time for the design before the Hopper
rework (64-row tiles), the current one (128-row tiles, act_bwd + dx) and the fused act_dx variant,
beside the dense same-FLOPs FFN. Predictions only: nothing here runs a kernel.

    python benchmarks/traffic_model.py [--tokens 16384] [--dtype bf16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys

from mhmoe.moe.dispatch.triton.tiles import padded
from mhmoe.research.bench import CONFIGS, D_MODEL, aligned_hidden, layer_flops
from mhmoe.research.traffic import (
    H100_SXM,
    Shape,
    dense_prediction,
    expert_kernels,
    layer_prediction,
    without_l2,
)

DESIGNS = {"before (64-row tiles)": dict(legacy=True), "now (128-row, act_bwd + dx)": dict(fused=False),
           "act_dx (MHMOE_TRITON_FUSE_DX=1)": dict(fused=True)}


def kernel_table(name: str, tokens: int, dtype: str) -> tuple[str, list[dict]]:
    cfg = CONFIGS[name]
    item = 2 if dtype == "bf16" else 4
    sh = Shape(tokens * cfg.heads, cfg.top_k, cfg.experts, padded(D_MODEL // cfg.heads), padded(cfg.d_expert), item)
    lines = [f"\n{name}: N = {sh.n} rows, E = {sh.e}, D = {sh.d}, F = {sh.f}, {dtype}, forward + backward",
             "| kernel | config | GFLOP | L2 GB | DRAM GB | us (L2-bound) | us (no L2 bound) | bound |",
             "|---|---|---|---|---|---|---|---|"]
    rows = []
    for legacy, fused in ((True, False), (False, False), (False, True)):
        with_l2 = expert_kernels(sh, dtype, H100_SXM, legacy, fused=fused)
        no_l2 = expert_kernels(sh, dtype, without_l2(H100_SXM), legacy, fused=fused)
        tag = "before" if legacy else ("act_dx" if fused else "now")
        if tag == "act_dx" and not any(c.kernel == "act_dx" for c in with_l2):
            continue
        for a, b in zip(with_l2, no_l2, strict=True):
            rows.append({"config": name, "design": tag, **a.to_dict(), "us_no_l2": b.us})
            lines.append(f"| {tag}: {a.kernel} | {a.config} | {a.flops / 1e9:.1f} | {a.l2 / 1e9:.2f} "
                         f"| {a.hbm / 1e9:.2f} | {a.us:.0f} | {b.us:.0f} | {a.bound} |")
        total = sum(c.us for c in with_l2), sum(c.us for c in no_l2)
        lines.append(f"| {tag}: **total** | | | | | {total[0]:.0f} | {total[1]:.0f} | |")
    return "\n".join(lines), rows


def layer_table(tokens: int, dtype: str) -> tuple[str, list[dict]]:
    head = "| config | dense ms | " + " | ".join(f"{d} ms (x dense)" for d in DESIGNS) + " |"
    lines = [f"\nlayer forward + backward, {tokens} tokens, {dtype}, predicted on {H100_SXM.name}: "
             "without / with the L2 bound", head, "|" + "---|" * (2 + len(DESIGNS))]
    rows = []
    for name, cfg in CONFIGS.items():
        hidden = aligned_hidden(layer_flops(cfg, tokens) / tokens, D_MODEL)
        dense = [dense_prediction(tokens, D_MODEL, hidden, dtype, dev=d) for d in (without_l2(H100_SXM), H100_SXM)]
        cells = [name, f"{dense[0]:.2f} / {dense[1]:.2f}"]
        row = {"config": name, "dense_hidden": hidden, "dense_ms": dense}
        for label, kw in DESIGNS.items():
            ms = [layer_prediction(tokens, D_MODEL, cfg.experts, cfg.d_expert, cfg.top_k, cfg.heads, dtype, dev=d,
                                   **kw)["layer_ms"] for d in (without_l2(H100_SXM), H100_SXM)]
            x = [ms[0] / dense[0], ms[1] / dense[1]]
            row[label] = {"ms": ms, "x_dense": x}
            cells.append(f"{ms[0]:.2f} / {ms[1]:.2f} ({x[0]:.2f}x / {x[1]:.2f}x)")
        rows.append(row)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines), rows


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per layer call")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "tf32", "fp32"], help="compute dtype")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out: dict = {"device": H100_SXM.__dict__, "tokens": args.tokens, "dtype": args.dtype, "kernels": []}
    for name in CONFIGS:
        text, rows = kernel_table(name, args.tokens, args.dtype)
        print(text)
        out["kernels"] += rows
    text, out["layers"] = layer_table(args.tokens, args.dtype)
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
