"""``mhmoe reproduce SUITE``: train the matched models of one of the papers' tables, evaluate them and
print our table beside the paper's -- honestly, whatever the result.

A suite is a list of rows (label + run config; :mod:`mhmoe.research.suites`); every run lives in
``OUT/<label>/seed<k>/`` and a run whose ``results.json`` exists is reused, so an interrupted suite
costs nothing extra when the command is repeated; suites that share row labels can share an ``--out``
folder and reuse each other's runs (``renorm-ablation`` reuses the default-weight rows of
``v2-table1``). Outputs (the suite directory layout of :mod:`mhmoe.research.report`): ``results.csv``
(one line per run), ``results.md`` (mean ± std over seeds beside the paper's numbers),
``results.json`` (every run's results), ``summary.json`` (the table as data: per row and validation
set the mean, std and per-seed values, rounded as printed, the paper's numbers, and every pair of rows
compared per validation set, *separated* when every seed of one is below every seed of the other) and
``curves.png`` (training loss and validation perplexity over steps, one line per model, averaged over
seeds). The result files describe the last suite run in the folder.
"""

from __future__ import annotations

import csv
import io
import json
import statistics
import sys
from pathlib import Path

from mhmoe.config.presets import SCALES
from mhmoe.config.run import RunConfig
from mhmoe.errors import ConfigError
from mhmoe.research.report import plot_suite_curves, write_json
from mhmoe.research.suites import SUITE_BLOCKS, SUITE_SCALES, SUITES, Row, select_rows, suite_rows
from mhmoe.runtime.bounded import load_json
from mhmoe.runtime.files import atomic_write, make_dirs

__all__ = ["SUITES", "SUITE_BLOCKS", "SUITE_SCALES", "Row", "run_suite", "run_table", "select_rows", "suite_rows"]



def run_table(name: str, out: str | Path, **kwargs) -> list[dict]:
    """:func:`run_suite` for ``name`` and then for each of its blocks (:data:`SUITE_BLOCKS`) in
    ``OUT/<block>/``; ``OUT/results.md`` then holds every block's table (CSV and curves stay per block).
    Report-only (``train_missing=False``) leaves out the blocks without a finished run."""
    out = Path(out)
    parts = [(name, out)] + [(b, out / b) for b in SUITE_BLOCKS.get(name, ())]
    if len(parts) == 1:
        return run_suite(name, out, **kwargs)
    results, tables = [], []
    for suite, where in parts:
        if not kwargs.get("train_missing", True) and not any(where.glob("*/seed*/results.json")):
            continue
        results += run_suite(suite, where, **kwargs)
        tables.append((where / "results.md").read_text(encoding="utf-8"))
    if not results:
        raise ConfigError("--out", str(out), f"a directory with finished {name} runs (--report-only trains nothing)")
    atomic_write(out / "results.md", "\n".join(tables))
    return results


def run_dir_name(label: str) -> str:
    """The folder name of a row's runs (ASCII letters, digits, ``-_.``)."""
    label = label.replace("✓", "on").replace("✗", "off").replace(" ", "_")
    return "".join(c if c.isascii() and (c.isalnum() or c in "-_.") else "_" for c in label)


def _run_dir(out: Path, label: str, seed: int) -> Path:
    return out / run_dir_name(label) / f"seed{seed}"


def run_suite(name: str, out: str | Path, scale: str = "tiny", seeds: int = 1, tokens: int | None = None,
              overrides: list[str] | None = None, progress: bool = True, train_missing: bool = True,
              only: list[str] | None = None, minutes: float | None = None) -> list[dict]:
    """Train (or reuse) every row x seed of suite ``name``; write results.csv/md, summary.json and curves.png.

    ``train_missing=False`` trains nothing and reports the runs that already finished (an error if none).
    ``only``: the labels of the rows to train and report (default: every row).
    ``minutes``: instead of ``tokens``, the wall-clock budget of the whole suite; every run gets the same
    token count, calibrated on this machine (:mod:`mhmoe.research.budget`, ``OUT/budget.json``).
    """
    from mhmoe.train.loop import train

    if scale not in SUITE_SCALES or scale not in SCALES:
        raise ConfigError("--scale", scale, " | ".join(s for s in SUITE_SCALES if s in SCALES))
    if seeds < 1:
        raise ConfigError("--seeds", seeds, "an integer >= 1")
    out = Path(out)
    results = []
    rows = select_rows(name, only)
    built = [(row, row.build(scale)) for row in rows]
    budget = None
    if minutes is not None:
        if tokens:
            raise ConfigError("--tokens", tokens, "no --tokens with --minutes (the budget sets the tokens)")
        from mhmoe.research.budget import suite_budget

        runs = {row.label: base.with_overrides(list(overrides or [])) for row, base in built}
        budget = suite_budget(out, name, runs, seeds, minutes)
        tokens = budget["tokens_per_run"]
    for seed in range(seeds):  # seed-major: an interrupted suite has whole seeds of every row
        for row, base in built:
            step_tokens = base.with_overrides(list(overrides or [])).train.tokens_per_step  # after --set
            steps = max(1, tokens // step_tokens) if tokens else base.train.max_steps
            # 4 validation points per run for the curves (before user overrides, which win)
            sets = [f"train.eval_every={max(1, steps // 4)}", f"train.max_steps={steps}"]
            sets += list(overrides or []) + [f"train.seed={base.train.seed + seed}"]
            run = base.with_overrides(sets)
            run_dir = _run_dir(out, row.label, seed)
            done = run_dir / "results.json"
            _check_same_run(run_dir, run)
            if not done.exists() and not train_missing:
                print(f"[{name}] {row.label} seed {seed}: not finished, left out", file=sys.stderr)
                continue
            if not done.exists():
                print(f"[{name}] {row.label} seed {seed}: {run.train.max_steps} steps", file=sys.stderr)
                resume = run_dir.is_dir()  # the suite's own: continue it
                make_dirs(run_dir, root=out)  # a symlinked row or seed directory in --out is refused
                train(run, run_dir, resume=resume, progress=progress)
            res = load_json(done.read_text(), str(done))
            results.append({"label": row.label, "seed": seed, "train_seed": run.train.seed, "run_dir": str(run_dir),
                            **res})
    if not results:
        raise ConfigError("--out", str(out), f"a directory with finished {name} runs (--report-only trains nothing)")
    write_outputs(name, rows, results, out, budget)
    return results


#: fields that do not change what a run computes (launch properties and logging), ignored when reusing a run
BOOKKEEPING = {"log_every", "eval_every", "eval_batches", "ckpt_every", "keep_last", "threads", "device", "parallel",
               "ep", "cache_dir"}


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        out.update(_flat(v, key + ".") if isinstance(v, dict) else {key: v})
    return out


def _check_same_run(run_dir: Path, run: RunConfig) -> None:
    """A reused run must have been trained with the same config (bookkeeping fields aside)."""
    saved = run_dir / "config.yaml"
    if not saved.exists():
        return
    old = _flat(RunConfig.load(saved).to_dict())
    new = _flat(run.to_dict())
    for key in sorted(set(old) | set(new)):
        if key.split(".")[-1] in BOOKKEEPING or key in ("name", "model.vocab_size"):
            continue
        if old.get(key) != new.get(key):
            raise ConfigError("--out", str(run_dir), f"a directory without a different run in it ({key}: "
                              f"{old.get(key)!r} there, {new.get(key)!r} now); use another --out")


def write_outputs(name: str, rows: list[Row], results: list[dict], out: Path, budget: dict | None = None) -> None:
    sets = sorted({k for r in results for k in r["eval"]}, key=lambda s: (s != "kjv", s))
    buf = io.StringIO(newline="")
    w = csv.writer(buf)
    w.writerow(["suite", "label", "seed", "params", "fwd_flops_per_token", "tokens_per_s", "train_s"]
               + [f"ppl_{s}" for s in sets])
    for r in results:
        w.writerow([name, r["label"], r["seed"], r["params"], r["fwd_flops_per_token"], f"{r['tokens_per_s']:.1f}",
                    f"{r['train_s']:.1f}"] + [f"{r['eval'][s]['ppl']:.4f}" if s in r["eval"] else "" for s in sets])
    atomic_write(out / "results.csv", buf.getvalue())
    paper_cols = list(rows[0].paper)
    head = ["model", "params", "FLOPs/token"] + [f"ours {s}" for s in sets] + [f"paper {c}" for c in paper_cols]
    lines = [f"# {name}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        rs = [r for r in results if r["label"] == row.label]
        if not rs:
            continue
        cells = [row.label, f"{rs[0]['params'] / 1e6:.2f}M", f"{rs[0]['fwd_flops_per_token'] / 1e6:.2f}M"]
        for s in sets:
            v = [r["eval"][s]["ppl"] for r in rs if s in r["eval"]]
            cells.append("-" if not v else f"{statistics.mean(v):.2f}" +
                         (f" ± {statistics.stdev(v):.2f}" if len(v) > 1 else ""))
        cells += [f"{row.paper[c]:.2f}" for c in paper_cols]
        lines.append("| " + " | ".join(cells) + " |")
    n_seeds = len({r["seed"] for r in results})
    lines += ["", f"Seeds: {n_seeds}. Ours: validation perplexity (mean ± std over seeds) on our corpora; "
              "paper: its reported perplexity on its own data and scale -- compare orderings, not values."]
    lines += [f"Note: {row.note}" for row in rows if row.note]
    if budget:
        lines.append(f"Budget: {budget['minutes']:g} minutes for {budget['seeds']} seed(s) x {len(budget['rows'])} "
                     f"rows on {', '.join(budget['device'])} -> {budget['tokens_per_run']:,} tokens per run "
                     "(calibrated; budget.json).")
    summary = summarize_results(name, rows, results, sets)
    if budget:
        summary["budget"] = budget
    lines += [""] + separated_lines(summary["comparisons"])
    atomic_write(out / "results.md", "\n".join(lines) + "\n")
    write_json(results, out / "results.json", name, {"paper": {row.label: row.paper for row in rows}})
    plot_suite_curves(results, out / "curves.png", name)
    atomic_write(out / "summary.json", json.dumps(summary, indent=1, ensure_ascii=False) + "\n")


def _r2(v: float) -> float:
    return round(float(v), 2)


def summarize_results(name: str, rows: list[Row], results: list[dict], sets: list[str]) -> dict:
    """The suite's table as data, every number rounded as results.md prints it: per row its
    parameters and forward FLOPs per token (millions), and per validation set the mean, std (over seeds;
    0 with one seed) and per-seed perplexities, beside the paper's numbers."""
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
                      "ppl": ppl, "paper": dict(row.paper)})
    return {"suite": name, "seeds": len({r["seed"] for r in results}), "validation_sets": sets,
            "paper_columns": list(rows[0].paper), "rows": table, "notes": [r.note for r in rows if r.note],
            "comparisons": compare_rows(table, sets)}


def compare_rows(table: list[dict], sets: list[str]) -> list[dict]:
    """Every pair of rows on every validation set (rows with >= 2 seeds there): which is lower, by how
    much (difference of means), and whether the two are **separated** -- every seed of the lower row
    below every seed of the higher one. Only separated pairs are read as an ordering in the docs."""
    out = []
    for i, a in enumerate(table):
        for b in table[i + 1:]:
            for s in sets:
                pa, pb = a["ppl"].get(s), b["ppl"].get(s)
                if not pa or not pb or min(len(pa["per_seed"]), len(pb["per_seed"])) < 2:
                    continue
                lower, higher = (pa, pb) if pa["mean"] <= pb["mean"] else (pb, pa)
                out.append({"a": a["label"], "b": b["label"], "set": s,
                            "lower": a["label"] if lower is pa else b["label"],
                            "mean_diff": _r2(higher["mean"] - lower["mean"]),
                            "separated": max(lower["per_seed"]) < min(higher["per_seed"])})
    return out


def separated_lines(comparisons: list[dict]) -> list[str]:
    """results.md's lines for the separated pairs (or one line saying there are none)."""
    sep = [c for c in comparisons if c["separated"]]
    if not comparisons:
        return []
    if not sep:
        return ["Separated pairs (every seed of one row below every seed of the other): none."]
    lines = ["Separated pairs (every seed of one row below every seed of the other):"]
    for c in sep:
        other = c["b"] if c["lower"] == c["a"] else c["a"]
        lines.append(f"- {c['set']}: {c['lower']} < {other} (by {c['mean_diff']:.2f})")
    return lines
