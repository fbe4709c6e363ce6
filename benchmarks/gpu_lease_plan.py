"""Predicted seconds of every GPU-lease step (benchmarks/gpu_lease.py): counted Triton compiles times their
measured cost, plus an estimate of the rest.

Compiles are **counted, not guessed**: each step's Triton workloads (the MoE expert kernels and the fused router
at the shapes, dtypes and passes the step runs) are recorded on CPU tensors, launch by launch, by the same code
the sm_90a compile report uses (:func:`mhmoe.moe.dispatch.triton.aot.record`); every distinct (kernel, constexpr
variant, argument specialisation, candidate config) is one compile, and a compile an earlier step already made is
a hit in the lease's shared Triton cache, not counted again. A compile costs the CPU seconds measured for its
kernel by ``python benchmarks/gpu_lease_plan.py --calibrate`` (the bench_mh3 step's 28 compiles for sm_90a with
triton 3.6, the GPU machine's, in ``benchmarks/results/gpu_lease_compile_cpu.json``; CPU seconds, because the
wall seconds of a shared CPU grow with its load), other kernels the compile report's
(``benchmarks/results/triton_aot_sm90.json``) wall seconds scaled by the same ratio; plus the autotuner's timing
of each candidate config on the GPU (``TUNE_S``, once per kernel variant and autotuning key in a process). The
rest of a step (imports, CUDA start, model builds, the timed runs) is an estimate (``RUN_S``), to be replaced by
the seconds the first lease measures (its lease.json has both).

Shape legend (workloads): S routed rows (sub-tokens), K top-k, E experts, D expert width, F hidden width.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AOT_JSON = ROOT / "benchmarks" / "results" / "triton_aot_sm90.json"
CALIBRATION_JSON = ROOT / "benchmarks" / "results" / "gpu_lease_compile_cpu.json"
TUNE_S = 0.25  # the autotuner's timing of one candidate config on the GPU (do_bench: ~25 ms warm-up + ~100 ms)
DEFAULT_COMPILE_S = 2.0  # a kernel the report has no timing for (the median of all its compiles, rounded)
INDUCTOR_S = 90.0  # torch.compile of the tiny test model (test_compiled_training_with_cuda_graphs): an estimate

# The steps' Triton workloads: (S, K, E, D, F, dtype, scenario, what); what = "experts" (the expert kernels and
# the fused router, as impl="triton" runs them) or "router" (the fused router alone: impl="auto" on grouped_mm).
# scenario: "train" (forward + backward) or "inference" (forward without autograd).
T16 = 16384  # tokens per layer call / per training step (paper presets: 16 x 1024)
_MH3 = (T16 * 3, 3, 96, 256, 512)  # the bench's mh3 (96 x 512 top-3, h=3)
_PAPER_MH3 = (T16 * 3, 3, 93, 256, 512)  # the paper-mh3 preset (93 x 512 top-3, h=3)
_PARITY = {"smoe": (T16, 1, 8, 768, 2048), "fgmoe": (T16, 2, 16, 768, 1024), "mh2": (T16 * 2, 2, 40, 384, 768)}


def _both(shape: tuple, dtype: str, what: str = "experts") -> list[tuple]:
    return [(*shape, dtype, scen, what) for scen in ("inference", "train")]


# tests/moe/test_cuda_paths.py::test_auto_never_waits_for_the_device (aligned: bf16 runs grouped_mm + the router),
# tests/train/test_cuda_training.py::test_training_steps_never_wait_for_the_device (d_model 48: SMoE 4x64 top-1,
# MH-MoE 6x16 top-3 h=3; bf16 aligned: grouped_mm), tests/moe/test_triton_dispatch.py::TestCUDA::test_no_host_sync,
# tests/moe/test_triton_router.py::test_cuda_at_mh3_size_matches_and_never_synchronises (the router alone)
_SYNC_TESTS = (_both((768, 2, 8, 64, 128), "fp32") + _both((768, 2, 8, 64, 128), "bf16", "router")
               + _both((512, 2, 8, 75, 100), "fp32") + _both((512, 2, 8, 75, 100), "bf16")
               + [(128, 1, 4, 48, 64, "fp32", "train", "experts"), (384, 3, 6, 16, 16, "fp32", "train", "experts"),
                  (128, 1, 4, 48, 64, "bf16", "train", "router"), (384, 3, 6, 16, 16, "bf16", "train", "router"),
                  (128, 2, 6, 48, 16, "fp32", "train", "experts")]
               + _both((512, 2, 8, 256, 512), "bf16")
               + [(*_PAPER_MH3, dt, "train", "router") for dt in ("bf16", "fp32")])
# the other gpu tests: the oracle tests' four small configs (d=192) in fp32 and bf16, TestCUDA's four shapes
_REST_TESTS = [w for shape in ((256, 1, 8, 192, 256), (256, 2, 16, 192, 128), (512, 2, 20, 96, 128),
                               (768, 3, 24, 64, 64), (1024, 2, 8, 256, 512), (600, 3, 6, 384, 1024),
                               (300, 1, 16, 768, 2048), (257, 2, 5, 100, 300))
               for dt in ("fp32", "bf16") for w in _both(shape, dt)]
WORKLOADS: dict[str, list[tuple]] = {
    "machine": [],
    "bench_mh3": _both(_MH3, "bf16"),
    "train": [(*_PAPER_MH3, "bf16", "train", "router"), (*_PAPER_MH3, "bf16", "train", "experts")],
    "gpu_tests": _SYNC_TESTS,
    "bench_parity": [w for shape in _PARITY.values() for w in _both(shape, "bf16")],
    "science": [],  # takes what is left of the command (RUN_S: the least it starts with)
    "gpu_tests_rest": _REST_TESTS,
    "bench_fp32": [w for shape in (_MH3, *_PARITY.values()) for w in _both(shape, "fp32")],
    "triton_bench": [w for s, k, e, d, f in ((T16, 2, 8, 256, 512), (T16, 2, 8, 256, 1024), (T16, 2, 16, 256, 2048),
                                             (8192, 2, 8, 384, 1024), (8192, 2, 8, 768, 2048), (49152, 3, 96, 256, 512))
                     for w in _both((s, k, e, d, f), "bf16")],
}
# What a step costs besides its Triton compiles, in seconds on the GPU machine (estimates: imports ~10 s per
# process, CUDA start, building the layers/models, the timed repeats; the science step takes what is left).
RUN_S = {"machine": 25, "bench_mh3": 45, "train": 60, "gpu_tests": 45, "bench_parity": 60, "science": 120,
         "gpu_tests_rest": 60 + INDUCTOR_S, "bench_fp32": 90, "triton_bench": 60}


def _median_by_kernel(compiles: list[dict], key: str) -> dict[tuple[str, str], float]:
    by: dict[tuple[str, str], list[float]] = {}
    for c in compiles:
        by.setdefault((c["kernel"], c["dtype"]), []).append(float(c[key]))
    return {k: statistics.median(v) for k, v in by.items()}


def compile_seconds(path: Path = AOT_JSON, calibration: Path = CALIBRATION_JSON) -> dict[tuple[str, str], float]:
    """(kernel, dtype) -> seconds of one sm_90a compile: the CPU seconds measured by ``--calibrate`` where it has
    the kernel, else the compile report's median wall seconds scaled by calibrated CPU / report wall over the
    kernels both have (the report's wall times grow with the load of the machine that made it). {} if neither."""
    try:
        report = _median_by_kernel(json.loads(path.read_text(encoding="utf-8"))["compiles"], "seconds")
    except (OSError, ValueError, KeyError, TypeError):
        report = {}
    try:
        measured = _median_by_kernel(json.loads(calibration.read_text(encoding="utf-8"))["compiles"], "cpu_s")
    except (OSError, ValueError, KeyError, TypeError):
        return report
    common = [k for k in measured if k in report and report[k] > 0]
    scale = statistics.median(measured[k] / report[k] for k in common) if common else 1.0
    return {k: v * scale for k, v in report.items()} | measured


def calibrate(json_path: Path = CALIBRATION_JSON) -> dict:
    """Compile the bench_mh3 step's kernels (bf16, mh3, forward and forward + backward) for sm_90a in a fresh
    Triton cache and record each compile's CPU seconds (this process plus ptxas): a cost that does not depend on
    how busy the machine is, unlike wall seconds."""
    import os
    import resource
    import tempfile
    import time

    import triton

    from mhmoe.moe.dispatch.triton import aot
    from mhmoe.moe.dispatch.triton.tiles import CONFIGS
    from mhmoe.runtime.cpu import cpu_info

    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="mhmoe-calibrate-")  # nothing compiled before
    seen, rows = set(), []
    for workload in WORKLOADS["bench_mh3"]:
        for launch in _launches(workload):
            for tile in CONFIGS.get(launch.kernel, {}).get(launch.dtype) or [None]:
                key = aot._key(launch, tile)
                if key in seen:
                    continue
                seen.add(key)
                c0, w0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
                p0 = time.process_time()
                r = aot.compile_launch(launch, tile)
                c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
                cpu = time.process_time() - p0 + (c1.ru_utime + c1.ru_stime) - (c0.ru_utime + c0.ru_stime)
                rows.append({"kernel": r.kernel, "dtype": r.dtype, "tile": r.tile, "cpu_s": round(cpu, 3),
                             "wall_s": round(time.perf_counter() - w0, 3)})
                print(rows[-1], flush=True)
    doc = {"triton": triton.__version__, "cpu": cpu_info()[0], "target": "sm_90a", "workload": "bench_mh3",
           "date": time.strftime("%Y-%m-%d"), "compiles": rows}
    json_path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return doc


def _launches(workload: tuple) -> list:
    """The recorded Triton launches of one workload (CPU tensors; nothing compiled or run)."""
    import torch

    from mhmoe.moe.dispatch.precision import cuda_matmul_tf32_set
    from mhmoe.moe.dispatch.triton import aot
    from mhmoe.moe.dispatch.triton import launch as L

    S, K, E, D, F, dt, scen, what = workload
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dt]
    with cuda_matmul_tf32_set(False):  # PyTorch's default: fp32 kernels in exact fp32 ("ieee")
        if what == "experts":
            return aot.record((S, K, E, D, F), dtype, "swiglu", scen)
        with L.recording() as launches:
            aot._record_router(S, E, K, D, dtype, None if scen == "inference" else aot.SCENARIOS[scen])
        return launches


def count_compiles(steps: list[str], seen: set | None = None) -> dict[str, dict]:
    """Per step (in order): {"compiles", "tunings", "compile_s", "kernels"}; a compile an earlier step of
    ``steps`` (or ``seen``) made is not counted again (the shared Triton cache). ``tunings``: the autotuner's
    timings of a candidate config, once per kernel variant and autotuning key (the padded D, F) per process."""
    from mhmoe.moe.dispatch.triton import aot
    from mhmoe.moe.dispatch.triton.tiles import CONFIGS

    secs = compile_seconds()
    default = statistics.median(secs.values()) if secs else DEFAULT_COMPILE_S
    seen = set() if seen is None else seen
    out = {}
    for step in steps:
        n = tunings = 0
        total = 0.0
        kernels: dict[str, int] = {}
        tuned: set[tuple] = set()  # the autotuner's cache lives in the step's process
        for workload in WORKLOADS.get(step, []):
            pad = tuple(-(-w // 16) * 16 for w in workload[3:5])
            for launch in _launches(workload):
                tiles = CONFIGS.get(launch.kernel, {}).get(launch.dtype) or [None]
                tune_key = (launch.kernel, launch.dtype, tuple(sorted(launch.consts.items())), pad)
                if len(tiles) > 1 and tune_key not in tuned:
                    tuned.add(tune_key)
                    tunings += len(tiles)
                for tile in tiles:
                    key = aot._key(launch, tile)
                    if key in seen:
                        continue
                    seen.add(key)
                    n += 1
                    total += secs.get((launch.kernel, launch.dtype), default)
                    kernels[launch.kernel] = kernels.get(launch.kernel, 0) + 1
        out[step] = {"compiles": n, "tunings": tunings, "compile_s": round(total + tunings * TUNE_S, 1),
                     "kernels": kernels}
    return out


def plan(steps: list[str]) -> dict[str, dict]:
    """{step: {"compiles", "compile_s", "run_s", "predicted_s", ...}}: counted compiles (see the module doc) plus
    ``RUN_S``. Needs torch and triton (imported without TRITON_INTERPRET: the compiled kernels' launches)."""
    counts = count_compiles(steps)
    return {s: {**counts[s], "run_s": RUN_S.get(s, 30),
                "predicted_s": round(counts[s]["compile_s"] + RUN_S.get(s, 30))} for s in steps}


def main() -> int:
    """Print the plan of the given steps as JSON (for ``benchmarks/gpu_lease.py --plan``); ``--calibrate``:
    measure the compile CPU seconds (:func:`calibrate`) into benchmarks/results/gpu_lease_compile_cpu.json."""
    import sys

    if sys.argv[1:] == ["--calibrate"]:
        calibrate()
        return 0
    steps = sys.argv[1:] or list(WORKLOADS)
    print(json.dumps(plan(steps)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
