"""Packaging: the dependency lock agrees with pyproject.toml's ranges, and the package installs offline
(``pip install --no-deps --no-build-isolation --no-index -e .``, the GPU-machine install) with an old
setuptools."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "lock.txt"
# the oldest setuptools README.md names: 64 (PEP 660 editable installs); on Python 3.12+ 66.1, the first whose
# pkg_resources imports there (64-66.0 use pkgutil.ImpImporter, removed in 3.12)
OLDEST_SETUPTOOLS = "66.1.0" if sys.version_info >= (3, 12) else "64.0.3"


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _locked() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    return pins


def test_lock_pins_every_requirement_inside_its_range():
    project = _pyproject()["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    pins = _locked()
    for req in reqs:
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is not in {LOCK.name}: run `make lock`"
        assert req.specifier.contains(pins[name], prereleases=True), f"{req.name}=={pins[name]} outside {req}"
    assert "torch" in pins and pins["torch"].endswith("+cpu"), "the lock pins the CPU build of torch"


def test_every_range_has_an_upper_bound():
    project = _pyproject()["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    for req in reqs:
        assert any(s.operator in ("<", "<=", "~=", "==") for s in req.specifier), f"{req} has no upper bound"


def _run(*cmd: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # only the throwaway venv's packages
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300, env=env)


def test_offline_editable_install_works_with_old_setuptools(tmp_path):
    """An environment with the oldest setuptools README.md names (and wheel, which setuptools < 70.1 needs for
    editable installs) installs the package offline without build isolation, as GPU images with an old
    setuptools do."""
    venv = tmp_path / "venv"
    made = _run(sys.executable, "-m", "venv", str(venv))
    assert made.returncode == 0, made.stderr
    py = str(venv / "bin" / "python")
    got = _run(py, "-m", "pip", "install", "-q", f"setuptools=={OLDEST_SETUPTOOLS}", "wheel")
    if got.returncode != 0:  # no index reachable and nothing cached: nothing to test against
        pytest.skip(f"cannot install setuptools=={OLDEST_SETUPTOOLS}: {got.stderr.strip().splitlines()[-1:]}")
    src = tmp_path / "src-copy"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    inst = _run(py, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-e", ".",
                cwd=src)
    assert inst.returncode == 0, inst.stdout[-2000:] + inst.stderr[-2000:]
    probe = ("import importlib.metadata as m, importlib.util as u, setuptools; "
             "print(setuptools.__version__, m.version('mhmoe'), m.metadata('mhmoe').get_all('License-File'), "
             "u.find_spec('mhmoe').origin)")
    out = _run(py, "-c", probe, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    version, _, rest = out.stdout.strip().partition(" ")
    assert version == OLDEST_SETUPTOOLS
    assert rest.startswith(_pyproject()["project"]["version"]) and "LICENSE" in rest
    assert rest.endswith(str(src / "src" / "mhmoe" / "__init__.py"))
