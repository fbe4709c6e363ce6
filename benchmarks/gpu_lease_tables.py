"""Fill docs/PERFORMANCE.md's GPU tables from the files a lease brought back (benchmarks/gpu_lease.py).

    python benchmarks/gpu_lease_tables.py benchmarks/results/gpu/h100-2026-12-01      # rewrites the doc
    python benchmarks/gpu_lease_tables.py DIR --doc other.md --stdout                  # print instead

Each GPU table of the doc sits below a marker line ``<!-- gpu-table: NAME -->`` (machine, layer, train, tests,
actmem);
this rewrites the table (and the ``<!-- source: ... -->`` line naming the JSON files its numbers come from,
relative to the repository) from the JSON files in DIR, and leaves a table whose files are absent as it is.
Numbers are written as the docs test checks them: ms with 2 decimals, ratios with 2, tokens/s whole, MFU in
percent.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^<!--\s*gpu-table:\s*([\w-]+)\s*-->$")
SOURCE = re.compile(r"^<!--\s*source:.*-->$")
UNMEASURED = "unmeasured: no lease yet"
LAYER_FILES = ["bench_mh3.json", "bench_parity.json", "bench_fp32.json", "bench_fp32-part2.json"]
TEST_FILES = ["gpu_tests.json", "gpu_tests_rest.json", "gpu_tests_rest-part2.json"]
CONFIG_ORDER = {"mh3": 0, "smoe": 1, "fgmoe": 2, "mh2": 3}
HEADERS = {
    "machine": ["GPU", "multiprocessors", "memory GiB", "SM clock MHz (max)", "driver", "torch", "CUDA", "triton"],
    "layer": ["config", "dtype", "pass", "ours ms", "fastest path", "`grouped_mm` ms", "`triton` ms", "dense/ours",
              "floor/ours", "hf_grouped_mm/ours", "hf_eager/ours", "peak MiB (ours)"],
    "train": ["preset", "path", "tokens/s", "ms/step", "MFU", "tokens/s vs dense"],
    "tests": ["selection", "tests", "passed", "failed", "errors", "skipped"],
    "actmem": ["model", "dtype", "mode", "held MiB", "held vs none", "peak MiB", "fwd+bwd ms", "time vs none"],
}


def _num(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _load(d: Path, names: list[str]) -> list[tuple[Path, dict]]:
    out = []
    for n in names:
        try:
            out.append((d / n, json.loads((d / n).read_text(encoding="utf-8"))))
        except (OSError, ValueError):
            continue
    return out


def machine_rows(d: Path) -> tuple[list[Path], list[list[str]]]:
    docs = _load(d, ["versions.json"])
    if not docs or not docs[0][1].get("gpu"):
        return [], []
    v = docs[0][1]
    g, smi, pk = v["gpu"], v.get("nvidia_smi") if isinstance(v.get("nvidia_smi"), dict) else {}, v["packages"]
    clock = f"{smi.get('clocks.sm', '-')} ({smi.get('clocks.max.sm', '-')})"
    return [docs[0][0]], [[g["name"], str(g["sm_count"]), f"{g['memory_gib']:.1f}", clock,
                           f"`{smi.get('driver_version', '-')}`", f"`{pk.get('torch')}`", f"`{v['torch']['cuda']}`",
                           f"`{pk.get('triton')}`"]]


def layer_rows(d: Path) -> tuple[list[Path], list[list[str]]]:
    docs = _load(d, LAYER_FILES)
    rows = [r for _, doc in docs for r in doc.get("rows", [])]
    rows.sort(key=lambda r: (r["dtype"] != "bfloat16", CONFIG_ORDER.get(r["config"], 9), r["pass"]))
    out = [[r["config"], r["dtype"], r["pass"], _num(r["ms_ours"], ".2f"), f"`{r['best_impl']}`",
            _num(r.get("ms_grouped_mm"), ".2f"), _num(r.get("ms_triton"), ".2f"), _num(r["ratio_dense"], ".2f"),
            _num(r["ratio_floor"], ".2f"), _num(r.get("ratio_peer_hf_grouped_mm"), ".2f"),
            _num(r.get("ratio_peer_hf_eager"), ".2f"), _num(r.get(f"mb_{r['best_impl']}"), ".0f")] for r in rows]
    return [p for p, doc in docs if doc.get("rows")], out


def train_rows(d: Path) -> tuple[list[Path], list[list[str]]]:
    docs = _load(d, ["train.json"])
    if not docs or not docs[0][1].get("rows"):
        return [], []
    doc = docs[0][1]
    vs = {(v["preset"], tuple(v["overrides"])): v["tokens_per_s_vs_dense"] for v in doc.get("vs_dense", [])}
    out = []
    for r in doc["rows"]:
        impl = next((o.split("=", 1)[1] for o in r["overrides"] if o.startswith("model.moe.impl=")), "auto")
        out.append([r["preset"], f"`{impl}`", _num(r["tokens_per_s"], ",.0f"), _num(r["ms_per_step"], ".1f"),
                    "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%",
                    _num(vs.get((r["preset"], tuple(r["overrides"]))), ".2f")])
    return [docs[0][0]], out


def tests_rows(d: Path) -> tuple[list[Path], list[list[str]]]:
    docs = _load(d, TEST_FILES)
    names = {"gpu_tests": "the sync-free ones", "gpu_tests_rest": "every other gpu test"}
    out = [[names[p.stem.split("-")[0]], str(doc["tests"]), str(doc["passed"]), str(doc["failed"]),
            str(doc["errors"]), str(doc["skipped"])] for p, doc in docs]
    return [p for p, _ in docs], out


def actmem_rows(d: Path) -> tuple[list[Path], list[list[str]]]:
    docs = _load(d, ["train.json"])
    rows = docs[0][1].get("activation_memory") if docs else None
    if not rows:
        return [], []
    out = [[r["preset"], r["dtype"], f"`{r['mode']}`", _num(r["held_mib"], ",.0f"), _num(r["held_vs_none"], ".2f"),
            _num(r["peak_mib"], ",.0f"), _num(r["ms"], ".2f"), _num(r["time_vs_none"], ".2f")] for r in rows]
    return [docs[0][0]], out


ROWS = {"machine": machine_rows, "layer": layer_rows, "train": train_rows, "tests": tests_rows,
        "actmem": actmem_rows}


def render(name: str, rows: list[list[str]] | None) -> list[str]:
    """The table's lines: header, separator, rows (or the one 'unmeasured' row)."""
    head = HEADERS[name]
    rows = rows or [[UNMEASURED] + ["-"] * (len(head) - 1)]
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


def fill(text: str, results: Path, root: Path = ROOT) -> tuple[str, list[str]]:
    """``text`` with every marked table whose files are in ``results`` rewritten; (new text, names filled)."""
    lines, out, filled, i = text.splitlines(), [], [], 0
    while i < len(lines):
        out.append(lines[i])
        m = MARKER.match(lines[i].strip())
        i += 1
        if not m or m.group(1) not in ROWS:
            continue
        j = i
        if j < len(lines) and SOURCE.match(lines[j].strip()):
            j += 1
        end = j
        while end < len(lines) and lines[end].strip().startswith("|"):
            end += 1
        paths, rows = ROWS[m.group(1)](results)
        if not rows:
            out += lines[i:end]
        else:
            rel = " ".join(str(p.resolve().relative_to(root.resolve())) for p in paths)
            out += [f"<!-- source: {rel} -->", *render(m.group(1), rows)]
            filled.append(m.group(1))
        i = end
    return "\n".join(out) + ("\n" if text.endswith("\n") else ""), filled


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", help="the folder of a lease's files, inside the repository")
    ap.add_argument("--doc", default=str(ROOT / "docs" / "PERFORMANCE.md"), help="the Markdown file to fill")
    ap.add_argument("--root", default=str(ROOT), help="the repository (source paths are relative to it)")
    ap.add_argument("--stdout", action="store_true", help="print the filled document instead of writing it")
    args = ap.parse_args(argv)
    results, doc = Path(args.results), Path(args.doc)
    if not results.is_dir():
        print(f"gpu_lease_tables: error: {results} is not a folder", file=sys.stderr)
        return 2
    try:
        results.resolve().relative_to(Path(args.root).resolve())
    except ValueError:
        print(f"gpu_lease_tables: error: {results} is outside the repository {args.root}", file=sys.stderr)
        return 2
    text, filled = fill(doc.read_text(encoding="utf-8"), results, Path(args.root))
    if args.stdout:
        print(text, end="")
    else:
        doc.write_text(text, encoding="utf-8")
    print(f"filled: {', '.join(filled) or 'nothing (no lease files found)'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
