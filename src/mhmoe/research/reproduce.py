"""``mhmoe reproduce SUITE``: train the matched models of one of the papers' tables, evaluate them and
print our table beside the paper's -- honestly, whatever the result.

A suite is a list of rows (label + run config); every run lives in ``OUT/<label>/seed<k>/`` and a
run whose ``results.json`` exists is reused, so an interrupted suite costs nothing extra when the
command is repeated; suites that share row labels can share an ``--out`` folder and reuse each other's
runs (``renorm-ablation`` reuses the default-weight rows of ``v2-table1``). Outputs (the suite directory
layout of :mod:`mhmoe.research.report`): ``results.csv`` (one line per run), ``results.md`` (mean ± std
over seeds beside the paper's numbers), ``results.json`` (every run's results), ``summary.json`` (the
table as data: per row and validation set the mean, std and per-seed values, rounded as printed, and the
paper's numbers) and ``curves.png`` (training loss and validation perplexity over steps, one line per
model, averaged over seeds). The result files describe the last suite run in the folder.
"""

from __future__ import annotations

import csv
import io
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from mhmoe.config.moe import MoEConfig
from mhmoe.config.planner import plan
from mhmoe.config.presets import (
    SCALES,
    _run,
    bitnet_run,
    icml_moe_config,
    icml_router_dim,
    icml_setting_run,
    moe_config,
)
from mhmoe.config.run import RunConfig
from mhmoe.errors import ConfigError
from mhmoe.research.report import plot_suite_curves, write_json
from mhmoe.runtime.bounded import load_json
from mhmoe.runtime.files import atomic_write, make_dirs


@dataclass
class Row:
    label: str
    build: Callable[[str], RunConfig]  # scale -> run config
    paper: dict[str, float]  # column -> the paper's number (perplexity)
    parity_group: str | None = None  # rows of one group are at FLOPs/params parity with each other
    note: str = ""  # printed under the table (e.g. where the paper's tables disagree)


def _variant(variant: str, shared: bool = False) -> Callable[[str], RunConfig]:
    return lambda scale: _run(f"{scale}-{variant}", scale, moe_config(scale, variant, shared))


def _bitnet(variant: str) -> Callable[[str], RunConfig]:
    """The variant quantized with BitNet b1.58 and its schedule defaults (the ``*-bitnet`` presets)."""
    return lambda scale: bitnet_run(_run(f"{scale}-{variant}", scale, moe_config(scale, variant)))


def _with(variant: str, **changes) -> Callable[[str], RunConfig]:
    return lambda scale: _run(f"{scale}-{variant}", scale, replace(moe_config(scale, variant), **changes))


def _mh_no_head_merge(scale: str) -> RunConfig:
    """MH-MoE h=2 without head/merge, re-planned to the SMoE's FLOPs and parameters (v2 Table 4)."""
    d, d_ff = SCALES[scale]["d_model"], SCALES[scale]["d_ff"]
    p = plan(d, d_ff, 8, 1, "swiglu", heads=2, head_layer=False, merge_layer=False)
    return _run(f"{scale}-mh2-nohm", scale, MoEConfig(n_experts=int(p.mhmoe.experts), top_k=2,
                                                      d_expert=int(p.mhmoe.d_ff), heads=2))


def _icml(heads: int, experts: int = 8, hm: bool = True, mlp_layers: int = 1,
          token_split: bool = True) -> Callable[[str], RunConfig]:
    """ICML setting (X-MoE router, ReLU experts of 4d, top-2), re-planned at parameter parity with the
    X-MoE baseline for every ablation (the paper: "the parameter quantities ... are equal")."""
    def build(scale: str) -> RunConfig:
        base = icml_moe_config(scale, 1, experts)
        if heads == 1 and not hm:
            return _run(f"{scale}-icml-xmoe-{experts}", scale, base)
        d = SCALES[scale]["d_model"]
        h_plan = heads if token_split else 1
        p = plan(d, 4 * d, experts, 2, "relu", heads=h_plan, parity="params", head_layer=hm, merge_layer=hm,
                 mlp_layers=mlp_layers)
        moe = replace(base, d_expert=int(p.mhmoe.d_ff), heads=heads, head_layer=hm, merge_layer=hm,
                      mlp_layers=mlp_layers, token_split=token_split,
                      router_dim=icml_router_dim(heads, token_split))
        return _run(f"{scale}-icml-h{heads}-{experts}", scale, moe)
    return build


V2_COLS = ("RedPajama", "Wiki", "C4")


def _v2(red_pajama: float, wiki: float, c4: float) -> dict[str, float]:
    """The v2 paper's perplexity columns."""
    return dict(zip(V2_COLS, (red_pajama, wiki, c4), strict=True))

# v2 paper, 100k steps (Tables 1, 2, 4, 5)
SUITES: dict[str, list[Row]] = {
    "v2-table1": [
        Row("Dense", _variant("dense"), _v2(12.13, 11.58, 16.21)),
        Row("SMoE", _variant("smoe"), _v2(10.90, 9.68, 14.35), "v2"),
        Row("Fine-grained SMoE", _variant("fgmoe"), _v2(10.74, 9.38, 13.97), "v2"),
        Row("MH-MoE (head=2)", _variant("mh2"), _v2(10.70, 9.26, 13.80), "v2"),
        Row("MH-MoE (head=3)", _variant("mh3"), _v2(10.51, 9.18, 13.63), "v2"),
    ],
    "v2-table2": [
        Row("SMoE", _variant("smoe", True), _v2(10.66, 9.44, 14.30), "v2"),
        Row("Fine-grained SMoE", _variant("fgmoe", True), _v2(10.41, 9.15, 13.78), "v2"),
        Row("MH-MoE (head=2)", _variant("mh2", True), _v2(10.36, 8.79, 13.66), "v2"),
        Row("MH-MoE (head=3)", _variant("mh3", True), _v2(10.28, 8.72, 13.49), "v2"),
    ],
    # BitNet b1.58 (1.58-bit weights, 8-bit activations), 100k steps; docs/BITNET.md
    "v2-table3": [
        Row("Dense", _bitnet("dense"), _v2(30.04, 24.75, 33.55)),
        Row("SMoE", _bitnet("smoe"), _v2(26.78, 21.54, 29.73), "v2"),
        Row("Fine-grained SMoE", _bitnet("fgmoe"), _v2(26.68, 21.42, 29.50), "v2"),
        Row("MH-MoE (head=2)", _bitnet("mh2"), _v2(26.59, 21.11, 29.27), "v2"),
        Row("MH-MoE (head=3)", _bitnet("mh3"), _v2(26.47, 21.06, 29.14), "v2"),
    ],
    # 50k steps in the paper (Table 4 has no 100k column)
    "v2-table4": [
        Row("SMoE", _variant("smoe"), _v2(11.87, 10.51, 15.63)),
        Row("SMoE + head & merge", _with("smoe", head_layer=True, merge_layer=True),
            _v2(11.84, 10.48, 15.61)),
        Row("Fine-grained SMoE", _variant("fgmoe"), _v2(11.68, 10.18, 15.21)),
        Row("Fine-grained SMoE + head & merge", _with("fgmoe", head_layer=True, merge_layer=True),
            _v2(11.67, 10.18, 15.19)),
        Row("MH-MoE (head=2) w/o head & merge", _mh_no_head_merge, dict(zip(V2_COLS, (11.71, 10.16, 15.23),
                                                                             strict=True))),
        Row("MH-MoE (head=2)", _variant("mh2"), _v2(11.46, 9.98, 14.89),
            note="MH-MoE (head=2): v2 Table 4 prints 11.46 / 9.98 / 14.89; its Tables 1 (50k steps) and 5 give "
                 "11.60 / 10.11 / 15.11 for the same model. We show Table 4's numbers."),
    ],
    "v2-table5": [
        Row(f"head {'✓' if h else '✗'} merge {'✓' if m else '✗'}", _with("mh2", head_layer=h, merge_layer=m),
            _v2(*vals))
        for (h, m), vals in {(False, False): (11.97, 10.40, 15.52), (True, False): (11.74, 10.18, 15.17),
                             (False, True): (11.84, 10.27, 15.36), (True, True): (11.60, 10.11, 15.11)}.items()
    ],
    # ICML (English LM, validation perplexity)
    "icml-table5": [Row("X-MoE", _icml(1, hm=False), {"Perplexity": 14.82}, "icml")] + [
        Row(f"MH-MoE h={h}", _icml(h), {"Perplexity": p}, "icml") for h, p in ((2, 12.87), (4, 12.72), (6, 12.41),
                                                                         (8, 12.95), (12, 13.28))
    ],
    "icml-table6": [
        Row("X-MoE", _icml(1, hm=False), {"Perplexity": 14.82}, "icml"),
        Row("X-MoE w/ MLP", _icml(1), {"Perplexity": 14.77}, "icml"),
        Row("MH-MoE w/o TS", _icml(4, token_split=False), {"Perplexity": 14.77}, "icml"),
        Row("MH-MoE w/o MLP", _icml(4, hm=False), {"Perplexity": 13.97}, "icml"),
        Row("MH-MoE", _icml(4), {"Perplexity": 12.72}, "icml"),
    ],
    "icml-table7": [Row(f"MH-MoE n={n}", _icml(4, hm=n > 0, mlp_layers=max(n, 1)), {"Perplexity": p}, "icml")
                    for n, p in ((0, 13.97), (1, 12.72), (2, 12.66), (3, 12.87))],
    # top-k weight renormalisation (MoEConfig.renormalize): the k > 1 models of v2-table1 with the
    # default (renormalised, GShard / X-MoE) and the raw gate values. Rows with v2-table1's labels are
    # the same runs: with --out pointing at a finished v2-table1 folder only the raw rows are trained.
    "renorm-ablation": [Row("SMoE", _variant("smoe"), {}, "v2")] + [
        row for label, v in (("Fine-grained SMoE", "fgmoe"), ("MH-MoE (head=2)", "mh2"), ("MH-MoE (head=3)", "mh3"))
        for row in (Row(label, _variant(v), {}, "v2"),
                    Row(f"{label}, raw top-k weights", _with(v, renormalize=False), {}, "v2"))
    ],
    # ICML Table 1, English-focused language modelling block
    "icml-table1": [
        Row("Dense", _variant("dense"), {"Perplexity": 16.23}),
        Row("X-MoE (8 experts)", _icml(1, 8, hm=False), {"Perplexity": 14.82}, "icml-8"),
        Row("MH-MoE (8 experts)", _icml(4, 8), {"Perplexity": 12.72}, "icml-8"),
        Row("X-MoE (32 experts)", _icml(1, 32, hm=False), {"Perplexity": 11.96}, "icml-32"),
        Row("MH-MoE (32 experts)", _icml(4, 32), {"Perplexity": 10.28}, "icml-32"),
    ],
}
SUITE_SCALES = ("tiny", "small", "paper")


# ---- ICML Table 1's multilingual and masked multi-modal blocks (docs/ICML-SETTINGS.md) ----------------
def _setting(setting: str, heads: int, experts: int) -> Callable[[str], RunConfig]:
    """A row of the multilingual (``ml``) or masked multi-modal (``mm``) block: the ``*-icml-ml-*`` /
    ``*-icml-mm-*`` presets (Dense: ``experts=0``; X-MoE: ``heads=1``; MH-MoE: ``heads=4``)."""
    return lambda scale: icml_setting_run(scale, setting, heads, experts)


def _setting_rows(setting: str, paper: tuple[float, float, float, float, float]) -> list[Row]:
    """Dense, X-MoE and MH-MoE with 8 and 32 experts beside ICML Table 1's perplexities, in that order."""
    return [
        Row("Dense", _setting(setting, 1, 0), {"Perplexity": paper[0]}),
        Row("X-MoE (8 experts)", _setting(setting, 1, 8), {"Perplexity": paper[1]}, "icml-8"),
        Row("MH-MoE (8 experts)", _setting(setting, 4, 8), {"Perplexity": paper[2]}, "icml-8"),
        Row("X-MoE (32 experts)", _setting(setting, 1, 32), {"Perplexity": paper[3]}, "icml-32"),
        Row("MH-MoE (32 experts)", _setting(setting, 4, 32), {"Perplexity": paper[4]}, "icml-32"),
    ]


SUITES["icml-table1-multilingual"] = _setting_rows("ml", (8.56, 7.19, 6.26, 6.02, 5.09))
SUITES["icml-table1-multimodal"] = _setting_rows("mm", (17.95, 16.34, 14.73, 12.68, 10.87))
# a table whose other blocks are suites of their own: run_table runs them after it, each in OUT/<block>/
SUITE_BLOCKS: dict[str, tuple[str, ...]] = {"icml-table1": ("icml-table1-multilingual", "icml-table1-multimodal")}


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


def suite_rows(name: str) -> list[Row]:
    if name not in SUITES:
        raise ConfigError("suite", name, ", ".join(SUITES))
    return SUITES[name]


def run_dir_name(label: str) -> str:
    """The folder name of a row's runs (ASCII letters, digits, ``-_.``)."""
    label = label.replace("✓", "on").replace("✗", "off").replace(" ", "_")
    return "".join(c if c.isascii() and (c.isalnum() or c in "-_.") else "_" for c in label)


def select_rows(name: str, only: list[str] | None = None) -> list[Row]:
    """The rows of suite ``name`` whose labels are in ``only`` (all rows when None), in table order."""
    rows = suite_rows(name)
    labels = [r.label for r in rows]
    for label in only or []:
        if label not in labels:
            raise ConfigError("--rows", label, " | ".join(labels))
    return [r for r in rows if only is None or r.label in only]


def _run_dir(out: Path, label: str, seed: int) -> Path:
    return out / run_dir_name(label) / f"seed{seed}"


def run_suite(name: str, out: str | Path, scale: str = "tiny", seeds: int = 1, tokens: int | None = None,
              overrides: list[str] | None = None, progress: bool = True, train_missing: bool = True,
              only: list[str] | None = None) -> list[dict]:
    """Train (or reuse) every row x seed of suite ``name``; write results.csv/md, summary.json and curves.png.

    ``train_missing=False`` trains nothing and reports the runs that already finished (an error if none).
    ``only``: the labels of the rows to train and report (default: every row).
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
    for seed in range(seeds):  # seed-major: an interrupted suite has whole seeds of every row
        for row, base in built:
            steps = max(1, tokens // base.train.tokens_per_step) if tokens else base.train.max_steps
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
    write_outputs(name, rows, results, out)
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


def write_outputs(name: str, rows: list[Row], results: list[dict], out: Path) -> None:
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
    atomic_write(out / "results.md", "\n".join(lines) + "\n")
    write_json(results, out / "results.json", name, {"paper": {row.label: row.paper for row in rows}})
    plot_suite_curves(results, out / "curves.png", name)
    summary = summarize_results(name, rows, results, sets)
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
            "paper_columns": list(rows[0].paper), "rows": table, "notes": [r.note for r in rows if r.note]}
