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
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--report-only", action="store_true",
                   help="train nothing: write the tables and curves from the runs that already finished")
    p.set_defaults(func=_run_reproduce)


def _run_reproduce(args: argparse.Namespace) -> int:
    from mhmoe.research.reproduce import run_table, suite_rows

    suite_rows(args.suite)
    out = args.out or f"runs/reproduce/{args.suite}-{args.scale}"
    run_table(args.suite, out, scale=args.scale, seeds=args.seeds, tokens=args.tokens, overrides=args.set,
              progress=not args.no_progress, train_missing=not args.report_only)
    print(open(f"{out}/results.md", encoding="utf-8").read())
    return 0


def _add_analyze(sub) -> None:
    p = sub.add_parser("analyze", help="expert activation, sub-token assign diversity, entropy, load imbalance")
    p.add_argument("--checkpoint", required=True, help="run directory or checkpoint directory")
    p.add_argument("--out", help="output directory (default CHECKPOINT/analysis)")
    p.add_argument("--data", help="held-out text: corpus name or path (default: the run's validation split)")
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--threshold", type=float, default=0.01, help="activation threshold (selections per token)")
    p.add_argument("--images", type=int, default=6, help="encoder runs: images in the Fig. 8 picture (fig8.png)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_run_analyze)


def _is_encoder_run(checkpoint: str) -> bool:
    """A run or checkpoint directory whose config.yaml says model.arch=encoder (masked multi-modal)."""
    from pathlib import Path

    from mhmoe.config.run import RunConfig

    cfg = Path(checkpoint) / "config.yaml"
    return cfg.is_file() and RunConfig.load(cfg).model.arch == "encoder"


def _run_analyze(args: argparse.Namespace) -> int:
    from pathlib import Path

    from mhmoe.errors import ConfigError
    from mhmoe.research.analysis import analyze_checkpoint
    from mhmoe.runtime.device import resolve_device

    if args.batches < 1 or not 0 <= args.threshold:
        raise ConfigError("--batches/--threshold", (args.batches, args.threshold), "--batches >= 1, --threshold >= 0")
    out = args.out or str(Path(args.checkpoint) / "analysis")
    if _is_encoder_run(args.checkpoint):  # image patches of the validation images, and ICML Fig. 8
        from mhmoe.research.patch_routing import analyze_encoder_checkpoint

        if args.data or args.images < 1:
            raise ConfigError("--data/--images", (args.data, args.images), "no --data and --images >= 1 for an "
                              "encoder run (it is analysed on its validation images)")
        summary = analyze_encoder_checkpoint(args.checkpoint, out, args.batches, args.threshold,
                                             str(resolve_device("auto")), args.images)
    else:
        summary = analyze_checkpoint(args.checkpoint, out, args.data, args.batches, args.threshold,
                                     str(resolve_device("auto")))
    if args.json:
        print(json.dumps(summary, indent=2, default=float))
    else:
        print(f"activation ratio {summary['activation_ratio']:.3f} (threshold {args.threshold})  "
              f"mean assign diversity {summary['mean_assign_diversity']:.2f} / {summary['max_possible_diversity']}")
        for i, (h, imb) in enumerate(zip(summary["router_entropy_per_layer"], summary["load_imbalance_per_layer"],
                                         strict=True)):
            print(f"  MoE layer {i}: router entropy {h:.3f} nats, load imbalance {imb:.2f}")
        print(f"report: {out}/(activation|diversity).(png|csv), summary.json", file=sys.stderr)
        if "fig8" in summary:
            print(f"ICML Fig. 8 (patch assign diversity, sub-token experts): {summary['fig8']}", file=sys.stderr)
    return 0


PARSER_BUILDERS = [_add_reproduce, _add_analyze]
