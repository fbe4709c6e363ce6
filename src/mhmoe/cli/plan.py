"""``mhmoe plan`` (the parity planner) and ``mhmoe presets`` (named run presets)."""

from __future__ import annotations

import argparse
import json

from mhmoe.config.planner import format_plan, plan


def _add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan", description="Size an MH-MoE layer (expert width F_h, expert count E_h) so that its FLOPs per token "
        "and parameters match a baseline SMoE layer (Huang et al. 2024, Eq.6-10, generalised).",
    )
    p.add_argument("--d-model", type=int, default=768, help="model width d")
    p.add_argument("--d-ff", type=int, default=2048, help="baseline expert hidden width F_b")
    p.add_argument("--experts", type=int, default=8, help="baseline expert count E_b")
    p.add_argument("--top-k", type=int, default=1, help="baseline top-k")
    p.add_argument("--ffn", default="swiglu", choices=["relu", "swiglu"], help="expert FFN type")
    p.add_argument("--heads", type=int, default=2, help="MH-MoE heads h")
    p.add_argument("--mh-top-k", type=int, default=None,
                   help="MH-MoE top-k (default: h for --parity flops, --top-k for --parity params)")
    p.add_argument("--mh-experts", type=int, default=None, help="fix E_h and evaluate it (default: solved for "
                   "parameter parity)")
    p.add_argument("--mh-d-ff", type=int, default=None, help="fix F_h and evaluate it (default: solved for FLOPs "
                   "parity)")
    p.add_argument("--parity", default="flops", choices=["flops", "params"],
                   help="flops: FLOPs and parameters (v2 paper); params: parameters only, same E (ICML paper)")
    p.add_argument("--match", default="leading", choices=["leading", "exact"],
                   help="leading: solve the paper's Eq.8 on leading terms; exact: solve the exact FLOPs")
    p.add_argument("--no-head", action="store_true", help="MH-MoE without the head layer")
    p.add_argument("--no-merge", action="store_true", help="MH-MoE without the merge layer")
    p.add_argument("--mlp-layers", type=int, default=1, help="layers n in each head/merge MLP (0..3)")
    p.add_argument("--shared", type=int, default=0, help="shared experts (same in both models)")
    p.add_argument("--d-shared", type=int, default=0, help="shared expert width (default: --d-ff)")
    p.add_argument("--include-router", action="store_true", help="count router FLOPs and parameters")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (Plan.to_dict())")
    p.set_defaults(func=_run_plan)


def plan_from_args(args: argparse.Namespace):
    """The :class:`~mhmoe.config.planner.Plan` of parsed ``mhmoe plan`` arguments."""
    return plan(
        args.d_model, args.d_ff, args.experts, args.top_k, args.ffn, heads=args.heads, mh_top_k=args.mh_top_k,
        parity=args.parity, match=args.match, head_layer=not args.no_head, merge_layer=not args.no_merge,
        mlp_layers=args.mlp_layers, mh_experts=args.mh_experts, mh_d_ff=args.mh_d_ff,
        include_router=args.include_router, shared=args.shared, d_shared=args.d_shared or args.d_ff,
    )


def _run_plan(args: argparse.Namespace) -> int:
    result = plan_from_args(args)
    print(json.dumps(result.to_dict(), indent=2) if args.json else format_plan(result))
    return 0


# ---- presets ---------------------------------------------------------------------------------------
def _add_presets(sub) -> None:
    p = sub.add_parser("presets", description="List the named presets (the papers' models and tiny versions of "
                       "them): width, depth and FFN of each. --show NAME prints one as YAML, a valid --config file "
                       "for `mhmoe train`.")
    p.add_argument("--show", metavar="NAME", help="print preset NAME as YAML, a valid --config file "
                   "(default: list all presets)")
    p.add_argument("--json", action="store_true", help="print JSON instead")
    p.set_defaults(func=_run_presets)


def _run_presets(args) -> int:
    from mhmoe.config.presets import get_preset, preset_names

    if args.show:
        run = get_preset(args.show)
        print(json.dumps(run.to_dict(), indent=2) if args.json else run.to_yaml(), end="")
        return 0
    rows = []
    for name in preset_names():
        m = get_preset(name).model
        moe = m.moe
        desc = "dense" if moe.kind == "dense" else (
            f"{moe.n_experts}x{moe.d_expert} top-{moe.top_k}" + (f" h={moe.heads}" if moe.heads > 1 else "")
            + (f" +{moe.n_shared} shared" if moe.n_shared else "") + f" {moe.router}/{moe.ffn}")
        desc += f" {m.quant}" if m.quant != "none" else ""
        desc += " encoder (masked multi-modal)" if m.arch == "encoder" else ""
        rows.append({"name": name, "d_model": m.d_model, "n_layers": m.n_layers, "ffn": desc})
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            print(f"{r['name']:<24} d={r['d_model']:<4} L={r['n_layers']:<3} {r['ffn']}")
    return 0


PARSER_BUILDERS = {"plan": _add_plan_parser, "presets": _add_presets}
