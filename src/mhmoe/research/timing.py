"""Timing on a shared machine: round-robin medians (:func:`time_fns`), paired ratios (:func:`paired_ratio`), and
what the numbers were measured on (:func:`machine_info`, the GPU's bf16 peak for MFU).

Used by ``mhmoe bench`` (:mod:`mhmoe.research.bench`) and the scripts in ``benchmarks/``.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def machine_info(device: torch.device) -> dict[str, Any]:
    from mhmoe.runtime.cpu import ISA_NAMES, cpu_info, cpu_isa

    cpu = cpu_info()[0]
    info = {"cpu": cpu, "threads": torch.get_num_threads(), "torch": torch.__version__, "device": str(device)}
    info["isa"] = ISA_NAMES[cpu_isa()]  # the CPU's matrix ISA (AMX, AVX-512 BF16, AVX-512, AVX2): the CPU table's key
    from mhmoe.runtime.cpu_malloc import ENV as MALLOC_ENV

    # the allocator setting as given (the mhmoe command and the benchmark scripts apply MHMOE_MALLOC=tuned at start)
    info["malloc"] = os.environ.get(MALLOC_ENV) or "default"
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


# Dense bf16 tensor-core peak TFLOP/s (no sparsity) by GPU name, from the vendors' data sheets; the
# denominator of model FLOPs utilisation (MFU). Unknown devices: pass the peak explicitly.
BF16_PEAK_TFLOPS = {"H100 SXM": 989.4, "H100 80GB HBM3": 989.4, "H100 PCIe": 756.0, "H100 NVL": 835.5,
                    "H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.1, "L4": 121.0, "A10G": 70.0}


def bf16_peak_tflops(device: torch.device) -> float | None:
    """The device's dense bf16 peak in TFLOP/s (None when unknown, e.g. a CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in BF16_PEAK_TFLOPS.items():  # most specific names first
        if key in name:
            return peak
    return None


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Median wall time of ``fn`` in milliseconds."""
    return time_fns({"fn": fn}, device, repeats, warmup)[0]["fn"]


def time_fns(fns: dict[str, Callable[[], Any]], device: torch.device, repeats: int, warmup: int = 2,
             fallible: frozenset[str] = frozenset(),
             samples: dict[str, list[float]] | None = None) -> tuple[dict[str, float], dict[str, str]]:
    """Median wall time in ms of every function, measured **round-robin**: each repeat runs every
    function once in turn, in the dict's order, so slow drifts of a shared machine (other tenants, frequency,
    memory state) hit all candidates alike instead of whichever happened to be timed last. ``samples``, when
    given, receives every function's times in repeat order (for :func:`paired_ratio`).

    A function named in ``fallible`` that raises ``RuntimeError`` in the warm-up is dropped and its
    first error line returned in the second dict (peers that cannot run a config); other errors propagate.
    """
    errors: dict[str, str] = {}
    live = dict(fns)
    for name, fn in fns.items():
        try:
            for _ in range(warmup):
                fn()
        except RuntimeError as e:
            if name not in fallible:
                raise
            errors[name] = str(e).splitlines()[0][:200]
            del live[name]
    sync(device)
    times: dict[str, list[float]] = {name: [] for name in live}
    for _ in range(repeats):
        for name, fn in live.items():
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[name].append((time.perf_counter() - t0) * 1e3)
    if samples is not None:
        samples.update(times)
    return {name: statistics.median(ts) for name, ts in times.items()}, errors


def paired_ratio(num: list[float], den: list[float]) -> float:
    """The median over repeats of ``num[i] / den[i]``: the ratio of two functions timed one after the other in
    each repeat of :func:`time_fns`. Where a machine's speed moves between levels within seconds (shared cloud
    cores), both times of a pair mostly see the same level, while the ratio of two medians compares times from
    different stretches."""
    return statistics.median(a / b for a, b in zip(num, den, strict=True))
