"""Write requirements/lock.txt from the packages of a tested virtual environment (``make lock``).

Usage: python scripts/write_lock.py VENV_PYTHON OUT
Every installed distribution is pinned (``pip freeze --all``: pip and setuptools too, the package
itself left out), under a header that says what the file is and how it was made.
"""

from __future__ import annotations

import platform
import subprocess
import sys
from datetime import date
from pathlib import Path

HEADER = """\
# The tested dependency set: every package `make install` puts into .venv, transitive ones included.
# CPython {py} on {system} {machine} (what CI runs); torch is the CPU build (found on PyTorch's CPU
# index, https://download.pytorch.org/whl/cpu, or in a local find-links folder: `make install TORCH_INDEX=...`).
# Generated {day} by `make lock` from a fresh venv holding the newest versions pyproject.toml allows,
# after the test suite passed in it (`make test-latest`). Do not edit by hand.
"""


def main(python: str, out: str) -> None:
    freeze = subprocess.run([python, "-m", "pip", "freeze", "--all", "--exclude-editable"], check=True,
                            capture_output=True, text=True).stdout
    pins = sorted((line for line in freeze.splitlines() if "==" in line and not line.startswith("mhmoe==")),
                  key=str.lower)
    version = subprocess.run([python, "-c", "import platform; print(platform.python_version())"], check=True,
                             capture_output=True, text=True).stdout.strip()
    head = HEADER.format(py=version.rsplit(".", 1)[0], system=platform.system(), machine=platform.machine(),
                         day=date.today().isoformat())
    Path(out).write_text(head + "\n".join(pins) + "\n", encoding="utf-8")
    print(f"{out}: {len(pins)} pinned packages (CPython {version})")


if __name__ == "__main__":
    main(*sys.argv[1:3])
