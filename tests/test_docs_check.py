"""The docs checker itself (tests/docs_check.py): it must find what it is there to find."""

from __future__ import annotations

import json

import pytest
from docs_check import (
    Block,
    code_blocks,
    is_numeric,
    matches,
    numbers_in,
    parse_marker,
    shrink_script,
    source_values,
    synopsis_problems,
    table_numbers,
    tables,
)

from mhmoe.cli import build_parser

DOC = """# t

<!-- test: run | train: --max-steps 2 | eval: --batches 1 -->
```bash
mhmoe train --preset tiny-mh3 --out runs/a   # comment
mhmoe eval --checkpoint runs/a | tee log.txt
mhmoe generate --checkpoint runs/a --prompt "x | y"
```

```python
print(1)
```

<!-- source: results.json -->
| model | params | ppl | note |
|---|---|---|---|
| tiny-mh3 | 3.34M | 107.35 | trained on rank 0 |
| tiny-smoe | 7.48M | 41.5 ± 2.5 | Eq.3 |

| name | value |
|---|---|
| a | 1,234 |
"""


@pytest.fixture
def doc(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps({"rows": [
        {"params": 3344064, "ppl": 107.3498, "acc": 0.415, "se": 0.0247}, {"params": 7475904}]}))
    path = tmp_path / "DOC.md"
    path.write_text(DOC)
    return path


def test_markers_are_read_from_the_line_above_the_fence(doc):
    blocks = code_blocks(doc)
    assert [(b.lang, b.kind) for b in blocks] == [("bash", "run"), ("python", None)]
    assert blocks[0].shrink == {"train": "--max-steps 2", "eval": "--batches 1"}
    assert parse_marker("skip: needs a GPU") == ("skip", "needs a GPU", {})
    with pytest.raises(ValueError):
        parse_marker("runn")
    with pytest.raises(ValueError):
        parse_marker("run | train --max-steps 2")  # no colon


def test_shrink_flags_go_before_comments_pipes_and_only_to_their_subcommand(doc):
    lines = shrink_script(code_blocks(doc)[0]).splitlines()
    assert lines[0] == "mhmoe train --preset tiny-mh3 --out runs/a --max-steps 2 # comment"
    assert lines[1] == "mhmoe eval --checkpoint runs/a --batches 1 | tee log.txt"
    assert lines[2] == 'mhmoe generate --checkpoint runs/a --prompt "x | y"'  # quoted pipe, no shrink part


def test_synopsis_check_finds_unknown_options_and_subcommands(tmp_path):
    block = Block(tmp_path / "X.md", 1, "bash", "mhmoe train --out R [--lr X] [--learning-rate X]\n"
                  "mhmoe trian --out R\nmhmoe plot RUN --out a.png  # --not-checked-in-comments\n")
    problems = synopsis_problems(block, build_parser())
    assert len(problems) == 2 and "--learning-rate" in problems[0] and "'trian'" in problems[1]


def test_tables_numbers_and_sources(doc):
    found = tables(doc)
    assert [t.source for t in found] == [["results.json"], None]
    assert [n.text for n in table_numbers(found[0])] == ["3.34M", "107.35", "7.48M", "41.5", "2.5"]
    values = source_values(doc.parent / "results.json")
    assert all(matches(n, values) for n in table_numbers(found[0]))
    assert [n.text for n in table_numbers(found[1])] == ["1,234"]  # a table of numbers without a source


@pytest.mark.parametrize("text, ok", [("107.35", True), ("107.34", False), ("107.3", True), ("3.34M", True),
                                      ("3.35M", False), ("41.5", True), ("41.5%", True), ("43", False),
                                      ("3,344,064", True), ("3,344,065", False)])
def test_a_number_matches_only_as_written(text, ok):
    values = [3344064.0, 107.3498, 0.415]
    (n,) = numbers_in(text)
    assert matches(n, values) is ok


def test_numeric_cells_and_what_is_not_a_number():
    assert is_numeric("1,100 (984/55/61)") and is_numeric("14 min 16 s") and is_numeric("0.99913")
    assert not is_numeric("one-line warnings on rank 0") and not is_numeric("§3.2, Table 3")
    assert [n.text for n in numbers_in("tiny-mh3 `8192` Eq.6-10 0.1-0.26 h=3 1.41x")] == ["0.1", "3", "1.41x"]


def test_csv_sources_are_read_cell_by_cell(tmp_path):
    path = tmp_path / "r.csv"
    path.write_text("label,ppl\nSMoE,103.7201\n")
    assert source_values(path) == [103.7201]
    with pytest.raises(ValueError):
        source_values(tmp_path / "r.txt")
