"""Where and how a result was produced, so that it can be re-examined: the machine (CPU model and ISA
flags, GPU name), threads, library versions, the git commit of the code and the exact command line.
Written into every suite's ``results.json`` / ``summary.json`` and every run record
(:mod:`mhmoe.research.store`)."""

from __future__ import annotations

import importlib.metadata
import platform
import shlex
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

#: the instruction-set flags of /proc/cpuinfo that matter for training speed (others are left out)
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile",
             "amx_bf16", "amx_int8", "asimd", "sve", "bf16")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit(where: Path | None = None) -> dict[str, Any] | None:
    """``{"commit", "dirty"}`` of the git checkout holding this package's source (None outside a checkout,
    without git, or on any error)."""
    where = where or Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10,
                              check=False)
        if head.returncode != 0:
            return None
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where,
                                capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip()) if status.returncode == 0 else None}


def machine(devices: list[str] | tuple[str, ...] = ("cpu",)) -> dict[str, Any]:
    """CPU model, its ISA flags (of :data:`ISA_FLAGS`), core count, platform, and the GPU name when a
    device is CUDA and one is visible."""
    import os

    from mhmoe.runtime.cpu import cpu_info

    model, flags = cpu_info()
    info: dict[str, Any] = {"cpu": model, "isa": [f for f in ISA_FLAGS if f in flags], "cpus": os.cpu_count(),
                            "platform": platform.platform(), "gpu": None}
    if any(str(d).startswith("cuda") for d in devices):
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    return info


def environment(devices: list[str] | tuple[str, ...] = ("cpu",), threads: int | None = None,
                command: list[str] | None = None) -> dict[str, Any]:
    """Everything :mod:`provenance` records about this process: ``machine``, ``threads`` (the runs' setting;
    ``torch_default_threads`` beside it), ``versions`` (python, torch, triton, numpy), ``git``, ``command``
    (the exact command line, shell-quoted) and ``date``."""
    import torch

    return {"machine": machine(devices), "threads": threads, "torch_default_threads": torch.get_num_threads(),
            "versions": {"python": platform.python_version(), "torch": torch.__version__, "triton": _version("triton"),
                         "numpy": _version("numpy"), "mhmoe": _version("mhmoe")},
            "git": git_commit(), "command": shlex.join(command if command is not None else _argv()),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _argv() -> list[str]:
    """The command line as typed: ``mhmoe ...`` for the console script and ``python -m mhmoe``."""
    argv = list(sys.argv)
    if argv and (argv[0].endswith("/mhmoe") or argv[0] == "mhmoe" or argv[0].endswith("mhmoe/__main__.py")):
        argv[0] = "mhmoe"
    return argv


def describe(env: dict[str, Any], threads: bool = True, commit: bool = True) -> str:
    """One line for results.md: ``Intel Xeon (avx2, avx512f, amx_bf16), 1 thread(s) per run, torch 2.13.0, commit
    1a2b3c4``; ``threads=False`` leaves the thread count out (a process that only reports trains nothing),
    ``commit=False`` the commit."""
    m = env.get("machine") or {}
    where = m.get("gpu") or f"{m.get('cpu', '?')} ({', '.join(m.get('isa') or []) or 'no ISA flags read'})"
    git = env.get("git") or {}
    sha = (git.get("commit") or "")[:10] if commit else ""
    n = env.get("threads") or env.get("torch_default_threads")
    return (where + (f", {n} thread(s) per run" if threads else "")
            + f", torch {(env.get('versions') or {}).get('torch')}" + (f", commit {sha}" if sha else "")
            + (" (uncommitted changes)" if commit and git.get("dirty") else ""))


def describe_runs(environments: list[dict[str, Any] | None]) -> str:
    """Where the runs trained, from their own records: ``Intel Xeon (...), 1 thread(s) per run, torch 2.13.0 (96
    runs)``, one such part per distinct machine, thread count and torch (``; ``-separated, most runs first), and
    how many runs recorded none."""
    counts = Counter(describe(e, commit=False) for e in environments if e)
    parts = [f"{what} ({n} run{'s' if n != 1 else ''})" for what, n in counts.most_common()]
    missing = sum(1 for e in environments if not e)
    if missing:
        parts.append(f"{missing} run{'s' if missing != 1 else ''} without a recorded machine")
    return "; ".join(parts)
