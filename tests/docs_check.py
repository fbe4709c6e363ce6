"""The machinery of ``tests/test_docs.py``: reading Markdown code blocks with their test markers, tables
with their source comments, and matching the numbers of a table against its source file.

Conventions (the authoritative description is the docstring of tests/test_docs.py and the "Docs"
paragraph of docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

SHELL_LANGS = {"bash", "sh", "shell"}
PYTHON_LANGS = {"python", "py"}
MARKER = re.compile(r"^<!--\s*test:\s*(.*?)\s*-->$")
SOURCE = re.compile(r"^<!--\s*source:\s*(.*?)\s*-->$")
FENCE = re.compile(r"^(```|~~~)\s*([\w+-]*)")
KINDS = ("run", "slow", "skip", "synopsis")


@dataclass
class Block:
    """A fenced code block: its language, text, first line number (1-based) and test marker."""

    path: Path
    line: int
    lang: str
    text: str
    kind: str | None = None  # run | slow | skip | synopsis | None (no marker)
    reason: str = ""  # skip: why
    shrink: dict[str, str] = field(default_factory=dict)  # subcommand -> flags appended to it

    @property
    def where(self) -> str:
        return f"{self.path.name}:{self.line}"


def parse_marker(text: str) -> tuple[str, str, dict[str, str]]:
    """``run | train: --max-steps 2 | eval: --batches 1`` -> ("run", "", {"train": "--max-steps 2", ...});
    ``skip: needs a GPU`` -> ("skip", "needs a GPU", {})."""
    head, *parts = [p.strip() for p in text.split("|")]
    kind, _, reason = head.partition(":")
    kind = kind.strip()
    if kind not in KINDS:
        raise ValueError(f"unknown test marker {kind!r} (one of {', '.join(KINDS)})")
    shrink = {}
    for part in parts:
        sub, sep, flags = part.partition(":")
        if not sep or not sub.strip() or not flags.strip():
            raise ValueError(f"shrink part {part!r}: expected 'SUBCOMMAND: FLAGS'")
        shrink[sub.strip()] = flags.strip()
    return kind, reason.strip(), shrink


def code_blocks(path: Path) -> list[Block]:
    """Every fenced block of ``path`` with the marker on the nearest non-blank line above it (if any)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i].strip())
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(1), m.group(2).lower(), i
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        block = Block(path, start + 1, lang, "\n".join(lines[start + 1:j]))
        k = start - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker = MARKER.match(lines[k].strip()) if k >= 0 else None
        if marker:
            block.kind, block.reason, block.shrink = parse_marker(marker.group(1))
        blocks.append(block)
        i = j + 1
    return blocks


# ---- shell commands ------------------------------------------------------------------------------------------
MHMOE_CMD = re.compile(r"(?:^|\s)(?:-m\s+mhmoe|mhmoe)\s+([a-z][a-z-]*)")


def logical_lines(script: str) -> list[str]:
    """Join backslash continuations; drop blank and comment-only lines."""
    out, cur = [], ""
    for raw in script.splitlines():
        line = raw.rstrip()
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        cur += line
        if cur.strip() and not cur.strip().startswith("#"):
            out.append(cur)
        cur = ""
    return out


def command_end(line: str) -> int:
    """Index where the first command of ``line`` ends: an unquoted ``#``, ``|``, ``>``, ``<``, ``;`` or ``&``."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c in "#|><;&" and (c != "#" or i == 0 or line[i - 1].isspace()):
            return i
    return len(line)


def shrink_script(block: Block) -> str:
    """The block's script with each ``mhmoe SUBCOMMAND ...`` command extended by the marker's flags for it."""
    out = []
    for line in logical_lines(block.text):
        m = MHMOE_CMD.search(line)
        if m and m.group(1) in block.shrink:
            end = command_end(line)
            line = f"{line[:end].rstrip()} {block.shrink[m.group(1)]} {line[end:]}".rstrip()
        out.append(line)
    return "\n".join(out) + "\n"


def synopsis_problems(block: Block, parser) -> list[str]:
    """For a synopsis block: every ``mhmoe SUBCOMMAND`` exists and every ``--option`` on its line is one of
    that subcommand's options."""
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    problems = []
    for line in logical_lines(block.text):
        m = MHMOE_CMD.search(line)
        if not m:
            continue
        sub = m.group(1)
        if sub not in subparsers:
            problems.append(f"{block.where}: unknown subcommand {sub!r}: {line.strip()}")
            continue
        known = {s for a in subparsers[sub]._actions for s in a.option_strings}
        code = line[m.end():command_end(line)]
        for opt in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", code):
            if opt not in known:
                problems.append(f"{block.where}: `mhmoe {sub}` has no option {opt}: {line.strip()}")
    return problems


# ---- tables and their numbers --------------------------------------------------------------------------------
@dataclass
class Table:
    path: Path
    line: int  # header line, 1-based
    header: list[str]
    rows: list[list[str]]  # data rows (header and separator excluded), cells stripped
    source: list[str] | None  # paths named by the <!-- source: ... --> comment above, or None

    @property
    def where(self) -> str:
        return f"{self.path.name}:{self.line}"


def split_row(line: str) -> list[str]:
    body = line.strip()
    body = body[1:] if body.startswith("|") else body
    body = body[:-1] if body.endswith("|") else body
    cells, cur, code = [], "", False
    for i, c in enumerate(body):
        if c == "`":
            code = not code
        if c == "|" and not code and (i == 0 or body[i - 1] != "\\"):
            cells.append(cur.strip())
            cur = ""
        else:
            cur += c
    return cells + [cur.strip()]


def tables(path: Path) -> list[Table]:
    """Markdown pipe tables outside code blocks, with the source comment of the line above (if any)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out, i, in_code = [], 0, False
    while i < len(lines):
        s = lines[i].strip()
        if FENCE.match(s):
            in_code = not in_code
        is_header = (not in_code and s.startswith("|") and i + 1 < len(lines)
                     and re.fullmatch(r"\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?", lines[i + 1].strip()))
        if not is_header:
            i += 1
            continue
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        src = SOURCE.match(lines[k].strip()) if k >= 0 else None
        j = i + 2
        while j < len(lines) and lines[j].strip().startswith("|"):
            j += 1
        out.append(Table(path, i + 1, split_row(lines[i]), [split_row(r) for r in lines[i + 2:j]],
                         src.group(1).split() if src else None))
        i = j
    return out


# a number written in plain text: 1,234 / 3.34 / -0.5 / 12.5% / 3.34M / 1.41x; not part of a word, a version,
# a range's upper end or a reference (Eq.3, Table 3, §3.2, Fig. 4, App. D)
NUMBER = re.compile(r"(?<![\w.§\-−+^])([-−+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)([%x×MkKGB]?)(?![\w.]|\d)")
REFERENCE = re.compile(r"(?:§|\bEq\.\s?|\bEqs?\.\s?|\bTables?\s|\bFig(?:ure|\.)?\s?|\bApp(?:endix|\.)?\s[A-Z]?\s?"
                       r"|\bSection\s)$")
REFERENCE_WORDS = re.compile(r"§\S*|\bEqs?\.\S*|\bTables?\b|\bFig(?:ure|\.)?|\bApp(?:endix|\.)?|\bSection\b")
SCALE = {"M": 1e6, "k": 1e3, "K": 1e3, "G": 1e9, "B": 1e9}


def strip_code(cell: str) -> str:
    return re.sub(r"`[^`]*`", " ", cell)


@dataclass(frozen=True)
class DocNumber:
    text: str
    value: float
    decimals: int
    suffix: str
    column: str = ""  # the table column's header


def numbers_in(cell: str) -> list[DocNumber]:
    """The plain-text numbers of a table cell (code spans and references excluded)."""
    text, out = strip_code(cell), []
    for m in NUMBER.finditer(text):
        if REFERENCE.search(text[:m.start()]):
            continue
        raw = m.group(1).replace(",", "").replace("−", "-")
        decimals = len(raw.split(".", 1)[1]) if "." in raw else 0
        out.append(DocNumber(m.group(0), float(raw), decimals, m.group(2)))
    return out


def is_numeric(cell: str) -> bool:
    """A cell that states numbers rather than text: digits are at least half of its letters and digits
    (``3.34M``, ``41.5 ± 2.5``, ``1,100 (984/55/61)``, ``2304 = 3d``; not ``one line on rank 0``).
    Code spans and references are left out first."""
    text = strip_code(cell)
    for m in reversed(list(NUMBER.finditer(text))):
        if REFERENCE.search(text[:m.start()]):
            text = text[:m.start()] + text[m.end():]
    text = REFERENCE_WORDS.sub(" ", text)
    alnum = [c for c in text if c.isalnum()]
    return bool(alnum) and sum(c.isdigit() for c in alnum) * 2 >= len(alnum)


def table_numbers(table: Table) -> list[DocNumber]:
    """Numbers of the numeric cells (:func:`is_numeric`) of every column but the first (the row label)."""
    out = []
    for row in table.rows:
        for col, cell in enumerate(row[1:], start=1):
            header = table.header[col] if col < len(table.header) else ""
            if is_numeric(cell):
                out += [DocNumber(n.text, n.value, n.decimals, n.suffix, header) for n in numbers_in(cell)]
    return out


def source_values(path: Path) -> list[float]:
    """Every number in a JSON file (any depth; numeric strings too) or a CSV file (every cell)."""
    if path.suffix not in (".json", ".csv"):
        raise ValueError(f"{path}: a source must be a .json or .csv file")
    text = path.read_text(encoding="utf-8")
    values: list[float] = []

    def add(x) -> None:
        if isinstance(x, bool):
            return
        if isinstance(x, (int, float)):
            values.append(float(x))
        elif isinstance(x, str):
            try:
                values.append(float(x.replace(",", "")))
            except ValueError:
                pass
        elif isinstance(x, dict):
            for v in x.values():
                add(v)
        elif isinstance(x, list):
            for v in x:
                add(v)

    if path.suffix == ".json":
        add(json.loads(text))
    else:
        for row in csv.reader(io.StringIO(text)):
            for cell in row:
                add(cell)
    return [v for v in values if math.isfinite(v)]


def matches(n: DocNumber, values: list[float]) -> bool:
    """True if some source value, written with the doc's decimals (and its suffix's scale, or as a
    percentage: x100, or in a column headed "ms": seconds x1000), gives the doc's number."""
    tol = 0.5 * 10 ** -n.decimals * (1 + 1e-9) + 1e-12
    scales = [1.0, 100.0] + ([1 / SCALE[n.suffix]] if n.suffix in SCALE else [])
    scales += [1000.0] if "ms" in re.split(r"\W+", n.column) else []
    return any(abs(v * s - n.value) <= tol for v in values for s in scales)
