"""The data behind docs/ICML-SETTINGS.md: the tiny presets' sizes, and the multilingual and masked
multi-modal blocks of ``mhmoe reproduce icml-table1`` summarised over seeds (mean, std and per-seed
values, rounded as the doc prints them), plus the Fig. 8 picture of one run.

    python benchmarks/icml_settings_report.py --runs /work/runs-settings --out docs/results
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import statistics
from pathlib import Path

import torch

from mhmoe.config.flops import model_flops_per_token
from mhmoe.config.presets import get_preset
from mhmoe.model import build_model
from mhmoe.research.reproduce import _run_dir, suite_rows

BLOCKS = {"multilingual": ("icml-table1-multilingual", "ml"), "multimodal": ("icml-table1-multimodal", "mm")}
KINDS = ("dense", "xmoe-8", "mh4-8", "xmoe-32", "mh4-32")


def preset_sizes() -> dict:
    """Parameters and analytic forward FLOPs per token of every tiny setting preset."""
    out = {}
    for _, setting in BLOCKS.values():
        for kind in KINDS:
            run = get_preset(f"tiny-icml-{setting}-{kind}")
            torch.manual_seed(0)
            model = build_model(run.model)
            out[run.name] = {"params_M": round(model.num_params() / 1e6, 2),
                             "fwd_flops_per_token_M": round(model_flops_per_token(run.model, run.train.seq_len).total
                                                            / 1e6, 2),
                             "expert_width": run.model.moe.d_expert, "heads": run.model.moe.heads,
                             "experts": run.model.moe.n_experts if run.model.moe.kind == "moe" else 0,
                             "vocab_size": run.model.vocab_size, "seq_len": run.train.seq_len}
    return out


def _r2(x: float) -> float:
    return round(float(x), 2)


def summarize_block(suite: str, folder: Path) -> dict:
    """Per row: seeds, steps, tokens/s, and per validation set mean/std/per-seed perplexity (2 decimals)."""
    rows = list(csv.DictReader(open(folder / "results.csv", encoding="utf-8")))
    sets = [k.removeprefix("ppl_") for k in rows[0] if k.startswith("ppl_")]
    table = []
    for row in suite_rows(suite):
        rs = sorted((r for r in rows if r["label"] == row.label), key=lambda r: int(r["seed"]))
        if not rs:
            continue
        steps = {json.loads((_run_dir(folder, row.label, int(r["seed"])) / "results.json").read_text())["step"]
                 for r in rs}
        ppl = {}
        for s in sets:
            v = [float(r[f"ppl_{s}"]) for r in rs if r[f"ppl_{s}"]]
            ppl[s] = {"mean": _r2(statistics.mean(v)), "std": _r2(statistics.stdev(v)) if len(v) > 1 else 0.0,
                      "per_seed": [_r2(x) for x in v]}
        table.append({"label": row.label, "seeds": len(rs), "steps": sorted(steps),
                      "params_M": _r2(int(rs[0]["params"]) / 1e6),
                      "fwd_flops_per_token_M": _r2(float(rs[0]["fwd_flops_per_token"]) / 1e6),
                      "tokens_per_s": round(statistics.mean(float(r["tokens_per_s"]) for r in rs)),
                      "ppl": ppl, "paper": row.paper})
    return {"suite": suite, "validation_sets": sets, "rows": table, "comparisons": compare(table, sets)}


PAIRS = (("Dense", "X-MoE (8 experts)"), ("X-MoE (8 experts)", "MH-MoE (8 experts)"),
         ("X-MoE (32 experts)", "MH-MoE (32 experts)"), ("X-MoE (8 experts)", "X-MoE (32 experts)"),
         ("MH-MoE (8 experts)", "MH-MoE (32 experts)"))


def compare(table: list[dict], sets: list[str]) -> list[dict]:
    """Per pair of rows and validation set: which has the lower mean perplexity, by how much, and whether
    the seeds separate them (every seed of one below every seed of the other); otherwise not established."""
    by_label = {r["label"]: r for r in table}
    out = []
    for a, b in PAIRS:
        if a not in by_label or b not in by_label:
            continue
        for s in sets:
            pa, pb = by_label[a]["ppl"][s], by_label[b]["ppl"][s]
            lower, higher = (pa, pb) if pa["mean"] <= pb["mean"] else (pb, pa)
            out.append({"a": a, "b": b, "set": s, "lower": a if lower is pa else b,
                        "mean_diff": _r2(higher["mean"] - lower["mean"]),
                        "separated": max(lower["per_seed"]) < min(higher["per_seed"])})
    return out


def _cell(p: dict) -> str:
    return f"{p['mean']:.2f} ± {p['std']:.2f}"


def markdown(name: str, summary: dict) -> str:
    """The doc's tables of one block: the models (params, FLOPs, perplexities, paper), and for the
    multilingual block every language as a row."""
    rows, sets = summary["rows"], summary["validation_sets"]
    main_sets = [s for s in sets if not s.startswith("man-")]
    lines = [f"<!-- source: docs/results/icml-settings-{name}.json -->",
             "| model | params | fwd FLOPs/token | " + " | ".join(f"ppl {s}" for s in main_sets)
             + " | paper (ICML Table 1) |", "|" + "---|" * (4 + len(main_sets))]
    for r in rows:
        lines.append(f"| {r['label']} | {r['params_M']}M | {r['fwd_flops_per_token_M']}M | "
                     + " | ".join(_cell(r["ppl"][s]) for s in main_sets) + f" | {r['paper']['Perplexity']} |")
    langs = [s for s in sets if s.startswith("man-")]
    if langs:
        lines += ["", f"<!-- source: docs/results/icml-settings-{name}.json -->",
                  "| language | " + " | ".join(r["label"] for r in rows) + " |", "|" + "---|" * (1 + len(rows))]
        lines += [f"| {s} | " + " | ".join(_cell(r["ppl"][s]) for r in rows) + " |" for s in langs]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", required=True, help="folder holding <suite>-tiny/ reproduce outputs")
    ap.add_argument("--out", required=True)
    ap.add_argument("--machine", default="", help="CPU and conditions, recorded with the results")
    ap.add_argument("--command", default="", help="the reproduce command that produced the runs")
    args = ap.parse_args()
    out = Path(args.out)
    (out / "icml-settings-presets.json").write_text(json.dumps(preset_sizes(), indent=1) + "\n", encoding="utf-8")
    for name, (suite, _) in BLOCKS.items():
        folder = Path(args.runs) / f"{suite}-tiny"
        if not (folder / "results.csv").exists():
            continue
        summary = {**summarize_block(suite, folder), "machine": args.machine, "command": args.command}
        (out / f"icml-settings-{name}.json").write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n",
                                                       encoding="utf-8")
        print(markdown(name, summary), end="\n\n")
    fig = Path(args.runs) / "fig8" / "fig8.png"
    if fig.exists():
        shutil.copy(fig, out / "icml-settings-fig8.png")


if __name__ == "__main__":
    main()
