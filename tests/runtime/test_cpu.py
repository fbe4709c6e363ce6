"""bf16 capability detection from the CPU's flags, and the warning built from it."""

from __future__ import annotations

import pytest

from mhmoe.runtime import cpu
from mhmoe.runtime.cpu import bf16_warning, cpu_info, native_bf16

EPYC_AVX2 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B12
flags\t\t: fpu vme sse sse2 avx avx2 fma bmi2
"""
SAPPHIRE_RAPIDS = "model name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
ICE_LAKE = "model name\t: Intel(R) Xeon(R) Platinum 8375C\nflags\t: avx2 avx512f avx512bw avx512_vnni\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\nCPU part\t: 0xd40\n"
GRAVITON2 = "processor\t: 0\nFeatures\t: fp asimd atomics\n"


def test_cpu_info_parses_model_and_flags():
    model, flags = cpu_info(EPYC_AVX2)
    assert model == "AMD EPYC 7B12" and {"avx2", "fma"} <= flags and "avx512_bf16" not in flags


@pytest.mark.parametrize("text, machine, expected", [
    (EPYC_AVX2, "x86_64", False), (ICE_LAKE, "x86_64", False),  # AVX-512 without the bf16 extension
    (SAPPHIRE_RAPIDS, "x86_64", True), (GRAVITON3, "aarch64", True), (GRAVITON2, "aarch64", False),
    ("", "x86_64", None), (EPYC_AVX2, "riscv64", None)])
def test_native_bf16_from_flags(text, machine, expected):
    assert native_bf16(cpu_info(text)[1], machine) is expected


def test_warning_only_for_bf16_on_a_cpu_without_it():
    message = bf16_warning("cpu", "bfloat16", native=False)
    assert message and "no native bf16" in message and "100x" in message and "--dtype float32" in message
    assert "\n" not in message
    assert bf16_warning("cpu", "bfloat16", native=True) is None
    assert bf16_warning("cpu", "float32", native=False) is None
    assert bf16_warning("cuda", "bfloat16", native=False) is None


def test_this_machine_is_classified(monkeypatch):
    """On Linux the answer comes from /proc/cpuinfo; the flags decide, not the vendor."""
    monkeypatch.setattr(cpu, "cpu_info", lambda text=None: ("Some CPU", frozenset({"avx2"})))
    monkeypatch.setattr(cpu.sys, "platform", "linux")
    monkeypatch.setattr(cpu.platform, "machine", lambda: "x86_64")
    assert native_bf16() is False and "Some CPU" in bf16_warning("cpu", "bfloat16")
    monkeypatch.setattr(cpu, "cpu_info", lambda text=None: ("Some CPU", frozenset()))  # flags unknown
    assert native_bf16() is None and bf16_warning("cpu", "bfloat16") is None  # no guess, no warning


@pytest.mark.parametrize("text, machine, expected", [
    (SAPPHIRE_RAPIDS, "x86_64", "amx"), (ICE_LAKE, "x86_64", "avx512"), (EPYC_AVX2, "x86_64", "avx2"),
    ("flags\t: avx2 fma avx512f avx512bw avx512_bf16\n", "x86_64", "avx512_bf16"),  # e.g. AMD Zen 4
    (GRAVITON3, "aarch64", "other"), ("", "x86_64", "other")])
def test_cpu_isa_from_flags(text, machine, expected):
    assert cpu.cpu_isa(cpu_info(text)[1], machine, env="") == expected


def test_cpu_isa_capped_by_onednn_max_cpu_isa():
    """ONEDNN_MAX_CPU_ISA keeps oneDNN below an ISA: the dispatch table's key follows it, never above the CPU."""
    flags = cpu_info(SAPPHIRE_RAPIDS)[1]
    assert cpu.cpu_isa(flags, "x86_64", env="AVX512_CORE_BF16") == "avx512_bf16"
    assert cpu.cpu_isa(flags, "x86_64", env="avx2") == "avx2"
    assert cpu.cpu_isa(flags, "x86_64", env="ALL") == "amx"
    assert cpu.cpu_isa(flags, "x86_64", env="not-an-isa") == "amx"
    assert cpu.cpu_isa(cpu_info(EPYC_AVX2)[1], "x86_64", env="AVX512_CORE_AMX") == "avx2"
    assert cpu.ISA_NAMES[cpu.cpu_isa()] in ("AMX", "AVX-512 BF16", "AVX-512", "AVX2", "other")  # this machine
