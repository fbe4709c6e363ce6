"""The outputs of a ``mhmoe reproduce`` suite folder: ``results.csv`` (one line per run), ``results.md``
(mean ± std over seeds beside the paper's numbers, the primary comparisons, the separated pairs beside
the number expected by chance), ``results.json`` (every run: its results, evaluation curve, epochs and
the machine that trained it; the suite's environment), ``summary.json`` (the table as data, rounded as
printed, and every pair of rows compared per validation set by :mod:`mhmoe.research.stats`) and
``curves.png``.

Comparisons are paired by seed on the validation **loss** (nats; ``ln`` of the perplexity): row ``a``
against row ``b`` over the seeds both have. *Separated* means the 95% paired-t interval of the mean
difference excludes 0 (:data:`mhmoe.research.stats.RULE`).
"""

from __future__ import annotations

import csv
import io
import json
import math
import statistics
from pathlib import Path
from typing import Any

from mhmoe.research.provenance import describe, describe_runs
from mhmoe.research.report import CURVES_PNG, RESULTS_JSON, write_json
from mhmoe.research.stats import compare_paired, format_comparison, separation_counts
from mhmoe.research.suites import Row, suite_settings
from mhmoe.runtime.files import atomic_write


def _r2(v: float) -> float:
    return round(float(v), 2)


def val_sets(results: list[dict]) -> list[str]:
    """The validation sets of a suite's runs: kjv first (the historical primary), then alphabetical."""
    return sorted({k for r in results for k in r["eval"]}, key=lambda s: (s != "kjv", s))


def primary_set(results: list[dict]) -> str | None:
    """The primary validation set: the training corpus's own held-out split (the first set a run
    evaluates; its ``results.json`` keeps that order)."""
    for r in results:
        first = r.get("eval") or (r.get("curve") or [{}])[0].get("loss")
        if first:
            return next(iter(first))
    return None


def _loss(r: dict, s: str) -> float | None:
    cell = r["eval"].get(s)
    if not cell:
        return None
    return float(cell["loss"]) if isinstance(cell.get("loss"), (int, float)) else math.log(float(cell["ppl"]))


def data_key(result: dict) -> tuple:
    """A run's data version (:func:`mhmoe.research.epochs.data_version`): (training tokens, tokenizer
    fingerprint or None where the record predates it)."""
    data = result.get("data") or {"train_tokens": result.get("train_tokens")}
    return data.get("train_tokens"), data.get("tokenizer")


def same_data(a: dict, b: dict) -> bool:
    """Whether two runs trained and evaluated on the same data: equal training tokens, and equal tokenizer
    fingerprints where both records have one (a corpus read from installed packages changes with their
    versions, and its BPE with it: losses on two versions are not paired)."""
    (ta, fa), (tb, fb) = data_key(a), data_key(b)
    return ta == tb and (fa is None or fb is None or fa == fb)


def data_versions(results: list[dict]) -> list[dict]:
    """The data versions of a suite's runs: corpus, training tokens, tokenizer fingerprint and the seeds per row
    that used each (more than one: the runs were trained on machines with different corpus packages)."""
    out: dict[tuple, dict] = {}
    for r in results:
        if not r.get("corpus"):
            continue
        tokens, tok = data_key(r)
        v = out.setdefault((r["corpus"], tokens, tok), {"name": r["corpus"], "train_tokens": tokens,
                                                         "tokenizer": tok, "seeds": {}})
        v["seeds"].setdefault(r["label"], []).append(r["seed"])
    return list(out.values())


def compare_rows(name: str, rows: list[Row], results: list[dict], sets: list[str]) -> list[dict]:
    """Every pair of rows (in table order, ``a`` above ``b``; a primary pair in its own order) on every
    validation set, paired by seed: :func:`mhmoe.research.stats.compare_paired` on the losses of the seeds whose
    two runs saw the same data (:func:`same_data`; the others are listed as ``unpaired_seeds``), plus
    ``lower`` (the row with the lower mean loss), ``ppl_mean_diff`` (difference of mean perplexities) and
    ``primary``."""
    primary = set(suite_settings(name).primary)
    labels = [row.label for row in rows]
    out = []
    for i, a in enumerate(labels):
        for b in labels[i + 1:]:
            first, second = (b, a) if (b, a) in primary else (a, b)
            ra = {r["seed"]: r for r in results if r["label"] == first}
            rb = {r["seed"]: r for r in results if r["label"] == second}
            unpaired = sorted(k for k in set(ra) & set(rb) if not same_data(ra[k], rb[k]))
            for s in sets:
                la = {k: _loss(r, s) for k, r in ra.items() if _loss(r, s) is not None and k not in unpaired}
                lb = {k: _loss(r, s) for k, r in rb.items() if _loss(r, s) is not None and k not in unpaired}
                c = compare_paired(la, lb)
                if c is None:
                    continue
                if unpaired:
                    c["unpaired_seeds"] = unpaired  # both rows ran these seeds, on different data versions
                pa = statistics.mean(math.exp(la[k]) for k in c["seeds"])
                pb = statistics.mean(math.exp(lb[k]) for k in c["seeds"])
                out.append({"a": first, "b": second, "set": s, **c, "lower": first if c["mean_diff"] <= 0 else second,
                            "ppl_mean_diff": _r2(abs(pa - pb)), "primary": (first, second) in primary})
    return out


def summarize_results(name: str, rows: list[Row], results: list[dict], sets: list[str]) -> dict:
    """The suite's table as data, every number rounded as results.md prints it: per row its parameters and
    forward FLOPs per token (millions), and per validation set the mean, std (over seeds; 0 with one seed)
    and per-seed perplexities, beside the paper's numbers; the comparisons and their separation counts."""
    table = []
    for row in rows:
        rs = sorted((r for r in results if r["label"] == row.label), key=lambda r: r["seed"])
        if not rs:
            continue
        ppl = {}
        for s in sets:
            v = [r["eval"][s]["ppl"] for r in rs if s in r["eval"]]
            if v:
                ppl[s] = {"mean": _r2(statistics.mean(v)), "std": _r2(statistics.stdev(v)) if len(v) > 1 else 0.0,
                          "per_seed": [_r2(x) for x in v]}
        table.append({"label": row.label, "train_seeds": [r.get("train_seed", r["seed"]) for r in rs],
                      "steps": [r.get("step") for r in rs], "params_M": _r2(rs[0]["params"] / 1e6),
                      "fwd_flops_per_token_M": _r2(rs[0]["fwd_flops_per_token"] / 1e6),
                      "tokens_per_s": round(statistics.mean(r["tokens_per_s"] for r in rs)),
                      "epochs": [r.get("epochs") for r in rs], "ppl": ppl, "paper": dict(row.paper)})
    comparisons = compare_rows(name, rows, results, sets)
    return {"suite": name, "seeds": len({r["seed"] for r in results}), "validation_sets": sets,
            "corpus": data_versions(results),
            "primary_set": primary_set(results), "paper_columns": list(rows[0].paper), "rows": table,
            "notes": [r.note for r in rows if r.note], "primary": [list(p) for p in suite_settings(name).primary],
            "comparisons": comparisons, "separation": separation_counts(comparisons)}


def comparison_lines(summary: dict) -> list[str]:
    """results.md's lines: the primary comparisons in full, then the separated pairs beside chance."""
    comps, sep = summary["comparisons"], summary["separation"]
    lines = []
    main = [c for c in comps if c["primary"] and c["set"] == summary.get("primary_set")]
    if main:
        lines.append(f"Primary comparison ({summary['primary_set']} validation loss, paired by seed; negative: the "
                     "first row is better):")
        lines += [f"- {format_comparison(c, c['a'], c['b'])}" + _unpaired(c) for c in main]
        lines.append("")
    if not sep["compared"]:
        return lines
    lines.append(f"Separated pairs (95% paired-t CI of the loss difference excludes 0): {sep['separated']} of "
                 f"{sep['compared']} pairs compared, {sep['expected_by_chance']:g} expected by chance (5% per pair "
                 "when no row differs).")
    for c in comps:
        if c["separated"]:
            worse = c["b"] if c["lower"] == c["a"] else c["a"]
            lines.append(f"- {c['set']}: {c['lower']} < {worse} (loss by {abs(c['mean_diff']):.4f} nats, "
                         f"95% CI [{c['ci95'][0]:+.4f}, {c['ci95'][1]:+.4f}], {c['n']} seeds)")
    return lines


def _unpaired(c: dict) -> str:
    seeds = c.get("unpaired_seeds")
    return f" (seeds {', '.join(map(str, seeds))} left out: the two runs saw different data versions)" if seeds else ""


def data_lines(summary: dict) -> list[str]:
    """One line per data version when the runs saw more than one (machines with different corpus packages)."""
    versions = summary.get("corpus") or []
    if len(versions) < 2:
        return []
    lines = [f"The runs saw {len(versions)} versions of their data (installed corpus packages differ between the "
             "machines that trained them); seeds are paired only within one version:"]
    for v in versions:
        seeds = "; ".join(f"{label} {', '.join(map(str, ks))}" for label, ks in v["seeds"].items())
        tok = f", tokenizer {v['tokenizer']}" if v.get("tokenizer") else ""
        lines.append(f"- {v['name']}: {v['train_tokens']:,} training tokens{tok}: {seeds}")
    return lines


def epoch_line(results: list[dict]) -> str | None:
    epochs = [r["epochs"] for r in results if r.get("epochs") is not None]
    if not epochs:
        return None
    sizes = sorted({r["train_tokens"] for r in results if r.get("train_tokens")})  # one per data version
    tokens = f"{sizes[0]:,}" + (f"-{sizes[-1]:,}" if len(sizes) > 1 else "") if sizes else "?"
    return (f"Epochs of the training corpus ({tokens} tokens) per run: {min(epochs):.3g}"
            + (f"-{max(epochs):.3g}" if max(epochs) != min(epochs) else "") + ".")


def write_outputs(name: str, rows: list[Row], results: list[dict], out: Path, budget: dict | None = None,
                  environment: dict | None = None) -> dict:
    """Write every output file of the suite folder (module docstring); returns summary.json's content."""
    from mhmoe.research.report import plot_suite_curves

    sets = val_sets(results)
    _write_csv(name, results, sets, out / "results.csv")
    summary = summarize_results(name, rows, results, sets)
    lines = _table_lines(name, rows, summary, sets)
    n_seeds = {row["label"]: len(row["train_seeds"]) for row in summary["rows"]}
    counts = sorted(set(n_seeds.values()))
    lines += ["", f"Seeds per row: {'/'.join(map(str, counts))}. Ours: validation perplexity (mean ± std over seeds) "
              "on our corpora; paper: its reported perplexity on its own data and scale -- compare orderings, not "
              "values."]
    lines += [f"Note: {row.note}" for row in rows if row.note]
    if line := epoch_line(results):
        lines.append(line)
    lines += data_lines(summary)
    if budget:
        lines.append(f"Budget: {budget['minutes']:g} minutes for {sum(budget['seeds'].values())} runs of "
                     f"{len(budget['rows'])} rows on {', '.join(budget['device'])} -> {budget['tokens_per_run']:,} "
                     "tokens per run (calibrated: training, evaluation, checkpoints; budget.json).")
        summary["budget"] = budget
    if environment:
        lines.append(f"Trained on: {describe_runs([r.get('environment') for r in results])} (each run's own record "
                     "in results.json). Reported on: " + describe(environment, threads=False) + ".")
        summary["environment"] = environment
    lines += [""] + comparison_lines(summary)
    atomic_write(out / "results.md", "\n".join(lines).rstrip() + "\n")
    write_json(results, out / RESULTS_JSON, name, {"paper": {row.label: row.paper for row in rows},
                                                      "environment": environment, "budget": budget})
    plot_suite_curves(results, out / CURVES_PNG, name)
    atomic_write(out / "summary.json", json.dumps(summary, indent=1, ensure_ascii=False) + "\n")
    return summary


def _write_csv(name: str, results: list[dict], sets: list[str], path: Path) -> None:
    buf = io.StringIO(newline="")
    w = csv.writer(buf)
    w.writerow(["suite", "label", "seed", "params", "fwd_flops_per_token", "tokens_per_s", "train_s", "epochs"]
               + [f"ppl_{s}" for s in sets])
    for r in results:
        epochs = "" if r.get("epochs") is None else f"{r['epochs']:.4f}"
        w.writerow([name, r["label"], r["seed"], r["params"], r["fwd_flops_per_token"], f"{r['tokens_per_s']:.1f}",
                    f"{r['train_s']:.1f}", epochs] + [f"{r['eval'][s]['ppl']:.4f}" if s in r["eval"] else ""
                                                     for s in sets])
    atomic_write(path, buf.getvalue())


def _table_lines(name: str, rows: list[Row], summary: dict, sets: list[str]) -> list[str]:
    paper_cols = summary["paper_columns"]
    head = ["model", "params", "FLOPs/token", "seeds"] + [f"ours {s}" for s in sets]
    head += [f"paper {c}" for c in paper_cols]
    lines = [f"# {name}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by_label: dict[str, Any] = {r["label"]: r for r in summary["rows"]}
    for row in rows:
        t = by_label.get(row.label)
        if t is None:
            continue
        cells = [row.label, f"{t['params_M']:.2f}M", f"{t['fwd_flops_per_token_M']:.2f}M", str(len(t["train_seeds"]))]
        for s in sets:
            p = t["ppl"].get(s)
            spread = f" ± {p['std']:.2f}" if p and len(p["per_seed"]) > 1 else ""
            cells.append("-" if not p else f"{p['mean']:.2f}{spread}")
        cells += [f"{row.paper[c]:.2f}" for c in paper_cols]
        lines.append("| " + " | ".join(cells) + " |")
    return lines
