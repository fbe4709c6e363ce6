"""The type check (``make lint`` runs it too): mypy over src/mhmoe with the settings in pyproject.toml,
the layers below train/ with every function annotated. A cold run (a new clone, CI) takes ~40 s of one
CPU and ~1.6 GB; later runs reuse ``.mypy_cache`` (a few seconds)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_finds_no_type_errors():
    pytest.importorskip("mypy")
    res = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "Success: no issues found" in res.stdout
