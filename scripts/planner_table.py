#!/usr/bin/env python
"""The planner outputs quoted in docs/PLANNER.md, as JSON (docs/results/planner.json): every configuration is
an `mhmoe plan` command and its `--json` output. The planner is exact arithmetic, so tests/test_docs.py
regenerates this and compares it with the file.

    python scripts/planner_table.py --json docs/results/planner.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from mhmoe.cli import build_parser

COMMANDS = {
    "v2 worked example: ReLU, F=4d, top-1, h=3": "mhmoe plan --ffn relu --d-ff 3072 --heads 3 --mh-top-k 1",
    "v2 experiments: SwiGLU 8x2048 top-1 -> h=2": "mhmoe plan --heads 2",
    "-> h=3": "mhmoe plan --heads 3",
    "-> fine-grained SMoE": "mhmoe plan --heads 1 --no-head --no-merge --mh-top-k 2",
    "the paper's h=2 choice, 40 experts": "mhmoe plan --heads 2 --mh-experts 40",
    "the paper's h=3 choice, 96 experts": "mhmoe plan --heads 3 --mh-experts 96",
    "ICML setting (parameter parity only), h=4, E=16":
        "mhmoe plan --ffn relu --d-ff 3072 --experts 16 --heads 4 --parity params",
    "h=3 with a shared expert (2048)": "mhmoe plan --heads 3 --shared 1",
    "h=3, exact counts with the router": "mhmoe plan --heads 3 --match exact --include-router",
}


def plan_of(command: str) -> dict:
    """The Plan.to_dict() that `command --json` prints."""
    from mhmoe.cli.plan import plan_from_args

    return plan_from_args(build_parser().parse_args(shlex.split(command)[1:])).to_dict()


def table() -> dict:
    return {"configurations": [{"name": name, "command": cmd, "plan": plan_of(cmd)} for name, cmd in COMMANDS.items()]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="planner outputs for docs/PLANNER.md")
    ap.add_argument("--json", metavar="PATH", help="write here (default: stdout)")
    args = ap.parse_args(argv)
    text = json.dumps(table(), indent=1) + "\n"
    if args.json:
        Path(args.json).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
