"""One home for the names inside run, checkpoint and saved directories: mhmoe.checkpoint.layout spells
every one of them, and no other module of src/ does (in code: docstrings, comments and help texts may
name files). A literal is a string constant equal to a name, a path component of one (``"a/config.yaml"``,
an f-string piece ``"/meta.json"``), a name compared with or joined to a path (``p / "tokenizer"``,
``p.name == "checkpoints"``), or a checkpoint prefix (``"step_"...``)."""

from __future__ import annotations

import ast
from pathlib import Path

from mhmoe.checkpoint import layout

SRC = Path(__file__).resolve().parents[2] / "src" / "mhmoe"
HOME = SRC / "checkpoint" / "layout.py"
NAMES = {v for k, v in vars(layout).items() if k.isupper() and isinstance(v, str)} - {layout.SAFETENSORS, layout.DCP}
# names that are also ordinary words: only a literal used as a path (joined with `/`, compared with a
# path's name, a path component of a longer literal) counts
WORDS = {n for n in NAMES if n.isalpha()}
# other directories with names of their own that happen to match
OTHER_LAYOUTS = {"data/bundle.py": "a data bundle (mhmoe.data.bundle: manifest.json, tokenizer/, token files)"}


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants of a module, its classes and functions."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _as_path(node: ast.AST, parents: dict[int, ast.AST]) -> bool:
    """A constant joined to a path with ``/`` or compared with something."""
    parent = parents.get(id(node))
    return (isinstance(parent, ast.BinOp) and isinstance(parent.op, ast.Div)) or isinstance(parent, ast.Compare)


def literals(source: str) -> list[tuple[int, str]]:
    """(line, text) of every layout name spelled in ``source``'s code."""
    tree = ast.parse(source)
    skip = _docstrings(tree)
    parents = {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    hits = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in skip:
            continue
        text = node.value
        if any(c.isspace() for c in text):  # prose: a message or a help text may name files
            continue
        parts = [p for p in text.split("/") if p]
        if text.startswith(layout.PREFIX):
            hits.append((node.lineno, text))
        elif text in NAMES - WORDS or (text in WORDS and _as_path(node, parents)):
            hits.append((node.lineno, text))
        elif len(parts) > 1 or text.startswith("/") or text.endswith("/"):
            if any(p in NAMES or p.startswith(layout.PREFIX) for p in parts):
                hits.append((node.lineno, text))
    return hits


def test_no_module_but_layout_spells_a_directory_name():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if path == HOME or str(path.relative_to(SRC)) in OTHER_LAYOUTS:
            continue
        found += [f"{path.relative_to(SRC)}:{line}: {text!r}" for line, text in literals(path.read_text())]
    assert not found, "names of run/checkpoint/saved directories outside mhmoe/checkpoint/layout.py (import them " \
                      "from there):\n" + "\n".join(found)


def test_the_finder_sees_every_form():
    code = '''"""Docstrings may say config.yaml and meta.json."""
import os
A = "config.yaml"
B = run / "tokenizer"
C = f"{run}/meta.json"
D = path.name == "checkpoints"
E = "step_" + str(3)
F = "RUN/checkpoints/step_00000600"
G = {"tokenizer": 1}  # a word, not a path
H = os.path.join(run, "model.safetensors")
'''
    got = sorted(literals(code))
    assert got == [(3, "config.yaml"), (4, "tokenizer"), (5, "/meta.json"), (6, "checkpoints"), (7, "step_"),
                   (8, "RUN/checkpoints/step_00000600"), (10, "model.safetensors")]


def test_names_are_the_released_format():
    """The names are the file format: directories written by earlier releases must keep loading."""
    assert (layout.CONFIG_FILE, layout.WEIGHTS_FILE, layout.TRAINER_STATE_FILE, layout.META_FILE, layout.TOKENIZER_DIR,
            layout.DCP_DIR, layout.CKPT_DIR, layout.PREFIX, layout.SAVED_CONFIG_FILE, layout.HF_TOKENIZER_DIR) == (
        "config.yaml", "model.safetensors", "trainer_state.pt", "meta.json", "tokenizer", "dcp", "checkpoints", "step_",
        "config.json", "mhmoe_tokenizer")
    assert layout.checkpoint_path("RUN", 600) == Path("RUN/checkpoints/step_00000600")
    assert layout.step_of("step_00000600") == 600 and layout.step_of("step_x") is None
    assert layout.run_directory(Path("RUN/checkpoints/step_00000600")) == Path("RUN")
