"""The ``mhmoe`` command line: one entry point, one subcommand per job.

Every subcommand registers itself through a ``add_<name>_parser(subparsers)`` function whose parser
sets ``func``. Bad input (any ``ValueError``, including :mod:`mhmoe.errors`) prints one line to
stderr and exits with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from mhmoe.cpu_malloc import malloc_from_env
from mhmoe.planner import format_plan, plan


def _add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan", help="size an MH-MoE layer at FLOPs and parameter parity with a sparse MoE baseline",
        description="Size an MH-MoE layer (expert width F_h, expert count E_h) so that its FLOPs per token "
        "and parameters match a baseline SMoE layer (Huang et al. 2024, Eq.6-10, generalised).",
    )
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--d-ff", type=int, default=2048, help="baseline expert hidden width F_b")
    p.add_argument("--experts", type=int, default=8, help="baseline expert count E_b")
    p.add_argument("--top-k", type=int, default=1, help="baseline top-k")
    p.add_argument("--ffn", default="swiglu", help="relu | swiglu")
    p.add_argument("--heads", type=int, default=2, help="MH-MoE heads h")
    p.add_argument("--mh-top-k", type=int, default=None,
                   help="MH-MoE top-k (default: h for --parity flops, --top-k for --parity params)")
    p.add_argument("--mh-experts", type=int, default=None, help="fix E_h and evaluate")
    p.add_argument("--mh-d-ff", type=int, default=None, help="fix F_h and evaluate")
    p.add_argument("--parity", default="flops", help="flops (FLOPs and params, v2 paper) | params (ICML: same E)")
    p.add_argument("--match", default="leading", help="leading (paper Eq.8) | exact (solve exact FLOPs)")
    p.add_argument("--no-head", action="store_true", help="MH-MoE without the head layer")
    p.add_argument("--no-merge", action="store_true", help="MH-MoE without the merge layer")
    p.add_argument("--mlp-layers", type=int, default=1, help="layers n in each head/merge MLP (0..3)")
    p.add_argument("--shared", type=int, default=0, help="shared experts (same in both models)")
    p.add_argument("--d-shared", type=int, default=0, help="shared expert width (default --d-ff)")
    p.add_argument("--include-router", action="store_true", help="count router FLOPs and parameters")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    result = plan(
        args.d_model, args.d_ff, args.experts, args.top_k, args.ffn, heads=args.heads, mh_top_k=args.mh_top_k,
        parity=args.parity, match=args.match, head_layer=not args.no_head, merge_layer=not args.no_merge,
        mlp_layers=args.mlp_layers, mh_experts=args.mh_experts, mh_d_ff=args.mh_d_ff,
        include_router=args.include_router, shared=args.shared, d_shared=args.d_shared or args.d_ff,
    )
    print(json.dumps(result.to_dict(), indent=2) if args.json else format_plan(result))
    return 0


def _parser_builders() -> list[Callable[[argparse._SubParsersAction], None]]:
    builders: list[Callable[[argparse._SubParsersAction], None]] = [_add_plan_parser]
    from mhmoe import commands, commands_ecosystem, commands_research  # torch only; heavy modules load per command

    return builders + commands.PARSER_BUILDERS + commands_research.PARSER_BUILDERS + commands_ecosystem.PARSER_BUILDERS


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mhmoe", description="Multi-Head Mixture-of-Experts language models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for add in _parser_builders():
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    malloc_from_env()  # MHMOE_MALLOC=tuned: reuse freed CPU memory across steps (mhmoe.cpu_malloc)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"mhmoe {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"mhmoe {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
