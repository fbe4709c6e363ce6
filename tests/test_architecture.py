"""The package layout: every folder is one layer, dependencies point one way, no import circles.

Layers, bottom up (docs/ARCHITECTURE.md): errors/runtime -> config -> checkpoint -> quant -> moe -> model, data ->
loading -> train -> parallel -> research, integrations -> cli. A module may import its own package and lower
layers only; siblings of one layer (model/data, research/integrations) do not import each other.
Function-level (lazy) and relative imports count exactly like module-level absolute ones.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "mhmoe"
DOC = SRC.parent / "docs" / "ARCHITECTURE.md"
LAYERS = [
    ("errors",), ("runtime",), ("config",), ("checkpoint",), ("quant",), ("moe",), ("model", "data"), ("loading",),
    ("train",), ("parallel",), ("research", "integrations"), ("cli",),
]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}
# the public API and `python -m mhmoe` may import anything
TOP = {"mhmoe", "mhmoe.__main__"}
OPTIONAL = {"mhmoe.integrations.hf": "transformers", "mhmoe.integrations.lmeval": "lm_eval"}


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _package(module: str, path: Path) -> str:
    """The package a relative import of ``module`` (file ``path``) is resolved against."""
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def imported_modules(path: Path, module: str | None = None) -> set[str]:
    """Every mhmoe module ``path`` (module ``module``, default: from its place under src/) imports, at any
    depth, absolute or relative (``from . import x``, ``from ..y import z``, resolved against the module's
    package); ``from a.b import c`` is ``a.b.c`` when that is a module, else ``a.b``."""
    module = module or module_name(path)
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "mhmoe"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = _package(module, path).split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base.split(".")[0] != "mhmoe":
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in MODULES else base)
    return out


GRAPH = {m: imported_modules(p) - {m} for m, p in MODULES.items()}


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_module_is_in_a_layer():
    unknown = sorted(m for m in MODULES if m not in TOP and layer(m) not in RANK)
    assert not unknown, f"modules outside the layer map (add them to LAYERS and docs/ARCHITECTURE.md): {unknown}"


def test_dependencies_point_down():
    bad = []
    for mod, targets in GRAPH.items():
        if mod in TOP:
            continue
        for t in targets:
            if t == "mhmoe":
                bad.append(f"{mod} -> mhmoe (the public API is for users; import the defining module)")
            elif layer(t) != layer(mod) and RANK[layer(t)] >= RANK[layer(mod)]:
                bad.append(f"{mod} ({layer(mod)}) -> {t} ({layer(t)})")
    assert not bad, "imports against the layering:\n" + "\n".join(sorted(bad))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    assert _cycles(GRAPH) == []


def test_cycle_finder_finds_a_planted_circle():
    planted = {**GRAPH, "mhmoe.moe.routers": GRAPH["mhmoe.moe.routers"] | {"mhmoe.moe.layers"}}
    assert any("mhmoe.moe.routers" in c and "mhmoe.moe.layers" in c for c in _cycles(planted))


def test_layering_check_sees_lazy_imports(tmp_path):
    lazy = tmp_path / "m.py"
    lazy.write_text("def f():\n    from mhmoe.train.loop import train\n    return train\n")
    assert "mhmoe.train.loop" in imported_modules(lazy, "mhmoe.model.m")


def test_layering_check_resolves_relative_imports(tmp_path):
    """``from . import x`` / ``from .x import y`` / ``from .. import z``, lazy or not, resolved against the
    importing module's package (a package's ``__init__`` is its own package)."""
    mod = tmp_path / "ops.py"
    mod.write_text("from .tiles import padded\nfrom .. import common\n\n\ndef f():\n    from . import custom_ops\n"
                   "    from ...experts import GroupedExperts\n    return custom_ops, GroupedExperts\n")
    got = imported_modules(mod, "mhmoe.moe.dispatch.triton.ops")
    assert got == {"mhmoe.moe.dispatch.triton.tiles", "mhmoe.moe.dispatch.common",
                   "mhmoe.moe.dispatch.triton.custom_ops", "mhmoe.moe.experts"}
    init = tmp_path / "__init__.py"
    init.write_text("from .ops import x\n")
    assert imported_modules(init, "mhmoe.moe.dispatch.triton") == {"mhmoe.moe.dispatch.triton.ops"}


def test_cycle_finder_finds_a_lazy_relative_circle(tmp_path):
    """A lazy relative import back into a module that imports it is a circle (the shape
    ``ops.py: def f(): from . import custom_ops`` + ``custom_ops.py: from .ops import ...`` had)."""
    ops, custom = tmp_path / "ops.py", tmp_path / "custom_ops.py"
    ops.write_text("def f():\n    from . import custom_ops\n    return custom_ops\n")
    custom.write_text("from .ops import f\n")
    pkg = "mhmoe.moe.dispatch.triton"
    planted = {**GRAPH, f"{pkg}.ops": imported_modules(ops, f"{pkg}.ops"),
               f"{pkg}.custom_ops": imported_modules(custom, f"{pkg}.custom_ops")}
    assert [f"{pkg}.custom_ops", f"{pkg}.ops"] in _cycles(planted)


def _doc_rows() -> dict[str, str]:
    """The rows of ARCHITECTURE.md's layout table by folder (``runtime``, ``errors``, ...)."""
    rows = {}
    for line in DOC.read_text(encoding="utf-8").splitlines():
        m = re.match(r"\| \d+ \| `([^`]+)` \|", line)
        if m:
            rows[m.group(1).rstrip("/").removesuffix(".py")] = line
    return rows


def test_the_architecture_doc_names_every_module():
    """Each module is named in its layer's row of the layout table (``name.py`` or ``sub/name.py``; a
    package by its folder), the top-level ones in the text; and every ``*.py`` a row names exists."""
    doc, rows = DOC.read_text(encoding="utf-8"), _doc_rows()
    missing, stale = [], []
    for path in MODULES.values():
        rel = path.relative_to(PKG)
        if len(rel.parts) == 1:
            if f"`{rel.name}`" not in doc and f"`mhmoe/{rel.name}`" not in doc:
                missing.append(str(rel))
        elif rel.name != "__init__.py":
            named = re.findall(r"`([^`\s]+\.py)`", rows.get(rel.parts[0], ""))
            if rel.name not in named and "/".join(rel.parts[1:]) not in named:
                missing.append(str(rel))
    for folder, row in rows.items():
        for name in re.findall(r"`([^`\s]+\.py)`", row):
            if folder != name.removesuffix(".py") and not [p for p in (PKG / folder).rglob(Path(name).name)
                                                           if p.as_posix().endswith(name)]:
                stale.append(f"{folder}/: {name}")
    assert not missing, f"modules docs/ARCHITECTURE.md does not name (add them to their layer's row): {missing}"
    assert not stale, f"docs/ARCHITECTURE.md names modules that do not exist: {stale}"


def _defined_names(path: Path) -> set[str]:
    """Top-level functions, classes and assigned names of a module."""
    out: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Assign):
            out |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return out


def test_nothing_outside_train_imports_train_to_get_a_model():
    """Loading a trained model is the loading layer's: no module outside train/ takes one of its names
    (or a resume's loader) from train/."""
    loaders = set().union(*(_defined_names(p) for m, p in MODULES.items() if layer(m) == "loading"))
    loaders |= {"load_for_resume", "load_latest_for_resume"}
    bad = []
    for mod, path in MODULES.items():
        if layer(mod) == "train":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("mhmoe.train"):
                got = sorted({a.name for a in node.names} & loaders)
                if got:
                    bad.append(f"{mod}: from {node.module} import {', '.join(got)}")
    assert not bad, "models are loaded through mhmoe.loading, not the training layer:\n" + "\n".join(bad)


def test_every_module_imports_in_a_fresh_interpreter():
    """Import every module in one fresh interpreter (order-independent because the graph is acyclic)."""
    skip = {m for m in MODULES for pkg, dep in OPTIONAL.items()
            if m.startswith(pkg) and importlib.util.find_spec(dep) is None}
    mods = [m for m in sorted(MODULES) if m not in skip and m != "mhmoe.__main__"]
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    res = subprocess.run([sys.executable, "-c", code, *mods], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]


@pytest.mark.parametrize("package", ["mhmoe.config", "mhmoe.moe", "mhmoe.model", "mhmoe.train"])
def test_lower_layers_import_without_the_upper_ones(package):
    """Importing a layer loads nothing from the layers above it."""
    code = (f"import sys, importlib\nimportlib.import_module({package!r})\n"
            "print('\\n'.join(m for m in sys.modules if m.startswith('mhmoe.')))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    loaded = {layer(m) for m in res.stdout.split()}
    above = {lay for lay in loaded if RANK[lay] > RANK[layer(package)]}
    assert not above, f"importing {package} loaded {sorted(above)}"


def test_config_layer_is_pure_python():
    """Configs, the planner and the presets load without torch (e.g. for tooling and quick planning)."""
    code = "import sys, mhmoe.config, mhmoe\nmhmoe.plan\nprint('torch' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "False", res.stderr[-2000:]


def test_public_api_names_resolve():
    import mhmoe

    missing = [n for n in mhmoe.__all__ if getattr(mhmoe, n, None) is None]
    assert not missing and "LM" in dir(mhmoe)
