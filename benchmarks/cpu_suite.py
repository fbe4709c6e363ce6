"""Every CPU measurement of docs/PERFORMANCE.md on this CPU, one command: JSON files in benchmarks/results/ named
by the CPU's matrix ISA (``amx``, ``avx512bf16``, ``avx512``, ``avx2``), as the docs' tables cite them.

    python benchmarks/cpu_suite.py --dry-run            # the commands for this CPU; nothing runs
    python benchmarks/cpu_suite.py                      # all of them, in this order (~27 minutes on the 2-core EPYC)
    python benchmarks/cpu_suite.py --steps bench profile --skip-existing

Steps, the layer answers first: ``bench`` (``mhmoe bench moe``: every layer against the aligned same-FLOPs dense
FFN, fwd and fwd+bwd), ``profile`` (``moe_profile.py``: where the time goes, one thread), ``native_ops`` (the C++
ops alone), ``tiny_bfloat16`` / ``tiny_float32`` (whole tiny models, ``train_throughput.py``), ``bench_run2`` (the
layer benchmark again: one run on a shared machine says little), ``paper_bfloat16`` / ``paper_float32`` (the
paper-size models), ``generate`` (greedy decoding of the tiny presets), ``thin`` (the parameter-parity layers' thin,
wide experts on each path, ``thin_experts.py``), ``dispatch`` and ``dispatch_tiny`` (``cpu_dispatch.py --measure``,
the d=768 layers and the tiny presets' in a file each: the candidates ``impl="auto"`` chooses from), ``table``
(``cpu_dispatch.py --table``: rebuilds ``auto``'s CPU table from every dispatch file, this CPU's included),
``expert_gemm`` / ``expert_gemm_models`` (the C++ loop's own bf16 GEMM kernel against ``at::mm``: the dot product on
``avx512_bf16`` CPUs, AMX tiles on ``amx`` ones). bf16 runs only where the CPU has native bf16 (AMX or
``avx512_bf16``; elsewhere bf16 matmuls are ~100x slower).

Every step is a process of its own with ``MHMOE_MALLOC=tuned`` and 2 threads (``OMP_NUM_THREADS=2``; the profile
and the C++ ops: one), run from this checkout's ``src``; its output streams to this terminal. A failed step is
reported and the suite goes on; the exit status is 1 if any failed. ``--skip-existing`` skips a step whose JSON
files all exist (a suite resumed after an interruption). On a shared machine, commit each JSON as it lands. Then
``python benchmarks/cpu_tables.py --tag TAG --write`` puts the tables into docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = "benchmarks/results"
TAGS = {"amx": "amx", "avx512_bf16": "avx512bf16", "avx512": "avx512", "avx2": "avx2", "other": "other"}
NATIVE_BF16 = ("amx", "avx512_bf16")
TINY = ["tiny-dense", "tiny-smoe", "tiny-fgmoe", "tiny-mh2", "tiny-mh3"]
PAPER = ["paper-dense", "paper-smoe", "paper-fgmoe", "paper-mh2", "paper-mh3"]
LAYERS = ["smoe", "fgmoe", "mh2", "mh3", "icml-h2", "icml-h4"]  # cpu_dispatch.py's d=768 layers: one file
TINY_LAYERS = ["tiny-smoe", "tiny-fgmoe", "tiny-mh2", "tiny-mh3"]  # the tiny presets' layers: another


@dataclass(frozen=True)
class Step:
    """One process: ``argv`` (after the interpreter) and the JSON files it writes (paths from the checkout)."""

    name: str
    argv: tuple[str, ...]
    outputs: tuple[str, ...]


def _script(name: str, *args: str) -> tuple[str, ...]:
    return (f"benchmarks/{name}.py", *args)


def _throughput(family: str, tag: str, dtype: str, results: str) -> Step:
    out = f"{results}/train_throughput_{family}_{tag}_{dtype}.json"
    if family == "tiny":
        shape = ("--steps", "20")
    else:  # d=768, 2 x 1,024 tokens; fp32 steps take twice as long
        shape = ("--batch-size", "2", "--seq-len", "1024", "--steps", "6" if dtype == "bfloat16" else "3",
                 "--warmup", "1")
    argv = _script("train_throughput", "--presets", *(TINY if family == "tiny" else PAPER), "--device", "cpu",
                   "--threads", "2", *shape, "--dtype", dtype, "--json", out)
    return Step(f"{family}_{dtype}", argv, (out,))


def steps_for(isa: str, results: str = RESULTS) -> list[Step]:
    """The suite for a CPU of this ISA (:func:`mhmoe.runtime.cpu.cpu_isa`), in running order, its JSON files in
    ``results`` (the checkout's benchmarks/results, where the docs cite them, or any other folder; the step that
    rebuilds ``auto``'s table runs only with the checkout's, which it reads)."""
    tag = TAGS[isa]
    dtypes = ["float32", "bfloat16"] if isa in NATIVE_BF16 else ["float32"]

    def bench(suffix: str) -> Step:
        out = f"{results}/moe_cpu_{tag}_2core{suffix}.json"
        argv = ("-m", "mhmoe", "bench", "moe", "--dtypes", *dtypes, "--tokens", "2048", "--repeats", "5",
                "--no-loop", "--peers", "st_moe", "--json", out)
        return Step("bench" + suffix, argv, (out,))

    profile = f"{results}/moe_profile_{tag}.json"
    native = f"{results}/native_ops_{tag}.json"
    generate = f"{results}/generate_throughput_tiny_{tag}.json"
    thin = f"{results}/thin_experts_{tag}_2core.json"
    dispatch = f"{results}/cpu_dispatch_{tag}_2t_tuned.json"
    dispatch_tiny = f"{results}/cpu_dispatch_{tag}_tiny_2t_tuned.json"
    out: list[Step] = [
        bench(""),
        Step("profile", _script("moe_profile", "--dtypes", *dtypes, "--json", profile), (profile,)),
        Step("native_ops", _script("native_ops", "--json", native), (native,)),
        *[_throughput("tiny", tag, dt, results) for dt in reversed(dtypes)],
        bench("_run2"),
        *[_throughput("paper", tag, dt, results) for dt in reversed(dtypes)],
        Step("generate", _script("generate_throughput", "--threads", "2", "--repeats", "11", "--new-tokens", "96",
                                 "--json", generate), (generate,)),
        Step("thin", _script("thin_experts", "--dtypes", *dtypes, "--json", thin), (thin,)),
        Step("dispatch", _script("cpu_dispatch", "--measure", "--threads", "2", "--dtypes", *dtypes, "--layers",
                                 *LAYERS, "--json", dispatch), (dispatch,)),
        Step("dispatch_tiny", _script("cpu_dispatch", "--measure", "--threads", "2", "--dtypes", *dtypes, "--layers",
                                      *TINY_LAYERS, "--json", dispatch_tiny),
             (dispatch_tiny,)),
    ]
    if results == RESULTS:
        out.append(Step("table", _script("cpu_dispatch", "--table"), ()))
    if isa in NATIVE_BF16:  # the loop's own bf16 kernel: the dot product (avx512_bf16) or AMX tiles
        layers, models = f"{results}/expert_gemm_{tag}_2t.json", f"{results}/expert_gemm_models_{tag}_2t.json"
        out += [Step("expert_gemm", _script("expert_gemm", "--threads", "2", "--json", layers), (layers,)),
                Step("expert_gemm_models", _script("expert_gemm", "--threads", "2", "--presets", "tiny-mh2", "tiny-mh3",
                                                  "--rounds", "10", "--json", models), (models,))]
    return out


def _environment() -> dict[str, str]:
    env = dict(os.environ, MHMOE_MALLOC="tuned", OMP_NUM_THREADS="2")  # `mhmoe bench` takes torch's default threads
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p)
    return env


def run(steps: list[Step], skip_existing: bool) -> int:
    """Run the steps in order (each in the checkout's root); 1 if any failed, else 0."""
    failed = []
    for step in steps:
        if skip_existing and step.outputs and all((ROOT / p).is_file() for p in step.outputs):
            print(f"cpu_suite: {step.name}: skipped ({', '.join(step.outputs)} exist)", flush=True)
            continue
        print(f"cpu_suite: {step.name}: {' '.join(step.argv)}", flush=True)
        start = time.perf_counter()
        rc = subprocess.run([sys.executable, *step.argv], cwd=ROOT, env=_environment(), check=False).returncode
        print(f"cpu_suite: {step.name}: exit {rc} after {time.perf_counter() - start:.0f} s", flush=True)
        if rc:
            failed.append(step.name)
    if failed:
        print(f"cpu_suite: failed: {' '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    from mhmoe.runtime.cpu import ISA_NAMES, cpu_isa

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--isa", choices=sorted(TAGS), help="plan for this ISA instead of this CPU's (with --dry-run)")
    ap.add_argument("--steps", nargs="+", metavar="STEP", help="run only these steps (default: all, in order)")
    ap.add_argument("--out", default=RESULTS, metavar="DIR",
                    help="folder for the JSON files (relative: to the checkout); another than the default leaves the "
                         "checkout's results and auto's table as they are")
    ap.add_argument("--skip-existing", action="store_true", help="skip a step whose JSON files all exist")
    ap.add_argument("--dry-run", action="store_true", help="print the commands; run nothing")
    args = ap.parse_args(argv)
    isa = args.isa or cpu_isa()
    if args.isa and not args.dry_run and args.isa != cpu_isa():
        print(f"cpu_suite: error: --isa {args.isa} on a {cpu_isa()} CPU: only with --dry-run", file=sys.stderr)
        return 2
    results = args.out.rstrip("/") or "/"
    steps = steps_for(isa, results)
    if args.steps:
        unknown = sorted(set(args.steps) - {s.name for s in steps})
        if unknown:
            print(f"cpu_suite: error: unknown steps for {isa}: {' '.join(unknown)} (steps: "
                  f"{' '.join(s.name for s in steps)})", file=sys.stderr)
            return 2
        steps = [s for s in steps if s.name in args.steps]
    print(f"cpu_suite: {ISA_NAMES[isa]} CPU, results tagged {TAGS[isa]!r}", flush=True)
    if args.dry_run:
        for s in steps:
            print(f"MHMOE_MALLOC=tuned python {' '.join(s.argv)}")
        return 0
    (ROOT / results).mkdir(parents=True, exist_ok=True)
    return run(steps, args.skip_existing)


if __name__ == "__main__":
    sys.exit(main())
