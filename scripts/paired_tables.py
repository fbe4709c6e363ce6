"""The paired comparisons of the suite results quoted in docs/RESULTS.md, under the separation rule of
``mhmoe.research.stats`` (95% paired-t CI of the validation-loss difference excludes 0), recomputed from
the per-seed perplexities stored in ``docs/results/<suite>-tiny.json`` (loss = ln of the perplexity as
stored, 2 decimals: at a perplexity of 150 that is within 0.00003 nats).

    python scripts/paired_tables.py --json docs/results/paired-comparisons.json

``tests/research/test_paired_tables.py`` regenerates the file and compares.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from mhmoe.research.stats import compare_paired, separation_counts
from mhmoe.research.suites import suite_settings

ROOT = Path(__file__).resolve().parents[1]
SUITES = ("v2-table1", "v2-table2", "v2-table3", "v2-table4", "v2-table5", "icml-table1", "icml-table1-code",
          "icml-table6", "renorm-ablation")
# docs/ICML-SETTINGS.md's blocks of ICML Table 1 (their files are named differently)
SETTINGS_FILES = {"icml-table1-multilingual": "icml-settings-multilingual.json",
                  "icml-table1-multimodal": "icml-settings-multimodal.json"}
# the training corpus's own held-out split, where it is not the first validation set
IN_DOMAIN = {"icml-table1-multilingual": "manpages"}


def _r(x: float | None, digits: int = 6) -> float | None:
    return None if x is None else round(float(x), digits)


def _losses(row: dict, s: str) -> dict[int, float]:
    cell = row["ppl"].get(s)
    if not cell:
        return {}
    seeds = row.get("train_seeds") or range(len(cell["per_seed"]))  # seed k of every row pairs with seed k
    return {seed: math.log(p) for seed, p in zip(seeds, cell["per_seed"], strict=True)}


def suite_pairs(summary: dict) -> dict:
    """Every pair of rows on every validation set (``a`` above ``b`` in the table, a primary pair in its
    own order), the separation count and the primary comparisons on the in-domain set."""
    primary = set(suite_settings(summary["suite"]).primary)
    rows, sets = summary["rows"], summary["validation_sets"]
    comps = []
    for i, ra in enumerate(rows):
        for rb in rows[i + 1:]:
            a, b = (rb, ra) if (rb["label"], ra["label"]) in primary else (ra, rb)
            for s in sets:
                c = compare_paired(_losses(a, s), _losses(b, s))
                if c is None:
                    continue
                comps.append({"a": a["label"], "b": b["label"], "set": s, "n": c["n"],
                              "mean_diff": _r(c["mean_diff"]), "sd_diff": _r(c["sd_diff"]),
                              "ci95": None if c["ci95"] is None else [_r(v) for v in c["ci95"]],
                              "p_sign_flip": _r(c["p_sign_flip"]), "p_min": _r(c["p_min"]),
                              "separated": c["separated"], "primary": (a["label"], b["label"]) in primary})
    sep = separation_counts(comps)
    in_domain = IN_DOMAIN.get(summary["suite"], sets[0])
    return {"validation_sets": sets, "in_domain": in_domain, "separation": sep,
            "separated_pairs": [c for c in comps if c["separated"]],
            "in_domain_separated": sum(c["separated"] for c in comps if c["set"] == in_domain),
            "in_domain_compared": sum(c["ci95"] is not None for c in comps if c["set"] == in_domain),
            "primary": [c for c in comps if c["primary"] and c["set"] == in_domain], "comparisons": comps}


def table() -> dict:
    out, settings = {}, {}
    for name in SUITES:
        path = ROOT / "docs" / "results" / f"{name}-tiny.json"
        out[name] = {"source": str(path.relative_to(ROOT)), **suite_pairs(json.loads(path.read_text()))}
    for name, file in SETTINGS_FILES.items():
        path = ROOT / "docs" / "results" / file
        settings[name] = {"source": str(path.relative_to(ROOT)), **suite_pairs(json.loads(path.read_text()))}
    total = sum(s["separation"]["compared"] for s in out.values())
    return {"rule": separation_counts([])["rule"], "suites": out,
            "all": {"compared": total, "separated": sum(s["separation"]["separated"] for s in out.values()),
                    "expected_by_chance": round(0.05 * total, 2)}, "icml_settings": settings}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="PATH", help="write the table here (default: print it)")
    args = ap.parse_args()
    text = json.dumps(table(), indent=1, ensure_ascii=False) + "\n"
    if args.json:
        Path(args.json).write_text(text, encoding="utf-8")
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
