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


def describe(env: dict[str, Any]) -> str:
    """One line for results.md: ``Intel Xeon (avx2, avx512f, amx_bf16), 1 thread, torch 2.13.0, commit 1a2b3c4``."""
    m = env.get("machine") or {}
    where = m.get("gpu") or f"{m.get('cpu', '?')} ({', '.join(m.get('isa') or []) or 'no ISA flags read'})"
    threads = env.get("threads")
    git = env.get("git") or {}
    commit = (git.get("commit") or "")[:10]
    return (f"{where}, {threads or env.get('torch_default_threads')} thread(s) per run, torch "
            f"{(env.get('versions') or {}).get('torch')}" + (f", commit {commit}" if commit else "")
            + (" (uncommitted changes)" if git.get("dirty") else ""))
