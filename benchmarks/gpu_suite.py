"""Everything that needs a GPU, as resumable steps that each fit one 10-minute command on an H100.

Every step has its own time budget (killed past it, recorded as timed out), writes its own JSON (and log)
into the results directory, and records its status (``<step>.status.json``: exit code, seconds, budget);
a step whose status says it succeeded is skipped on the next call, so the suite resumes where it stopped.
All steps share one Triton cache (compiled kernels, and autotuning results where triton supports
``TRITON_CACHE_AUTOTUNING``) outside the results directory; the ``warm`` step fills it at the benchmark
shapes first. fp32 kernels run one fixed config (no autotuning), so no step waits on fp32 autotuning.

    python benchmarks/gpu_suite.py --list                 # the steps and their budgets
    python benchmarks/gpu_suite.py --next 540             # run pending steps while their budgets fit 540 s
    python benchmarks/gpu_suite.py --step bench_moe_bf16  # one step (--force: even if done)
    bash benchmarks/gpu_suite.sh                          # every pending step, in order

Results go to ``--results`` (default ``benchmarks/results/gpu``); when ``$OUT`` is set, each step's files
are also copied there (the device machine's output folder).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEP_LIMIT_S = 480  # every step must finish within 8 minutes on an H100
PY = sys.executable


@dataclass(frozen=True)
class Step:
    """One command of the suite: ``{results}`` in ``cmd`` is replaced by the results directory."""

    name: str
    cmd: tuple[str, ...]
    budget_s: int
    outputs: tuple[str, ...] = field(default=())  # JSON files the step writes into the results directory
    about: str = ""


def _bench(dtype: str, short: str) -> Step:
    return Step(f"bench_moe_{short}", (PY, "-m", "mhmoe", "bench", "moe", "--device", "cuda", "--tokens", "16384",
                                       "--dtypes", dtype, "--repeats", "10", "--no-loop", "--json",
                                       f"{{results}}/bench_moe_{short}.json"),
                420, (f"bench_moe_{short}.json",), f"the MoE layer's paths vs dense vs HF peers, {dtype}, 16k tokens")


TRAIN = (PY, "benchmarks/train_throughput.py", "--device", "cuda", "--steps", "10", "--warmup", "3",
         "--batch-size", "16", "--seq-len", "1024")
STEPS: list[Step] = [
    Step("machine", (PY, "benchmarks/gpu_suite.py", "--machine", "{results}/machine.json"), 60, ("machine.json",),
         "versions of torch, CUDA, triton, transformers; the GPU"),
    Step("warm", (PY, "benchmarks/triton_moe.py", "--warm", "--json", "{results}/warm.json"), 420, ("warm.json",),
         "compile and autotune the Triton kernels at the benchmark shapes (fills the shared cache)"),
    Step("pytest_gpu_moe", (PY, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests/moe",
                            "--junitxml", "{results}/pytest_gpu_moe.xml"), 450, (),
         "gpu tests of the MoE paths: oracle in fp32/bf16, no host syncs for every dtype"),
    Step("pytest_gpu_rest", (PY, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests",
                             "--ignore", "tests/moe", "--junitxml", "{results}/pytest_gpu_rest.xml"), 450, (),
         "the other gpu tests: training without syncs, CLI train/eval/generate and bench on CUDA"),
    _bench("bfloat16", "bf16"),
    _bench("float32", "fp32"),
    Step("train_bf16", (*TRAIN, "--dtype", "bfloat16", "--presets", "paper-dense", "paper-smoe", "paper-fgmoe",
                        "paper-mh2", "paper-mh3", "--json", "{results}/train_throughput_bf16.json"), 420,
         ("train_throughput_bf16.json",), "whole-model tokens/s and MFU of the paper presets, default path"),
    Step("train_bf16_triton", (*TRAIN, "--dtype", "bfloat16", "--presets", "paper-mh3", "--set",
                               "model.moe.impl=triton", "--json", "{results}/train_throughput_bf16_triton.json"), 300,
         ("train_throughput_bf16_triton.json",), "paper-mh3 with the Triton path in bf16"),
    Step("train_fp32", (*TRAIN, "--dtype", "float32", "--presets", "paper-dense", "paper-mh3",
                        "--json", "{results}/train_throughput_fp32.json"), 420, ("train_throughput_fp32.json",),
         "fp32 training throughput (auto: the Triton path, sync-free)"),
    Step("triton_bench", (PY, "benchmarks/triton_moe.py", "--bench", "--json", "{results}/triton_moe_bf16.json"), 420,
         ("triton_moe_bf16.json",), "Triton kernels (act_bwd + dx and act_dx) vs grouped_mm vs sorted"),
    Step("reproduce_v2_table1", (PY, "-m", "mhmoe", "reproduce", "v2-table1", "--device", "cuda", "--minutes", "20",
                                 "--seeds", "3", "--out", "{results}/reproduce-v2-table1", "--no-progress",
                                 "--set", "train.dtype=bfloat16", "--set", "train.batch_size=64"),
         470, ("reproduce-v2-table1/summary.json", "reproduce-v2-table1/budget.json"),
         "v2 Table 1 at a 20-minute H100 budget (3 seeds; calibrated tokens per run): about 3 calls, each "
         "resumes the suite where the last one was stopped"),
    Step("traffic_model", (PY, "benchmarks/traffic_model.py", "--json", "{results}/traffic_model.json"), 60,
         ("traffic_model.json",), "the traffic model's predictions, to set beside the measurements"),
]


def _status_path(results: Path, step: Step) -> Path:
    return results / f"{step.name}.status.json"


def done(results: Path, step: Step) -> bool:
    """Whether ``step`` already ran to success (exit 0 within its budget, its outputs present)."""
    try:
        st = json.loads(_status_path(results, step).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return st.get("rc") == 0 and all((results / o).exists() for o in step.outputs)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def env_for_steps() -> dict[str, str]:
    """The environment every step runs in: compiled kernels (no interpreter), one shared Triton cache."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cache = Path(env.get("MHMOE_GPU_CACHE", Path.home() / ".cache" / "mhmoe-gpu-suite"))
    env.setdefault("TRITON_CACHE_DIR", str(cache / "triton"))
    env.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    env.setdefault("PYTHONPATH", str(ROOT / "src"))
    return env


def run_step(step: Step, results: Path, out: Path | None = None, env: dict[str, str] | None = None) -> dict:
    """Run one step within its budget; its log, status and outputs land in ``results`` (and ``out``)."""
    results.mkdir(parents=True, exist_ok=True)
    cmd = [c.replace("{results}", str(results)) for c in step.cmd]
    log = results / f"{step.name}.log"
    t0 = time.perf_counter()
    with open(log, "w", encoding="utf-8") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env or env_for_steps(),
                                start_new_session=True)
        try:
            rc, timed_out = proc.wait(step.budget_s), False
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            rc, timed_out = 124, True
    status = {"step": step.name, "rc": rc, "timed_out": timed_out, "seconds": round(time.perf_counter() - t0, 1),
              "budget_s": step.budget_s, "cmd": cmd}
    _status_path(results, step).write_text(json.dumps(status, indent=2), encoding="utf-8")
    if out is not None and out.resolve() != results.resolve():
        out.mkdir(parents=True, exist_ok=True)
        for name in (*step.outputs, log.name, _status_path(results, step).name):
            if (results / name).exists():
                (out / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(results / name, out / name)
    return status


def pending(results: Path, steps: list[Step] = STEPS) -> list[Step]:
    return [s for s in steps if not done(results, s)]


def run_next(results: Path, wall_s: float, out: Path | None = None, steps: list[Step] = STEPS) -> list[dict]:
    """Run pending steps in order while the next one's budget still fits in ``wall_s`` seconds; a failed
    step is recorded and the suite goes on (it stays pending for the next call)."""
    t0, ran = time.perf_counter(), []
    for step in pending(results, steps):
        if any(r["step"] == step.name for r in ran):
            continue
        if time.perf_counter() - t0 + step.budget_s > wall_s:
            break
        ran.append(run_step(step, results, out))
        print(f"[gpu_suite] {step.name}: rc {ran[-1]['rc']} in {ran[-1]['seconds']:.0f} s"
              + (" (TIMED OUT)" if ran[-1]["timed_out"] else ""), flush=True)
    return ran


def machine(path: str) -> int:
    import platform

    import torch

    cuda = torch.cuda.is_available()
    info: dict = {"python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__,
                  "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0) if cuda else None,
                  "capability": list(torch.cuda.get_device_capability(0)) if cuda else None}
    for mod in ("triton", "transformers", "tokenizers", "safetensors"):
        try:
            info[mod] = __import__(mod).__version__
        except ImportError:
            info[mod] = None
    Path(path).write_text(json.dumps(info, indent=2), encoding="utf-8")
    print(json.dumps(info, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "gpu"), help="results directory")
    ap.add_argument("--list", action="store_true", help="print the steps, budgets and status")
    ap.add_argument("--step", action="append", default=[], metavar="NAME", help="run this step (repeatable)")
    ap.add_argument("--force", action="store_true", help="--step: run even if it already succeeded")
    ap.add_argument("--next", type=float, metavar="SECONDS", help="run pending steps that fit in SECONDS")
    ap.add_argument("--all", action="store_true", help="run every pending step")
    ap.add_argument("--machine", metavar="PATH", help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.machine:
        return machine(args.machine)
    results = Path(args.results)
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    by_name = {s.name: s for s in STEPS}
    bad = [n for n in args.step if n not in by_name]
    if bad:
        print(f"gpu_suite: error: unknown step {bad[0]!r}: allowed {', '.join(by_name)}", file=sys.stderr)
        return 2
    if args.list or not (args.step or args.next or args.all):
        for s in STEPS:
            print(f"{s.name:20s} {s.budget_s:4d} s  {'done' if done(results, s) else 'pending':8s} {s.about}")
        return 0
    ran = []
    for name in args.step:
        if args.force or not done(results, by_name[name]):
            ran.append(run_step(by_name[name], results, out))
            print(f"[gpu_suite] {name}: rc {ran[-1]['rc']} in {ran[-1]['seconds']:.0f} s", flush=True)
    if args.next or args.all:
        ran += run_next(results, args.next if args.next else float("inf"), out)
    left = [s.name for s in pending(results)]
    print(f"[gpu_suite] pending: {', '.join(left) if left else 'none'}")
    return 1 if any(r["rc"] for r in ran) else 0


if __name__ == "__main__":
    sys.exit(main())
