"""Scaling the number of experts (ICML Fig. 6 (a) / Fig. 9): validation perplexity and expert activation
against the expert count, one line per model family, from a finished ``mhmoe reproduce`` folder
(``mhmoe analyze --suite DIR --scaling``; suite ``icml-fig6``).

Inputs, all written by earlier commands: ``DIR/summary.json`` (the suite's table: perplexity mean, std and
per seed of every row, :func:`mhmoe.research.reproduce.summarize_results`), every row's
``DIR/<row>/seed0/config.yaml`` (its expert count and heads) and, when present, ``DIR/analysis.json``
(:func:`mhmoe.research.analysis.analyze_suite`: activation ratio and its random-routing value). A row's
family is its label without the parenthesis (``MH-MoE (64 experts)`` -> ``MH-MoE``).

Outputs: ``DIR/scaling.json`` (per family, lists aligned on its expert counts) and ``DIR/scaling.png``:
left, validation perplexity (mean ± seed std) against the number of experts on a log2 axis; right, the
expert activation ratio of each family (solid) beside random routing's for the same H, K and E (dashed).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from mhmoe.runtime.files import atomic_write
from mhmoe.runtime.reading import read_json, regular_or_missing


def family_of(label: str) -> str:
    """``MH-MoE (64 experts)`` -> ``MH-MoE``: the label without its trailing parenthesis."""
    return re.sub(r"\s*\([^()]*\)\s*$", "", label) or label


def _row_config(suite_dir: Path, label: str) -> tuple[int, int]:
    """(experts, heads) of a row, from the config.yaml of its first finished seed."""
    from mhmoe.checkpoint.layout import CONFIG_FILE
    from mhmoe.config.run import RunConfig
    from mhmoe.research.reproduce import run_dir_name
    from mhmoe.research.store import suite_run_dirs

    cfgs = sorted((d / CONFIG_FILE for name, _, d in suite_run_dirs(suite_dir)
                   if name in (label, run_dir_name(label)) and regular_or_missing(d / CONFIG_FILE)), key=str)
    if not cfgs:
        raise ValueError(f"{suite_dir}: no config.yaml for row {label!r} (no finished run of it found)")
    moe = RunConfig.load(cfgs[0]).model.moe
    if moe.kind == "dense":
        return 0, 0
    return int(moe.n_experts), int(moe.heads)


def _read(path: Path) -> dict:
    """A suite's JSON file: a regular file within the JSON limit (a symlink, a FIFO, a device, an
    oversized file: BoundedLoadError naming it)."""
    return read_json(path, follow=False, what=path.name)


def scaling_table(suite_dir: str | Path, val_set: str | None = None) -> dict:
    """``scaling.json``'s content (module docstring): per family, sorted by expert count, the perplexity on
    ``val_set`` (default: the suite's first validation set) and the activation ratios when analysed."""
    root = Path(suite_dir)
    if not regular_or_missing(root / "summary.json"):
        raise ValueError(f"{root}: no summary.json (run `mhmoe reproduce SUITE --out {root}` first)")
    summary = _read(root / "summary.json")
    val_set = val_set or (summary.get("validation_sets") or [None])[0]
    analysis = _read(root / "analysis.json") if regular_or_missing(root / "analysis.json") else None
    routing = {r["label"]: r for r in analysis["rows"]} if analysis else {}
    points: dict[str, list[dict]] = {}
    for row in summary["rows"]:
        experts, heads = _row_config(root, row["label"])
        ppl = row["ppl"].get(val_set)
        if not experts or ppl is None:
            continue  # dense rows, or rows without this validation set
        r = routing.get(row["label"], {})
        points.setdefault(family_of(row["label"]), []).append({
            "label": row["label"], "experts": experts, "heads": heads, "seeds": len(ppl["per_seed"]),
            "ppl_mean": ppl["mean"], "ppl_std": ppl["std"], "ppl_per_seed": ppl["per_seed"],
            "activation_ratio": r.get("activation_ratio"), "random_activation_ratio": r.get("random_activation_ratio"),
            "uniform_frequency": (r.get("uniform_frequency") or {}).get("mean")})
    if not points:
        raise ValueError(f"{root}: no finished MoE rows with validation set {val_set!r}")
    families = {f: sorted(p, key=lambda x: x["experts"]) for f, p in points.items()}
    return {"suite": summary.get("suite"), "suite_dir": str(root), "validation_set": val_set,
            "threshold": analysis.get("threshold") if analysis else None,
            "families": {f: {k: [p[k] for p in ps] for k in ps[0]} for f, ps in families.items()}}


def scaling_figure(table: dict[str, Any]) -> Any:
    """Perplexity and activation ratio against the number of experts (module docstring)."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    from mhmoe.train.plot_style import colors, figure, plain_number, value_axis

    fig, (ax_ppl, ax_act) = figure((11, 4.2), ncols=2)
    palette = colors()
    experts = sorted({e for f in table["families"].values() for e in f["experts"]})
    ppl_values = []
    for i, (name, f) in enumerate(table["families"].items()):
        c = palette[i % len(palette)]
        ax_ppl.errorbar(f["experts"], f["ppl_mean"], yerr=f["ppl_std"], color=c, marker="o", capsize=3,
                        label=f"{name} (h={f['heads'][0]}; {max(f['seeds'])} seed{'s' if max(f['seeds']) > 1 else ''})")
        ppl_values += [m + s for m, s in zip(f["ppl_mean"], f["ppl_std"], strict=True)]
        ppl_values += [m - s for m, s in zip(f["ppl_mean"], f["ppl_std"], strict=True)]
        _activation_lines(ax_act, name, f, c)
    for ax in (ax_ppl, ax_act):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(experts))
        ax.xaxis.set_major_formatter(FuncFormatter(plain_number))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("experts per MoE layer (log2)")
        ax.grid(alpha=0.3)
    value_axis(ax_ppl, ppl_values)
    ax_ppl.set(ylabel=f"validation perplexity, {table['validation_set']} (mean ± seed std)",
               title=f"{table.get('suite') or 'suite'}: perplexity vs experts")
    ax_ppl.legend(fontsize=7)
    _activation_axes(ax_act, table)
    fig.tight_layout()
    return fig


def _activation_lines(ax: Any, name: str, f: dict, color: str) -> None:
    """One family's activation ratio (solid, ± seed std) and random routing's (dashed)."""
    pts = [(e, a) for e, a in zip(f["experts"], f["activation_ratio"], strict=True) if a]
    if pts:
        ax.errorbar([e for e, _ in pts], [a["mean"] for _, a in pts], yerr=[a["std"] for _, a in pts], color=color,
                    marker="o", capsize=3, label=name)
    rnd = [(e, a) for e, a in zip(f["experts"], f["random_activation_ratio"], strict=True) if a]
    if rnd:
        ax.plot([e for e, _ in rnd], [a["mean"] for _, a in rnd], color=color, linestyle="--", marker="x",
                label=f"{name}, random routing")


def _activation_axes(ax: Any, table: dict) -> None:
    ax.set_ylim(-0.03, 1.05)
    if table.get("threshold") is None:
        ax.text(0.5, 0.5, "no routing statistics:\nrun `mhmoe analyze --suite DIR --scaling`", ha="center",
                va="center", transform=ax.transAxes, fontsize=9)
    else:
        ax.legend(fontsize=7)
    ax.set(ylabel="expert activation ratio", title="experts selected > "
           f"{table.get('threshold') if table.get('threshold') is not None else '?'} times per token")


def write_scaling(suite_dir: str | Path, val_set: str | None = None) -> dict:
    """Write ``DIR/scaling.json`` and ``DIR/scaling.png``; returns the table."""
    from mhmoe.train.plot_style import save_figure

    table = scaling_table(suite_dir, val_set)
    root = Path(suite_dir)
    atomic_write(root / "scaling.json", json.dumps(table, indent=1) + "\n")
    save_figure(scaling_figure(table), root / "scaling.png", dpi=120)
    return table
