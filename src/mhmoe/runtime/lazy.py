"""Names of a package loaded on first use (PEP 562): ``import mhmoe`` or ``import mhmoe.data.tokenizer`` stays
cheap, and a public name imports its defining module only when it is read."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, namespace: dict[str, Any], exports: Mapping[str, tuple[str, ...]]
) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """``__all__``, ``__getattr__`` and ``__dir__`` for ``package`` (its module globals ``namespace``) that load each
    name of ``exports`` (defining module -> names) from its module on first use and keep it in ``namespace``."""
    where = {name: module for module, names in exports.items() for name in names}

    def getattr_(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name]), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted({*namespace, *where})

    return sorted(where), getattr_, dir_
