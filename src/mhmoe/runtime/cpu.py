"""What the CPU can do fast: native bf16 arithmetic, read from the CPU's own capability flags.

PyTorch runs ``bfloat16`` matmuls on a CPU through oneDNN. With native bf16 instructions (x86:
``avx512_bf16`` or ``amx_bf16``; Arm: the ``bf16`` feature, FEAT_BF16) they run at least as fast as
float32. Without them (AVX2-only x86 machines, e.g. AMD EPYC Rome/Milan, Intel before Cooper Lake /
Sapphire Rapids) every bf16 value is converted in software and the reference kernels run instead:
measured on a 2-core AVX2 AMD EPYC (``benchmarks/results/cpu_bf16_avx2.json``), a 1024x1024 bf16
matmul ran ~100x slower than float32 and an SMoE layer forward ~150x slower.

:func:`native_bf16` answers from ``/proc/cpuinfo`` (Linux), ``sysctl hw.optional.arm.FEAT_BF16``
(macOS) and otherwise says it does not know (None); torch has no public query for it.
:func:`bf16_warning` is the one-line warning the ``mhmoe`` command prints for ``train`` / ``eval`` /
``bench`` when bf16 is chosen on such a CPU.

:func:`cpu_isa` names the widest x86 matrix ISA that PyTorch's CPU kernels (oneDNN, MKL) can use here --
``amx``, ``avx512_bf16``, ``avx512``, ``avx2`` or ``other`` -- capped by ``ONEDNN_MAX_CPU_ISA`` when that is
set (oneDNN then does not go beyond it): the key of the CPU dispatch table
(:mod:`mhmoe.moe.dispatch.cpu_table`).
"""

from __future__ import annotations

import functools
import os
import platform
import subprocess
import sys
from pathlib import Path

X86_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo "flags" (x86)
ARM_BF16_FLAGS = ("bf16",)  # /proc/cpuinfo "Features" (aarch64, ARMv8.6 FEAT_BF16)
ISAS = ("amx", "avx512_bf16", "avx512", "avx2", "other")  # widest first
ISA_NAMES = {"amx": "AMX", "avx512_bf16": "AVX-512 BF16", "avx512": "AVX-512", "avx2": "AVX2", "other": "other"}
# ONEDNN_MAX_CPU_ISA values (oneDNN's names, upper-case) -> the widest of our ISAs they allow
_ONEDNN_CAPS = {"AVX2": "avx2", "AVX2_VNNI": "avx2", "AVX2_VNNI_2": "avx2", "AVX512_CORE": "avx512",
                "AVX512_CORE_VNNI": "avx512", "AVX512_CORE_BF16": "avx512_bf16", "AVX10_1_512": "avx512_bf16",
                "AVX512_CORE_FP16": "avx512_bf16", "AVX10_1_512_AMX": "amx", "AVX512_CORE_AMX": "amx",
                "AVX10_1_512_AMX_FP16": "amx", "AVX512_CORE_AMX_FP16": "amx", "AVX10_2_512_AMX_2": "amx",
                "DEFAULT": "amx", "ALL": "amx"}
SLOWDOWN = "~100x"  # bf16 matmul vs float32 without native bf16 (benchmarks/results/cpu_bf16_avx2.json)


def cpu_info(text: str | None = None) -> tuple[str, frozenset[str]]:
    """(model name, capability flags) from ``/proc/cpuinfo`` text (read when not given); ("", {}) elsewhere."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return platform.processor() or platform.machine(), frozenset()
    model, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "hardware", "cpu model") and not model:
            model = value.strip()
        elif key in ("flags", "features"):
            flags.update(value.split())
    return model or platform.machine(), frozenset(flags)


def native_bf16(flags: frozenset[str] | None = None, machine: str | None = None) -> bool | None:
    """True if the CPU has native bf16 instructions, False if it has none, None if unknown.

    ``flags`` / ``machine`` default to this machine's (``/proc/cpuinfo``, :func:`platform.machine`)."""
    machine = (machine or platform.machine()).lower()
    if flags is None and sys.platform == "darwin":
        return _darwin_bf16()
    if flags is None:
        flags = cpu_info()[1]
    if not flags:
        return None
    if machine in ("x86_64", "amd64", "i686", "i386"):
        return any(f in flags for f in X86_BF16_FLAGS)
    if machine in ("aarch64", "arm64"):
        return any(f in flags for f in ARM_BF16_FLAGS)
    return None


def cpu_isa(flags: frozenset[str] | None = None, machine: str | None = None, env: str | None = None) -> str:
    """The widest matrix ISA of this x86 CPU: ``amx`` (``amx_bf16`` + ``amx_tile``), ``avx512_bf16``,
    ``avx512`` (``avx512f`` + ``avx512bw``), ``avx2`` (+ ``fma``) or ``other`` (not x86, or unknown), lowered to
    ``ONEDNN_MAX_CPU_ISA`` (``env``, default the environment's) when that names a narrower one.

    ``flags`` / ``machine`` default to this machine's (``/proc/cpuinfo``, :func:`platform.machine`)."""
    machine = (machine or platform.machine()).lower()
    if machine not in ("x86_64", "amd64"):
        return "other"
    flags = _this_cpu_flags() if flags is None else flags
    if {"amx_bf16", "amx_tile"} <= flags:
        isa = "amx"
    elif {"avx512f", "avx512bw", "avx512_bf16"} <= flags:
        isa = "avx512_bf16"
    elif {"avx512f", "avx512bw"} <= flags:
        isa = "avx512"
    elif {"avx2", "fma"} <= flags:
        isa = "avx2"
    else:
        return "other"
    cap = _ONEDNN_CAPS.get((os.environ.get("ONEDNN_MAX_CPU_ISA", "") if env is None else env).strip().upper())
    return max(isa, cap, key=ISAS.index) if cap else isa  # the narrower of the two (later in ISAS)


@functools.cache
def _this_cpu_flags() -> frozenset[str]:
    return cpu_info()[1]


def _darwin_bf16() -> bool | None:
    try:
        out = subprocess.run(["sysctl", "-n", "hw.optional.arm.FEAT_BF16"], capture_output=True, text=True,
                             timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    value = out.stdout.strip()
    return value == "1" if value in ("0", "1") else None


def bf16_warning(device: str, dtype: str, native: bool | None = None) -> str | None:
    """The warning for running ``dtype`` on ``device`` ("cpu" / "cuda"), or None when there is nothing to say:
    bfloat16 on a CPU known to lack native bf16, and float16 on any CPU. ``native``: the answer of
    :func:`native_bf16` if already known (None: ask it)."""
    if dtype == "float16" and str(device).startswith("cpu"):
        return ("float16 (with loss scaling) is meant for GPUs without bf16 (T4, V100); on a CPU use --dtype float32, "
                "or bfloat16 where the CPU has it (README: 'CPUs, GPUs and bf16')")
    if dtype not in ("bfloat16", "bf16") or not str(device).startswith("cpu"):
        return None
    if (native_bf16() if native is None else native) is not False:
        return None
    model = cpu_info()[0] or "this CPU"
    return (f"{model} has no native bf16 instructions (avx512_bf16/amx_bf16): bfloat16 runs {SLOWDOWN} slower "
            "than float32 here; use --dtype float32 (README: 'CPUs, GPUs and bf16')")
