"""The model code an exported directory carries for ``trust_remote_code`` (``mhmoe export --hf``).

``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`` must work where mhmoe is not
installed, so the export writes the modules the model needs next to its weights -- generated from
this package's own source at export time, never a hand-kept copy:

- the import closure of :mod:`~mhmoe.integrations.hf.modeling_mhmoe` and
  :mod:`~mhmoe.integrations.hf.configuration_mhmoe`, following the imports a module runs when it is
  imported (module and class level, not ``if TYPE_CHECKING:``); imports inside functions are lazy and
  are not followed;
- each module becomes one flat file (transformers copies a custom model's directory flat, following
  ``from .name import ...`` lines): ``mhmoe/model/lm.py`` -> ``mhmoe_model_lm.py``, the two entry
  modules keep their Hugging Face names; each ``mhmoe`` import is rewritten to the relative form,
  everything else in the file is our source byte for byte;
- a lazy import of a module outside the closure (e.g. the Triton kernels, or reading a training run
  directory) becomes ``raise ImportError(...)``: that feature needs ``pip install mhmoe``;
- third-party imports must be ones transformers itself depends on (torch, yaml, safetensors, ...), so
  the directory loads in any environment that can run transformers;
- ``modeling_mhmoe.py`` ends with one relative import of every other file (:func:`_manifest`): older
  transformers copy only the files an ``auto_map`` module imports directly.

:data:`AUTO_MAP` goes into ``config.json``. Loading without ``trust_remote_code`` in an environment
without mhmoe is refused by transformers with a message naming the flag; with mhmoe installed,
``import mhmoe.integrations.hf`` registers the classes and no flag is needed.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

#: entry modules -> the file names transformers' ``auto_map`` refers to
ENTRY_MODULES = {
    "mhmoe.integrations.hf.configuration_mhmoe": "configuration_mhmoe",
    "mhmoe.integrations.hf.modeling_mhmoe": "modeling_mhmoe",
}
#: both classes from one module: transformers caches each auto_map module under a hash of the files it
#: imports, so a config loaded from configuration_mhmoe would come from a second copy of the config
#: modules, and the model would not recognise its classes
AUTO_MAP = {
    "AutoConfig": "modeling_mhmoe.MHMoEConfig",
    "AutoModelForCausalLM": "modeling_mhmoe.MHMoEForCausalLM",
}
#: top-level packages bundled code may import: the standard library, torch, and transformers' own
#: dependencies (installed wherever transformers is)
ALLOWED_THIRD_PARTY = frozenset({"torch", "transformers", "numpy", "yaml", "safetensors", "packaging",
                                 "huggingface_hub", "tokenizers", "tqdm", "filelock", "regex"})


class BundleError(RuntimeError):
    """The model code cannot be bundled (an import form or a dependency a flat bundle cannot carry)."""


@dataclass(frozen=True)
class _Import:
    node: ast.Import | ast.ImportFrom
    target: str  # absolute module name (the submodule itself for `from package import submodule`)
    eager: bool  # runs when the module is imported (module or class level)
    submodule: bool = False  # `from package import submodule`


def flat_name(module: str) -> str:
    """The bundle file stem of ``module`` (``mhmoe.model.lm`` -> ``mhmoe_model_lm``)."""
    return ENTRY_MODULES.get(module) or module.replace(".", "_")


def _source(module: str) -> tuple[str, bool]:
    """(source text, is a package) of an installed mhmoe module."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        raise BundleError(f"{module}: no Python source to bundle")
    return Path(spec.origin).read_text(encoding="utf-8"), spec.submodule_search_locations is not None


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module an ``ImportFrom`` in ``module`` names (resolving ``from . import x``)."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and isinstance(test, (ast.Name, ast.Attribute)) and \
        (getattr(test, "id", None) or getattr(test, "attr", None)) == "TYPE_CHECKING"


def _imports(tree: ast.Module, module: str, is_package: bool) -> list[_Import]:
    """Every mhmoe import in ``tree``; eager = executed at import time (outside functions and
    ``if TYPE_CHECKING:``)."""
    found: list[_Import] = []

    def visit(node: ast.AST, eager: bool) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) or _is_type_checking(node):
            eager = False
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "mhmoe":
                    raise BundleError(f"{module}: `import {alias.name}` cannot be bundled; use `from ... import`")
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(node, module, is_package)
            if target.split(".")[0] == "mhmoe":
                submodules = [f"{target}.{a.name}" for a in node.names if _is_module(f"{target}.{a.name}")]
                if submodules and len(node.names) > 1:
                    raise BundleError(f"{module}: import submodules of {target} one per line")
                found.append(_Import(node, submodules[0] if submodules else target, eager, bool(submodules)))
        for child in ast.iter_child_nodes(node):
            visit(child, eager)

    visit(tree, True)
    return found


def _third_party(tree: ast.Module) -> set[str]:
    """Top-level packages imported outside ``try`` blocks (what transformers checks before loading)."""
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Try):
            return
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {n for n in names if n not in sys.stdlib_module_names and n not in ("mhmoe", "__future__")}


def _rewrite(source: str, imports: list[_Import], bundled: set[str]) -> str:
    """``source`` with each mhmoe import replaced by its relative, flat form (or by a raise)."""
    lines = source.splitlines(keepends=True)
    for imp in sorted(imports, key=lambda i: i.node.lineno, reverse=True):
        node = imp.node
        first, last = node.lineno - 1, node.end_lineno - 1  # type: ignore[operator]
        indent = lines[first][: node.col_offset]
        names = ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in node.names)
        if imp.target in bundled and imp.submodule:  # transformers only copies files named as `from .x import`
            raise BundleError(f"`from ... import {node.names[0].name}` (a module) cannot be bundled; import from it")
        if imp.target in bundled:
            new = f"from .{flat_name(imp.target)} import {names}"
        else:
            new = (f"raise ImportError({imp.target!r} + ' is not part of the exported model code; '"
                   f" 'pip install mhmoe for it')")
        tail = lines[last][node.end_col_offset:]  # type: ignore[index]
        lines[first: last + 1] = [indent + new + tail]
    return "".join(lines)


def bundle_sources() -> dict[str, str]:
    """File name -> Python source of every file the exported directory needs for ``trust_remote_code``."""
    parsed: dict[str, tuple[str, ast.Module, list[_Import]]] = {}
    queue = list(ENTRY_MODULES)
    while queue:
        module = queue.pop()
        if module in parsed:
            continue
        if module == "mhmoe":
            raise BundleError("the model code imports the top-level mhmoe package; import from its modules")
        source, is_package = _source(module)
        tree = ast.parse(source)
        imports = _imports(tree, module, is_package)
        parsed[module] = (source, tree, imports)
        queue += [i.target for i in imports if i.eager]
    bundled = set(parsed)
    files = {}
    for module, (source, tree, imports) in sorted(parsed.items()):
        extra = _third_party(tree) - ALLOWED_THIRD_PARTY
        if extra:
            raise BundleError(f"{module} imports {sorted(extra)}, which transformers does not install")
        files[f"{flat_name(module)}.py"] = _rewrite(source, imports, bundled)
    files["modeling_mhmoe.py"] += _manifest(sorted(bundled - {"mhmoe.integrations.hf.modeling_mhmoe"}))
    return files


def _manifest(modules: list[str]) -> str:
    """One direct relative import per bundled file, appended to ``modeling_mhmoe.py``: transformers
    4.46 and 4.48 (checked; 5.24 follows imports recursively) copy only the files an ``auto_map`` module
    imports itself, not what those import."""
    lines = ["", "", "# every file of this bundle, imported directly: older transformers copy only these"]
    lines += [f"from .{flat_name(m)} import __name__ as _bundled  # noqa: E402" for m in modules]
    return "\n".join(lines + ["del _bundled", ""])


def write_bundle(directory: str | Path) -> list[str]:
    """Write :func:`bundle_sources` into ``directory`` (an export being assembled); the file names."""
    files = bundle_sources()
    for name, text in files.items():
        (Path(directory) / name).write_text(text, encoding="utf-8")
    return sorted(files)
