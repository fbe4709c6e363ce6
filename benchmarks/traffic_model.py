"""The traffic model of the Triton MoE kernels (:mod:`mhmoe.research.traffic`) for the four parity configs:
per kernel the FLOPs, the bytes between L2 and the SMs and to DRAM, the config the model would pick and
the predicted time on an H100 SXM (calibrated to the measured figures: see mhmoe.research.traffic), the
8192^3 bf16 GEMM the calibration is checked against, then the layer's predicted time by part (experts,
head/merge projections, router, router losses) for three designs (64-row tiles and the reference router;
128-row tiles, act_bwd + dx and the reference router; now: act_dx where it applies and the fused router),
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
    H100_GEMM_TFLOPS,
    H100_SXM,
    Device,
    Shape,
    dense_gemm,
    dense_prediction,
    expert_kernels,
    layer_prediction,
    router_kernels,
    without_l2,
)

# design -> layer_prediction arguments: the 64-row design, the design before the fused router (128-row tiles,
# act_bwd + dx, the fp32 reference router), and what runs now (act_dx where it applies, the fused router)
DESIGNS = {"64-row tiles, reference router": dict(legacy=True, fused=False, router="reference"),
           "128-row, act_bwd + dx, reference router": dict(fused=False, router="reference"),
           "now: act_dx, fused router": dict(fused=True, router="fused")}
# the model before its calibration: L2 5.5 TB/s derated by 0.85, no cluster multicast, 75% of the MMA peak
UNCALIBRATED = Device("H100 SXM (uncalibrated)", 989.4, 494.7, 66.9, 3.35, 5.5 * 0.85, mma_eff=0.75, mem_eff=0.85,
                      cluster=1)


def gemm_check(n: int = 8192) -> dict:
    """The n^3 bf16 GEMM: predicted TFLOP/s and bound, before and after the calibration, beside the measurement."""
    out = {"m": n, "k": n, "n": n, "measured_tflops": H100_GEMM_TFLOPS}
    for tag, dev in (("uncalibrated", UNCALIBRATED), ("now", H100_SXM)):
        c = dense_gemm(n, n, n, dev)
        out[tag] = {"us": c.us, "tflops": c.flops / c.us / 1e6, "bound": c.bound, "l2_gb": c.l2 / 1e9}
    return out


def kernel_table(name: str, tokens: int, dtype: str) -> tuple[str, list[dict]]:
    cfg = CONFIGS[name]
    item = 2 if dtype == "bf16" else 4
    sh = Shape(tokens * cfg.heads, cfg.top_k, cfg.experts, padded(D_MODEL // cfg.heads), padded(cfg.d_expert), item)
    lines = [f"\n{name}: N = {sh.n} rows, E = {sh.e}, D = {sh.d}, F = {sh.f}, {dtype}, forward + backward",
             "| kernel | tile | GFLOP | L2 GB | DRAM GB | us (L2-bound) | us (no L2 bound) | bound |",
             "|---|---|---|---|---|---|---|---|"]
    rows = []
    s, d = tokens * cfg.heads, D_MODEL // cfg.heads
    designs = {"64-row": lambda dev: expert_kernels(sh, dtype, dev, True, fused=False),
               "act_bwd+dx": lambda dev: expert_kernels(sh, dtype, dev, False, fused=False),
               "act_dx": lambda dev: expert_kernels(sh, dtype, dev, False, fused=True),
               "fused router": lambda dev: router_kernels(s, d, cfg.experts, cfg.top_k, dtype, dev)}
    for tag, run in designs.items():
        with_l2, no_l2 = run(H100_SXM), run(without_l2(H100_SXM))
        if tag == "act_dx" and not any(c.kernel == "act_dx" for c in with_l2):
            continue
        for a, b in zip(with_l2, no_l2, strict=True):
            rows.append({**a.to_dict(), "config": name, "design": tag, "us_no_l2": b.us})
            lines.append(f"| {tag}: {a.kernel} | {a.tile} | {a.flops / 1e9:.1f} | {a.l2 / 1e9:.2f} "
                         f"| {a.hbm / 1e9:.2f} | {a.us:.0f} | {b.us:.0f} | {a.bound} |")
        total = sum(c.us for c in with_l2), sum(c.us for c in no_l2)
        lines.append(f"| {tag}: **total** | | | | | {total[0]:.0f} | {total[1]:.0f} | |")
    return "\n".join(lines), rows


PARTS = ("experts_ms", "proj_ms", "router_ms", "losses_ms", "layer_ms")


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
            pred = [layer_prediction(tokens, D_MODEL, cfg.experts, cfg.d_expert, cfg.top_k, cfg.heads, dtype, dev=d,
                                     **kw) for d in (without_l2(H100_SXM), H100_SXM)]
            ms = [p["layer_ms"] for p in pred]
            x = [ms[0] / dense[0], ms[1] / dense[1]]
            row[label] = {"ms": ms, "x_dense": x, **{k: [p[k] for p in pred] for k in PARTS}}
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
    out: dict = {"note": "predictions of a traffic model (mhmoe.research.traffic), not measurements",
                 "device": H100_SXM.__dict__, "tokens": args.tokens, "dtype": args.dtype, "gemm": gemm_check(),
                 "kernels": []}
    g = out["gemm"]
    print(f"8192^3 bf16 GEMM: measured {g['measured_tflops']:.0f} TFLOP/s; predicted {g['now']['tflops']:.0f} "
          f"({g['now']['bound']}-bound), before the calibration {g['uncalibrated']['tflops']:.0f} "
          f"({g['uncalibrated']['bound']}-bound)")
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
