"""Research subcommands of the ``mhmoe`` CLI: reproduce (paper tables) and analyze (routing)."""

from __future__ import annotations

import argparse
import json
import sys


def _add_reproduce(sub) -> None:
    from mhmoe.research.reproduce import SUITE_SCALES, SUITES

    p = sub.add_parser("reproduce", help="train + evaluate the matched models of a paper table",
                       description="Suites: " + ", ".join(SUITES))
    p.add_argument("suite", help=" | ".join(SUITES))
    p.add_argument("--scale", default="tiny", help=" | ".join(SUITE_SCALES))
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--tokens", type=int, help="training token budget per run (default: the preset's)")
    p.add_argument("--out", help="output directory (default runs/reproduce/SUITE-SCALE)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override for every run")
    p.add_argument("--rows", action="append", metavar="LABEL", help="train and report only this row (repeatable)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--report-only", action="store_true",
                   help="train nothing: write the tables and curves from the runs that already finished")
    p.set_defaults(func=_run_reproduce)


def _run_reproduce(args: argparse.Namespace) -> int:
    from mhmoe.research.reproduce import run_suite, suite_rows

    suite_rows(args.suite)
    out = args.out or f"runs/reproduce/{args.suite}-{args.scale}"
    run_suite(args.suite, out, scale=args.scale, seeds=args.seeds, tokens=args.tokens, overrides=args.set,
              progress=not args.no_progress, train_missing=not args.report_only, only=args.rows)
    print(open(f"{out}/results.md", encoding="utf-8").read())
    return 0


def _add_analyze(sub) -> None:
    p = sub.add_parser("analyze", help="expert activation, sub-token assign diversity, entropy, load imbalance")
    p.add_argument("--checkpoint", help="run directory or checkpoint directory")
    p.add_argument("--suite", help="a `mhmoe reproduce` folder: analyse every MoE run, write SUITE/analysis.json "
                   "(mean ± std over seeds beside random routing)")
    p.add_argument("--out", help="output directory (default CHECKPOINT/analysis)")
    p.add_argument("--data", help="held-out text: corpus name or path (default: the run's validation split)")
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--threshold", type=float, default=0.01,
                   help="activation threshold in selections per token (uniform routing gives H*K/E)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_run_analyze)


def _run_analyze(args: argparse.Namespace) -> int:
    from pathlib import Path

    from mhmoe.errors import ConfigError
    from mhmoe.research.analysis import analyze_checkpoint
    from mhmoe.runtime.device import resolve_device

    if args.batches < 1 or not 0 <= args.threshold:
        raise ConfigError("--batches/--threshold", (args.batches, args.threshold), "--batches >= 1, --threshold >= 0")
    if (args.checkpoint is None) == (args.suite is None):
        raise ConfigError("--checkpoint/--suite", (args.checkpoint, args.suite), "exactly one of them")
    if args.suite:
        return _run_analyze_suite(args)
    out = args.out or str(Path(args.checkpoint) / "analysis")
    summary = analyze_checkpoint(args.checkpoint, out, args.data, args.batches, args.threshold,
                                 str(resolve_device("auto")))
    if args.json:
        print(json.dumps(summary, indent=2, default=float))
    else:
        _print_analysis(summary, args.threshold)
        print(f"report: {out}/(activation|diversity).(png|csv), summary.json", file=sys.stderr)
    return 0


def _pm(row: dict, key: str) -> str:
    return f"{row[key]['mean']} ± {row[key]['std']}"


def _run_analyze_suite(args: argparse.Namespace) -> int:
    from mhmoe.research.analysis import analyze_suite
    from mhmoe.runtime.device import resolve_device

    res = analyze_suite(args.suite, args.batches, args.threshold, str(resolve_device("auto")))
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print(f"threshold {args.threshold} selections/token; mean ± std over seeds; (random routing)")
    for r in res["rows"]:
        print(f"{r['label']}: activation ratio {_pm(r, 'activation_ratio')} ({_pm(r, 'random_activation_ratio')}), "
              f"uniform frequency {_pm(r, 'uniform_frequency')}, assign diversity {_pm(r, 'assign_diversity')} "
              f"({_pm(r, 'random_assign_diversity')}; max {r['max_possible_diversity']}), "
              f"load imbalance {_pm(r, 'load_imbalance')} ({_pm(r, 'random_load_imbalance')})")
    print(f"{args.suite}/analysis.json", file=sys.stderr)
    return 0


def _print_analysis(summary: dict, threshold: float) -> None:
    """Every statistic beside its uniformly-random-routing baseline."""
    rnd = summary["random_routing"]
    uniform = ", ".join(f"{u:.3f}" for u in summary["uniform_frequency_per_layer"])
    print(f"activation ratio {summary['activation_ratio']:.3f} (random routing {rnd['activation_ratio']:.3f}; "
          f"threshold {threshold} selections/token; uniform frequency H*K/E = {uniform} per layer)")
    expected = sum(rnd["expected_assign_diversity_per_layer"]) / max(1, len(rnd["expected_assign_diversity_per_layer"]))
    print(f"mean assign diversity {summary['mean_assign_diversity']:.2f} (random routing "
          f"{rnd['mean_assign_diversity']:.2f}, expected {expected:.2f}; max {summary['max_possible_diversity']})")
    for i, (h, imb, rimb) in enumerate(zip(summary["router_entropy_per_layer"], summary["load_imbalance_per_layer"],
                                           rnd["load_imbalance_per_layer"], strict=True)):
        print(f"  MoE layer {i}: router entropy {h:.3f} nats, load imbalance {imb:.2f} (random routing {rimb:.2f})")


PARSER_BUILDERS = [_add_reproduce, _add_analyze]
