"""Research subcommands of the ``mhmoe`` CLI: reproduce (paper tables), analyze (routing) and plot (curves of
any runs together)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from mhmoe.checkpoint.layout import ANALYSIS_DIR, CONFIG_FILE, CURVES_FILE, run_directory


def _add_reproduce(sub) -> None:
    from mhmoe.research.suites import SUITE_SCALES, SUITES

    p = sub.add_parser("reproduce",
                       description="Train and evaluate the rows of a paper table (each run once, in the run store) "
                       "and write OUT/results.md (ours beside the paper's, the primary comparisons, the separated "
                       "pairs beside the number expected by chance), results.csv, results.json (per-seed "
                       "evaluation curves, epochs, machine, versions, commit, command), summary.json and "
                       "curves.png. Suites: " + ", ".join(SUITES))
    p.add_argument("suite", metavar="SUITE", choices=list(SUITES), help=" | ".join(SUITES))
    p.add_argument("--scale", default="tiny", choices=list(SUITE_SCALES), help="model size of every row")
    p.add_argument("--seeds", type=int, help="seeds per row, shared by the rows (seed k trains with train.seed + k, "
                   "so rows pair by seed; default: 5 for the rows of the suite's primary comparisons, 3 for the "
                   "others)")
    p.add_argument("--first-seed", type=int, default=0, metavar="K", help="the first seed index: the rows train "
                   "and report seeds K .. K+N-1 (N: --seeds), e.g. a fresh set of seeds for a confirmatory run "
                   "(default: 0)")
    p.add_argument("--tokens", type=int, help="training token budget per run (default: the preset's)")
    p.add_argument("--minutes", type=float, help="wall-clock budget of the whole suite instead of --tokens: training, "
                   "evaluation, checkpoints and the calibration itself; every run gets the same tokens, calibrated "
                   "here (OUT/budget.json; one process; default: none)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="train.device of every run (default: the "
                   "preset's, cpu)")
    p.add_argument("--data", metavar="CORPUS", help="training corpus of every run (= --set data.corpus=CORPUS; "
                   "default: the suite's)")
    p.add_argument("--out", metavar="DIR", help="suite directory (default: runs/reproduce/SUITE-SCALE)")
    p.add_argument("--store", metavar="DIR", help="run store: every run trained once, shared by the suites that use "
                   "it (default: store/ beside the suite directory)")
    p.add_argument("--records", metavar="DIR", help="where each finished run's record goes, a small JSON file to "
                   "commit (default: STORE/records)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="config override for every run (repeatable; "
                   "default: none)")
    p.add_argument("--rows", action="append", metavar="LABEL", help="train and report only this row "
                   "(repeatable; default: every row)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (stderr)")
    p.add_argument("--report-only", action="store_true",
                   help="train nothing: write the tables and curves from the runs that already finished")
    p.add_argument("--status", action="store_true", help="train and report nothing: count the planned runs that "
                   "finished, are training in another process, were interrupted (they resume) or are still to "
                   "train, per row, without their results (a run planned in advance is analysed once, at its end)")
    p.add_argument("--json", action="store_true", help="--status: print it as JSON (suite -> row -> state -> "
                   "seed indices)")
    p.set_defaults(func=_run_reproduce)


def _run_reproduce(args: argparse.Namespace) -> int:
    from mhmoe.research.report import read_results_md
    from mhmoe.research.reproduce import run_table, suite_rows

    suite_rows(args.suite)
    out = args.out or f"runs/reproduce/{args.suite}-{args.scale}"
    overrides = ([f"train.device={args.device}"] if args.device else []) + (
        [f"data.corpus={args.data}"] if args.data else []) + list(args.set or [])
    if args.status or args.json:
        return _reproduce_status(args, out, overrides)
    run_table(args.suite, out, scale=args.scale, seeds=args.seeds, tokens=args.tokens, overrides=overrides,
              progress=not args.no_progress, train_missing=not args.report_only, only=args.rows, minutes=args.minutes,
              store=args.store, records=args.records, first_seed=args.first_seed)
    print(read_results_md(out))  # a symlink, a FIFO, an oversized file: one line naming it, exit 2
    return 0


def _reproduce_status(args: argparse.Namespace, out: str, overrides: list[str]) -> int:
    from mhmoe.errors import ConfigError
    from mhmoe.research.reproduce import table_status

    if not args.status:
        raise ConfigError("--json", True, "only with --status")
    if args.report_only:
        raise ConfigError("--report-only", True, "not with --status (one of them)")
    status = table_status(args.suite, out, scale=args.scale, seeds=args.seeds, tokens=args.tokens,
                          overrides=overrides, only=args.rows, minutes=args.minutes, store=args.store,
                          records=args.records, first_seed=args.first_seed)
    if args.json:
        print(json.dumps(status, indent=1, ensure_ascii=False))
        return 0
    for suite, rows in status.items():
        planned = sum(len(seeds) for states in rows.values() for seeds in states.values())
        done = sum(len(states["finished"]) for states in rows.values())
        print(f"{suite}: {done} of {planned} planned runs finished (results are not shown)")
        width = max(len(label) for label in rows)
        for label, states in rows.items():
            counts = "  ".join(f"{state.replace('_', ' ')} {len(seeds)}" for state, seeds in states.items())
            busy = [f"{state}: seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}"
                    for state, seeds in states.items() if state in ("training", "interrupted") and seeds]
            print(f"  {label:<{width}}  {counts}" + (f"  ({'; '.join(busy)})" if busy else ""))
    return 0


def _add_analyze(sub) -> None:
    p = sub.add_parser("analyze", description="Route held-out text through a checkpoint and write activation.png/csv, "
                       "diversity.png/csv and summary.json into RUN/analysis/; or, with --suite, analyse every "
                       "MoE run of a reproduce/compare directory beside uniformly random routing.")
    p.add_argument("--checkpoint", metavar="RUN", help="run directory or checkpoint directory (this or --suite; "
                   "default: none)")
    p.add_argument("--suite", metavar="DIR", help="a `mhmoe reproduce` directory: analyse every MoE run, write "
                   "DIR/analysis.json (mean ± std over seeds beside random routing; default: none)")
    p.add_argument("--scaling", action="store_true", help="with --suite: also write DIR/scaling.png/json, validation "
                   "perplexity and expert activation ratio against the number of experts per model family "
                   "(suite icml-fig6; ICML Fig. 6a / Fig. 9)")
    p.add_argument("--power", action="store_true", help="with --suite (a pilot, e.g. decisive-pilot): fit the noise "
                   "of the primary pair's paired loss difference against tokens seen from the per-seed evaluation "
                   "curves and print the tokens per run that detect --gap with 95%% probability at --seeds seeds "
                   "(DIR/power.json)")
    p.add_argument("--gap", type=float, metavar="NATS", help="--power: the true gap to "
                   "detect, in nats of validation loss (default: the v2 paper's MH-MoE (head=3) vs SMoE, "
                   "ln(10.90/10.51) = 0.0364)")
    p.add_argument("--seeds", type=int, nargs="+", default=[5], metavar="N", help="--power: seed counts of the "
                   "planned experiment")
    p.add_argument("--pair", nargs=2, metavar=("A", "B"), help="--power: the two row labels (default: the suite's "
                   "first primary comparison)")
    p.add_argument("--val-set", metavar="NAME", help="--power: validation set (default: the training corpus's own)")
    p.add_argument("--late-fraction", type=float, default=0.5, metavar="F", help="--power: fit the evaluation "
                   "points with tokens >= F x the last point's")
    p.add_argument("--out", metavar="DIR", help="output directory (default: RUN/analysis, in the run directory "
                   "even when a checkpoint directory is given)")
    p.add_argument("--data", help="held-out text: corpus name or path (default: the run's validation split)")
    p.add_argument("--batches", type=int, default=8, help="evaluation batches to route")
    p.add_argument("--threshold", type=float, default=0.01,
                   help="activation threshold in selections per token (uniform routing gives H*K/E)")
    p.add_argument("--polysemy", action="store_true", help="decoder runs: also compare the assign diversity of "
                   "polysemous and monosemous whole-word tokens (WordNet senses; ICML Fig. 7) into "
                   "polysemy.png/json")
    p.add_argument("--min-senses", type=int, default=3, metavar="N",
                   help="--polysemy: WordNet senses from which a word is polysemous (monosemous: exactly 1)")
    p.add_argument("--permutations", type=int, default=2000, metavar="N",
                   help="--polysemy: permutations of the test of the group difference")
    p.add_argument("--images", type=int, default=6, help="encoder runs: images in the Fig. 8 picture (fig8.png)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where to run the model")
    p.add_argument("--json", action="store_true", help="print summary.json")
    p.set_defaults(func=_run_analyze)


def _is_encoder_run(checkpoint: str) -> bool:
    """A run or checkpoint directory whose config.yaml says model.arch=encoder (masked multi-modal)."""
    from mhmoe.config.run import RunConfig
    from mhmoe.runtime.reading import regular_or_missing

    cfg = Path(checkpoint) / CONFIG_FILE
    try:
        if not regular_or_missing(cfg):  # a symlink, a FIFO: one line naming it
            return False
    except NotADirectoryError:  # a file named as the run: analyze_checkpoint says what it is
        return False
    return RunConfig.load(cfg).model.arch == "encoder"


def _run_analyze(args: argparse.Namespace) -> int:
    from mhmoe.errors import ConfigError
    from mhmoe.research.analysis import analyze_checkpoint
    from mhmoe.runtime.device import resolve_device

    if args.batches < 1 or not 0 <= args.threshold:
        raise ConfigError("--batches/--threshold", (args.batches, args.threshold), "--batches >= 1, --threshold >= 0")
    if (args.checkpoint is None) == (args.suite is None):
        raise ConfigError("--checkpoint/--suite", (args.checkpoint, args.suite), "exactly one of them")
    if args.scaling and not args.suite:
        raise ConfigError("--scaling", True, "--suite DIR (it reads a reproduce directory)")
    if args.polysemy and args.suite:
        raise ConfigError("--polysemy", True, "--checkpoint RUN (one run at a time)")
    if args.power:
        if not args.suite or args.scaling:
            raise ConfigError("--power", True, "--suite DIR (a pilot suite's folder) and no --scaling")
        return _run_power(args)
    if args.suite:
        return _run_analyze_suite(args)
    out = args.out or str(run_directory(args.checkpoint) / ANALYSIS_DIR)
    device = str(resolve_device(args.device, "--device"))
    if _is_encoder_run(args.checkpoint):  # image patches of the validation images, and ICML Fig. 8
        from mhmoe.research.patch_routing import analyze_encoder_checkpoint

        if args.data or args.images < 1 or args.polysemy:
            raise ConfigError("--data/--images", (args.data, args.images), "no --data or --polysemy and --images >= 1 "
                              "for an encoder run (it is analysed on its validation images)")
        summary = analyze_encoder_checkpoint(args.checkpoint, out, args.batches, args.threshold, device, args.images)
    else:
        summary = analyze_checkpoint(args.checkpoint, out, args.data, args.batches, args.threshold, device,
                                     _polysemy_extras(args))
    if args.json:
        print(json.dumps(summary, indent=2, default=float))
    else:
        _print_analysis(summary, args.threshold)
        print(f"report: {out}/(activation|diversity).(png|csv), summary.json", file=sys.stderr)
        if "polysemy" in summary:
            _print_polysemy(summary["polysemy"])
            print(f"ICML Fig. 7 analogue: {out}/polysemy.(png|json)", file=sys.stderr)
        if "fig8" in summary:
            print(f"ICML Fig. 8 (patch assign diversity, sub-token experts): {summary['fig8']}", file=sys.stderr)
    return 0


def _polysemy_extras(args: argparse.Namespace) -> dict:
    """``analyze_checkpoint``'s extras for --polysemy (WordNet is read first: a missing install fails fast)."""
    from functools import partial

    from mhmoe.errors import ConfigError

    if not args.polysemy:
        return {}
    if args.min_senses < 2 or args.permutations < 1:
        raise ConfigError("--min-senses/--permutations", (args.min_senses, args.permutations),
                          "--min-senses >= 2 (1 sense is the monosemous group), --permutations >= 1")
    from mhmoe.data.wordnet import wordnet_sense_counts
    from mhmoe.research.polysemy import polysemy_report

    return {"polysemy": partial(polysemy_report, min_senses=args.min_senses, senses=wordnet_sense_counts(),
                                n_perm=args.permutations)}


def _fmt(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _print_polysemy(p: dict) -> None:
    """The ICML Fig. 7 analogue as a table: group means per layer beside random routing, p-values."""
    t = p["tokens"]
    print(f"polysemous (WordNet senses >= {p['min_senses']}): {t['polysemous']:,} tokens "
          f"({p['word_types']['polysemous']:,} words); monosemous: {t['monosemous']:,} tokens "
          f"({p['word_types']['monosemous']:,} words); excluded: "
          + ", ".join(f"{k.replace('_', ' ')} {v:,}" for k, v in t["excluded"].items()))
    print("layer | polysemous | monosemous | difference | random routing (poly / mono; expected) | p tokens | p words "
          "| p words within frequency strata")
    for c in p["layers"] + [{**p["mean_over_layers"], "layer": "mean"}]:
        print(f"{c['layer']} | {_fmt(c['polysemous_mean'])} | {_fmt(c['monosemous_mean'])} | "
              f"{_fmt(c['difference'], 4)} | {_fmt(c['random_polysemous_mean'])} / "
              f"{_fmt(c['random_monosemous_mean'])}; {_fmt(c['expected_random'])} | {c['p_value']:.4g} | "
              f"{c['p_value_types']:.4g} | {c['p_value_types_frequency_strata']:.4g}")
    if "note" in p:
        print(p["note"])


def _run_power(args: argparse.Namespace) -> int:
    from mhmoe.errors import ConfigError
    from mhmoe.research.power import PAPER_GAP, suite_power

    gap = PAPER_GAP if args.gap is None else args.gap
    if not gap > 0 or any(n < 2 for n in args.seeds) or not 0 <= args.late_fraction < 1:
        raise ConfigError("--gap/--seeds/--late-fraction", (gap, args.seeds, args.late_fraction),
                          "--gap > 0, --seeds >= 2 each, 0 <= --late-fraction < 1")
    res = suite_power(Path(args.suite), gap, args.seeds, tuple(args.pair) if args.pair else None, args.val_set,
                      args.late_fraction)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print(_format_power(res))
    print(f"{args.suite}/power.json", file=sys.stderr)
    return 0


def _format_power(res: dict) -> str:
    law, end = res["law"], res["sd_at_pilot_end"]
    lines = [f"pilot {res['suite_dir']} ({res['suite']}): {res['pair'][0]} - {res['pair'][1]} on {res['val_set']}, "
             f"{res['pilot_seeds']} seeds, {len(res['points'])} evaluation points",
             f"noise law, fitted on {law['points']} points from {law['tokens_min']:,} to {law['tokens_max']:,} tokens: "
             f"sd of the paired difference = {math.exp(law['log_scale']):.4g} * tokens^{law['slope']:.3f}",
             f"at {end['tokens']:,} tokens: observed sd {end['observed']:.4f} (fitted {end['fitted']:.4f}), mean "
             f"difference {end['mean_diff']:+.4f} nats",
             f"to detect a gap of {res['gap_nats']:.4f} nats (95% paired-t CI excludes 0) with probability "
             f"{res['power']:g}:"]
    for n in res["needs"]:
        tokens = "never under this law (the noise does not fall)" if n["tokens_per_run"] is None else \
            f"{n['tokens_per_run']:,} tokens per run" + (f" ({n['epochs']:.2f} epochs)" if n.get("epochs") else "")
        lines.append(f"  {n['seeds']} seeds: sd <= {n['required_sd']:.4f} -> {tokens}; power at the pilot's last "
                     f"point {n['power_at_pilot_end']:.2f}")
    return "\n".join(lines)


# ---- plot ------------------------------------------------------------------------------------------
def _add_plot(sub) -> None:
    p = sub.add_parser("plot", description="Draw the training loss and the validation perplexity of every RUN (a run "
                       "directory, or a compare/reproduce directory: all its runs, seeds averaged per model).")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories or suite directories")
    p.add_argument("--out", metavar="PNG", help="output file (default: RUN/curves.png when one RUN is given; "
                   "required for several)")
    p.add_argument("--labels", nargs="+", metavar="LABEL", help="one legend label per RUN (default: the directory "
                   "names; for RUN/seed<k>, the parent's)")
    p.add_argument("--title", default="", help="figure title (default: none)")
    p.set_defaults(func=_run_plot)


def _run_plot(args: argparse.Namespace) -> int:
    from mhmoe.errors import ConfigError
    from mhmoe.research.report import collect_curves
    from mhmoe.train.plots import plot_curves

    if args.labels and len(args.labels) != len(args.runs):
        raise ConfigError("--labels", len(args.labels), f"one label per RUN ({len(args.runs)})")
    if not args.out and len(args.runs) > 1:
        raise ConfigError("--out", None, "a PNG path (required with several RUNs)")
    curves = collect_curves([Path(r) for r in args.runs], args.labels)
    out = Path(args.out or Path(args.runs[0]) / CURVES_FILE)
    plot_curves(curves, out, args.title)
    print(f"{out}: {len(curves)} curve{'s' if len(curves) != 1 else ''} ({', '.join(c.label for c in curves)})")
    return 0


def _pm(row: dict, key: str) -> str:
    return f"{row[key]['mean']} ± {row[key]['std']}"


def _run_analyze_suite(args: argparse.Namespace) -> int:
    from mhmoe.research.analysis import analyze_suite
    from mhmoe.runtime.device import resolve_device

    res = analyze_suite(args.suite, args.batches, args.threshold, str(resolve_device(args.device, "--device")))
    if args.scaling:
        from mhmoe.research.scaling import write_scaling

        res["scaling"] = write_scaling(args.suite)
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print(f"threshold {args.threshold} selections/token; mean ± std over seeds; (random routing)")
    for r in res["rows"]:
        print(f"{r['label']}: activation ratio {_pm(r, 'activation_ratio')} ({_pm(r, 'random_activation_ratio')}), "
              f"uniform frequency {_pm(r, 'uniform_frequency')}, assign diversity {_pm(r, 'assign_diversity')} "
              f"({_pm(r, 'random_assign_diversity')}; max {r['max_possible_diversity']}), "
              f"load imbalance {_pm(r, 'load_imbalance')} ({_pm(r, 'random_load_imbalance')})")
    if args.scaling:
        _print_scaling(res["scaling"])
    print(f"{args.suite}/analysis.json" + (", scaling.(png|json)" if args.scaling else ""), file=sys.stderr)
    return 0


def _print_scaling(table: dict) -> None:
    """Perplexity (mean ± std) and activation ratio (random routing) per family and expert count."""
    print(f"scaling ({table['validation_set']} perplexity; activation ratio, random routing in parentheses):")
    for name, f in table["families"].items():
        for e, m, sd, a, r in zip(f["experts"], f["ppl_mean"], f["ppl_std"], f["activation_ratio"],
                                  f["random_activation_ratio"], strict=True):
            act = f"{a['mean']:.3f} ± {a['std']:.3f} ({r['mean']:.3f})" if a and r else "-"
            print(f"  {name} E={e}: ppl {m:.2f} ± {sd:.2f}, activation ratio {act}")


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


PARSER_BUILDERS = {"reproduce": _add_reproduce, "analyze": _add_analyze, "plot": _add_plot}
