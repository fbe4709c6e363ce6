"""One GPU lease, one command: the steps whose answers matter most first, each capped by the time left.

    bash benchmarks/gpu_lease.sh 570             # part 1, inside a 600-second command on the GPU machine
    bash benchmarks/gpu_lease.sh 150 --part 2    # part 2 (what part 1 leaves out), right after part 1
    bash benchmarks/gpu_lease.sh 300 --dry-run   # the same steps on the CPU, tiny shapes (CI runs this)
    python benchmarks/gpu_lease.py --plan        # the steps and their predicted seconds; nothing runs

Part 1: ``machine`` (versions, the GPU, and the plan: every step's predicted seconds from counted Triton
compiles, benchmarks/gpu_lease_plan.py), ``bench_mh3`` (the bf16 MoE layer benchmark of MH-MoE h=3 at 16,384
tokens: our paths, the aligned same-FLOPs dense FFN, the GEMM floor, transformers' grouped_mm and eager
backends; fwd and fwd+bwd), ``train`` (whole-model tokens/s and MFU: paper-dense, paper-mh3, paper-mh3 on the
Triton path), ``gpu_tests`` (the sync-free ``pytest -m gpu`` tests), ``bench_parity`` (the other parity
configurations), ``science`` (``mhmoe reproduce decisive`` with whatever time is left). Part 2:
``machine``, ``gpu_tests_rest`` (every other gpu test), ``triton_bench``, ``bench_fp32``, ``science``.

Every step runs in its own process group with a cap: a step whose prediction does not fit the time left is
skipped (the test steps, whose partial output counts, start with a third of it); a step's cap is twice its
prediction plus a minute, or what is left (the science step takes all that is left); a step past its cap
gets SIGTERM, then SIGKILL, and keeps what it wrote. Every output line goes to
``OUT/lease.log`` the moment it is printed (flushed line by line, so a killed command still returns it);
each step's JSON lands in OUT when it ends, and ``OUT/lease.json`` (plan and status of every step) is
rewritten after each step: at most 8 files in OUT. OUT is ``--out``, else ``$OUT``, else ``runs/gpu-lease``.
The steps share one Triton cache in the work directory (``--work``; default: a directory of this user under
the system's temp directory, kept, so a part 2 on the same machine reuses part 1's compiles).
No network and no install: the steps run from ``src`` (PYTHONPATH).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the step helpers next to this script (also when loaded from elsewhere)
    sys.path.insert(0, str(HERE))
import gpu_lease_steps as S  # noqa: E402  (standard library only at import: torch is imported by the steps)

MAX_FILES = 8  # what comes back from a lease's $OUT
END_RESERVE_S = 3.0  # kept at the end for the last lease.json
GRACE_S = 5.0  # SIGTERM -> SIGKILL
MIN_PARTIAL = 1 / 3  # a step with partial output starts with this fraction of its prediction left
PARTS = {1: ["machine", "bench_mh3", "train", "gpu_tests", "bench_parity", "science"],
         2: ["machine", "gpu_tests_rest", "triton_bench", "bench_fp32", "science"]}
PARTIAL = {"gpu_tests", "gpu_tests_rest"}  # their partial output counts: they start with a third of their prediction
TAKES_REST = {"science"}  # capped only by the time left (it starts with its whole prediction left)
ABOUT = {"machine": "versions, the GPU, the plan", "bench_mh3": "MoE layer, mh3 bf16, 16k tokens",
         "train": "whole models: tokens/s, MFU", "gpu_tests": "sync-free gpu tests",
         "bench_parity": "MoE layer, smoe/fgmoe/mh2 bf16", "science": "reproduce decisive",
         "gpu_tests_rest": "the other gpu tests", "triton_bench": "Triton kernels vs grouped_mm/sorted",
         "bench_fp32": "MoE layer, fp32"}
# predicted seconds when the machine step could not count compiles (its counts on a CPU, rounded up)
FALLBACK_S = {"machine": 30, "bench_mh3": 120, "train": 110, "gpu_tests": 120, "bench_parity": 180,
              "science": 120, "gpu_tests_rest": 280, "triton_bench": 120, "bench_fp32": 110}
DRY_S = {"science": 30}  # dry run: every other step is predicted at DRY_DEFAULT_S
DRY_DEFAULT_S = 20.0  # tiny shapes take ~5 s of CPU a step; a loaded CI machine may stretch that
SYNC_TESTS = "never_wait or no_host_sync or never_synchronises"
GPU_TEST_FILES = ["tests/moe/test_cuda_paths.py", "tests/moe/test_triton_dispatch.py",
                  "tests/moe/test_triton_router.py", "tests/train/test_cuda_training.py",
                  "tests/train/test_progress.py"]

# ---- THE SCIENCE STEP: the one place to adjust it ---------------------------------------------------------
SCIENCE_BUNDLE = ".lease/bundle"  # the data bundle the lease carries (git-ignored; absent: the step is skipped)
SCIENCE_OVERHEAD_S = 60.0  # what --minutes does not cover: start-up, final evaluation, the results


def science_command(py: str, suite_dir: Path, minutes: float, device: str) -> list[str]:
    """The science step (``mhmoe reproduce decisive`` on the bundled corpus); ``minutes``: what is left."""
    return [py, "-m", "mhmoe", "reproduce", "decisive", "--device", device, "--minutes", f"{minutes:g}",
            "--data", "debdocs", "--set", f"data.bundle={SCIENCE_BUNDLE}", "--out", str(suite_dir),
            "--no-progress"]
# ------------------------------------------------------------------------------------------------------------


def file_name(step: str, part: int) -> str:
    """The JSON a step writes into OUT (part 2's files carry ``-part2``, so both parts fit one folder)."""
    base = {"machine": "versions", "gpu_tests": "gpu_tests", "gpu_tests_rest": "gpu_tests_rest"}.get(step, step)
    return f"{base}.json" if part == 1 else f"{base}-part{part}.json"


def log_name(part: int) -> str:
    return "lease.log" if part == 1 else f"lease-part{part}.log"


def summary_name(part: int) -> str:
    return "lease.json" if part == 1 else f"lease-part{part}.json"


@dataclass
class Ctx:
    """Where and how the steps run."""

    out: Path
    work: Path
    part: int
    dry: bool
    py: str = sys.executable
    env: dict = field(default_factory=dict)

    @property
    def device(self) -> str:
        return "cpu" if self.dry else "cuda"


@dataclass
class Planned:
    """One step as scheduled: its command (None: skipped, ``reason`` says why), prediction and output file."""

    name: str
    file: str
    cmd: list[str] | None
    predicted_s: float
    partial: bool = False
    takes_rest: bool = False
    reason: str = ""
    post: str = ""  # "pytest" | "science" | "": how the driver turns the step's output into its JSON


def _steps_script(ctx: Ctx, *args: str) -> list[str]:
    return [ctx.py, str(HERE / "gpu_lease_steps.py"), *args, *(["--dry-run"] if ctx.dry else [])]


def command(step: str, ctx: Ctx, plan_steps: list[str]) -> tuple[list[str] | None, str, str]:
    """(command, post-processing, why skipped) of ``step``; the science step's command is built at its start."""
    out = str(ctx.out / file_name(step, ctx.part))
    if step == "machine":
        return _steps_script(ctx, "machine", "--json", out, "--plan-steps", *plan_steps), "", ""
    if step in ("bench_mh3", "bench_parity", "bench_fp32"):
        configs = {"bench_mh3": ["mh3"], "bench_parity": ["smoe", "fgmoe", "mh2"],
                   "bench_fp32": ["mh3", "smoe", "fgmoe", "mh2"]}[step]
        dtype = "float32" if step == "bench_fp32" else "bfloat16"
        return _steps_script(ctx, "bench", "--configs", *configs, "--dtype", dtype, "--json", out), "", ""
    if step == "train":
        return _steps_script(ctx, "train", "--json", out), "", ""
    if step in ("gpu_tests", "gpu_tests_rest"):
        sel = SYNC_TESTS if step == "gpu_tests" else f"not ({SYNC_TESTS})"
        files = GPU_TEST_FILES if step == "gpu_tests" else ["tests"]
        return [ctx.py, "-m", "pytest", "-v", "-m", "gpu", "-k", sel, "-p", "no:cacheprovider", *files,
                "--junitxml", str(ctx.work / f"{step}.xml")], "pytest", ""
    if step == "triton_bench":
        if ctx.dry:
            return None, "", "needs CUDA (benchmarks/triton_moe.py --bench): not part of the dry run"
        return [ctx.py, str(HERE / "triton_moe.py"), "--bench", "--json", out], "", ""
    if step == "science":
        if not (ROOT / SCIENCE_BUNDLE).is_dir():
            return None, "science", f"no data bundle at {SCIENCE_BUNDLE} (build it on a CPU, carry it with the lease)"
        if ctx.dry:  # minutes of CPU training: the dry run shows the command instead
            cmd = science_command("python3", Path("WORK") / "science", 0.0, "cuda")
            cmd[cmd.index("--minutes") + 1] = "M"
            return None, "science", "dry run: not run; on the GPU: " + " ".join(cmd)
        return [], "science", ""
    raise ValueError(f"unknown step {step!r}")


def build_plan(ctx: Ctx, steps: list[str], predicted: dict[str, float]) -> list[Planned]:
    plan = []
    for s in steps:
        cmd, post, reason = command(s, ctx, steps)
        plan.append(Planned(s, file_name(s, ctx.part), cmd, predicted.get(s, FALLBACK_S.get(s, 60)),
                            s in PARTIAL, s in TAKES_REST, reason, post))
    return plan


# ---- running ----------------------------------------------------------------------------------------------
class Log:
    """The running log: every line into OUT's log file (flushed at once) and to stdout, with the elapsed time."""

    def __init__(self, path: Path, t0: float) -> None:
        self.f = open(path, "a", encoding="utf-8", buffering=1)
        self.t0, self.lock = t0, threading.Lock()

    def __call__(self, line: str, step: str = "lease") -> None:
        text = f"[{time.monotonic() - self.t0:6.1f}s {step}] {line.rstrip()}"
        with self.lock:
            self.f.write(text + "\n")
            self.f.flush()
            print(text, flush=True)

    def close(self) -> None:
        self.f.close()


def _kill(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM the step's process group, SIGKILL it after ``grace`` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_capped(name: str, cmd: list[str], cap_s: float, log: Log, env: dict, cwd: Path = ROOT,
               grace: float = GRACE_S) -> dict:
    """Run ``cmd`` with its output streamed into the log; SIGTERM at ``cap_s`` - ``grace``, SIGKILL at ``cap_s``.
    Returns {"rc", "timed_out", "seconds", "lines"} (lines: the step's output, for the post-processing)."""
    t0 = time.monotonic()
    lines: list[str] = []
    try:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, text=True, errors="replace",
                                bufsize=1)
    except OSError as exc:
        log(f"could not start: {exc}", name)
        return {"rc": 127, "timed_out": False, "seconds": 0.0, "lines": lines}

    def pump() -> None:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            log(line, name)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(max(0.1, cap_s - grace))
    except subprocess.TimeoutExpired:
        timed_out = True
        log(f"cap of {cap_s:.0f} s reached: stopping the step (SIGTERM, SIGKILL after {grace:g} s)", name)
        _kill(proc, grace)
    try:  # whatever the step left running in its group (compile workers, say) must not outlive it
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    reader.join(5)
    return {"rc": proc.returncode, "timed_out": timed_out, "seconds": round(time.monotonic() - t0, 1),
            "lines": lines}


def cap_for(p: Planned, left: float) -> float:
    """A step's cap: twice its prediction plus a minute (predictions are estimates), never more than is left;
    the science step gets all that is left."""
    return left if p.takes_rest else min(left, 2 * p.predicted_s + 60)


def run_steps(plan: list[Planned], ctx: Ctx, deadline: float, log: Log, on_step=None) -> list[dict]:
    """Run the plan in order within ``deadline`` (time.monotonic()); one status dict per step."""
    results = []
    for i, p in enumerate(plan):
        left = deadline - time.monotonic()
        need = p.predicted_s * (MIN_PARTIAL if p.partial else 1.0)
        status = {"step": p.name, "file": p.file, "predicted_s": round(p.predicted_s, 1), "left_s": round(left, 1)}
        if p.cmd is None:
            status |= {"status": "skipped", "reason": p.reason}
        elif left < need:
            status |= {"status": "skipped", "reason": f"needs ~{need:.0f} s, {max(left, 0):.0f} s left"}
        else:
            cap = cap_for(p, left)
            cmd = p.cmd if p.post != "science" else science_cmd(ctx, cap)
            log(f"start: cap {cap:.0f} s, predicted {p.predicted_s:.0f} s: {' '.join(cmd)}", p.name)
            r = run_capped(p.name, cmd, cap, log, ctx.env, grace=30.0 if p.post == "science" else GRACE_S)
            ok = r["rc"] == 0 and not r["timed_out"]
            status |= {"status": "ok" if ok else ("timed_out" if r["timed_out"] else "failed"), "rc": r["rc"],
                       "seconds": r["seconds"], "cap_s": round(cap, 1)}
            try:
                post_process(p, ctx, r["lines"], status)
            except Exception as exc:  # a broken result must not cost the next steps
                log(f"could not write {p.file}: {type(exc).__name__}: {exc}", p.name)
            if p.name == "machine":
                replan(plan[i + 1:], ctx, log)
        if status["status"] == "skipped":
            log(f"skipped: {status['reason']}", p.name)
        else:
            log(f"{status['status']} (rc {status['rc']}) in {status['seconds']:.0f} s, predicted "
                f"{p.predicted_s:.0f} s, cap {status['cap_s']:.0f} s", p.name)
        results.append(status)
        if on_step:
            on_step(results)
    return results


def science_cmd(ctx: Ctx, cap: float) -> list[str]:
    minutes = max(0.1, int(10 * (cap - SCIENCE_OVERHEAD_S - 30) / 60) / 10)  # 30 s: the SIGTERM grace
    return science_command(ctx.py, ctx.work / "science", minutes, ctx.device)


def replan(rest: list[Planned], ctx: Ctx, log: Log) -> None:
    """After the machine step: its counted plan replaces the fallback predictions (GPU runs only)."""
    try:
        info = json.loads((ctx.out / file_name("machine", ctx.part)).read_text(encoding="utf-8"))
        plan = info["plan"]
    except (OSError, ValueError, KeyError, TypeError):
        log("no plan from the machine step: fallback predictions", "lease")
        return
    if ctx.dry:
        return
    for p in rest:
        if p.name in plan:
            p.predicted_s = float(plan[p.name]["predicted_s"])


# ---- turning a step's output into its JSON ------------------------------------------------------------------
def post_process(p: Planned, ctx: Ctx, lines: list[str], status: dict) -> None:
    """Write the JSON of a step whose command does not write its own (pytest, the science step)."""
    if p.post == "pytest":
        summary = S.junit_summary(ctx.work / f"{p.name}.xml") or S.pytest_lines_summary(lines)
    elif p.post == "science":
        summary = S.collect_science(ctx.work / "science")
    else:
        return
    (ctx.out / p.file).write_text(json.dumps(summary | {"status": status}, indent=1), encoding="utf-8")


# ---- the command ------------------------------------------------------------------------------------------
def work_dir(path: str | None, dry: bool) -> Path:
    """The work directory (Triton cache, pytest XML, the science suite). Default: GPU runs keep one directory
    per user under the temp directory (a second part on the same machine reuses the compiles); dry runs a
    fresh one. A default directory that is a symlink or someone else's is not used."""
    if path:
        p = Path(path)
        p.mkdir(parents=True, exist_ok=True)
        return p
    if dry:
        return Path(tempfile.mkdtemp(prefix="mhmoe-gpu-lease-dry-"))
    p = Path(tempfile.gettempdir()) / f"mhmoe-gpu-lease-{os.getuid()}"
    try:
        p.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(p)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
            return p
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="mhmoe-gpu-lease-"))


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def step_env(ctx: Ctx, log: Log, wheels: Path = ROOT / ".lease" / "wheels") -> dict:
    """The steps' environment: src on PYTHONPATH, compiled kernels on a GPU (the interpreter in a dry run), one
    Triton cache, unbuffered output; with filelock < 4 (the run-directory lock needs 4), a filelock wheel
    carried in .lease/wheels goes first on the path."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    paths = [str(ROOT / "src")]
    fl = _version("filelock")
    if fl is None or int(fl.split(".")[0]) < 4:
        found = sorted(wheels.glob("filelock-4*.whl"))
        if found:
            paths.insert(0, str(found[-1]))
            log(f"filelock {fl} < 4: using {found[-1].name} (from .lease/wheels)")
        else:
            log(f"filelock {fl} < 4 and no filelock-4 wheel in .lease/wheels (`make lease-wheels`): training "
                "steps will stop at the run-directory lock")
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env |= {"TRITON_CACHE_DIR": str(ctx.work / "triton"), "TRITON_CACHE_AUTOTUNING": "1", "PYTHONUNBUFFERED": "1",
            "MHMOE_CACHE": str(ctx.work / "mhmoe-cache"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if ctx.dry:  # one thread: tiny shapes on a small shared CI machine (OpenMP's spinning threads cost more)
        env |= {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    return env


def print_plan(plan: list[Planned], log: Log, title: str) -> None:
    log(title)
    total = 0.0
    for p in plan:
        total += p.predicted_s if p.cmd is not None else 0
        note = f"skipped: {p.reason}" if p.cmd is None else ABOUT.get(p.name, "")
        log(f"  {p.name:15s} predicted {p.predicted_s:5.0f} s, cumulative {total:5.0f} s  {note}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("seconds", nargs="?", type=float, help="the time this command may take, in seconds "
                    "(the run tool's timeout_s less ~30 s)")
    ap.add_argument("--part", type=int, default=1, choices=sorted(PARTS), help="which list of steps (default: 1)")
    ap.add_argument("--steps", nargs="+", choices=sorted(FALLBACK_S), metavar="STEP",
                    help="run these steps instead of the part's (files named as for --part)")
    ap.add_argument("--dry-run", action="store_true", help="on the CPU with tiny shapes (also: DEVICE=cpu)")
    ap.add_argument("--out", help="output folder, empty or new (default: $OUT, else runs/gpu-lease)")
    ap.add_argument("--work", help="work folder: Triton cache, test XML, the science suite (default: see above)")
    ap.add_argument("--plan", action="store_true", help="print the steps' predicted seconds on an H100 and exit")
    ap.add_argument("--json", metavar="PATH", help="--plan: also write the plan as JSON")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    t0 = time.monotonic()
    args = parse_args(argv)
    steps = args.steps or PARTS[args.part]
    if args.plan:
        return _print_gpu_plan(steps, args.part, args.json)
    if args.seconds is None or args.seconds <= END_RESERVE_S:
        print("gpu_lease: error: SECONDS (> 3) is required, e.g. 570 inside a 600-second command", file=sys.stderr)
        return 2
    dry = args.dry_run or os.environ.get("DEVICE", "").lower() == "cpu"
    out = Path(args.out or os.environ.get("OUT") or ROOT / "runs" / "gpu-lease")
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        print(f"gpu_lease: error: {out} is not empty (choose another --out)", file=sys.stderr)
        return 2
    ctx = Ctx(out=out, work=work_dir(args.work, dry), part=args.part, dry=dry)
    log = Log(out / log_name(args.part), t0)
    ctx.env = step_env(ctx, log)
    deadline = t0 + args.seconds - END_RESERVE_S
    predicted = {s: DRY_S.get(s, DRY_DEFAULT_S) for s in steps} if dry else dict(FALLBACK_S)
    plan = build_plan(ctx, steps, predicted)
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    head = {"part": args.part, "dry_run": dry, "seconds": args.seconds, "started": started, "out": str(out),
            "work": str(ctx.work), "triton_cache": ctx.env["TRITON_CACHE_DIR"]}
    log(f"gpu lease part {args.part}{' (dry run, CPU)' if dry else ''}: {args.seconds:.0f} s, out {out}, "
        f"work {ctx.work}")
    print_plan(plan, log, "fallback plan (the machine step counts the compiles):" if not dry else "dry-run plan:")

    def write_summary(results: list[dict]) -> None:
        doc = head | {"plan": [asdict(p) | {"cmd": p.cmd} for p in plan], "steps": results,
                      "elapsed_s": round(time.monotonic() - t0, 1)}
        (out / summary_name(args.part)).write_text(json.dumps(doc, indent=1), encoding="utf-8")

    def on_step(results: list[dict]) -> None:
        write_summary(results)
        if results[-1]["step"] == "machine":
            print_plan(plan[1:], log, "plan from counted compiles (H100 estimates):" if not dry else
                       "dry-run plan (the machine step's GPU plan is in its JSON):")

    results = run_steps(plan, ctx, deadline, log, on_step)
    write_summary(results)
    files = sorted(p.name for p in out.iterdir())
    log(f"done in {time.monotonic() - t0:.0f} s; {len(files)} files in {out}: {', '.join(files)}")
    if len(files) > MAX_FILES:
        log(f"WARNING: more than {MAX_FILES} files: a lease brings back only {MAX_FILES}")
    for r in results:
        log(f"  {r['step']:15s} {r['status']:9s} {r.get('seconds', 0):5.0f} s (predicted {r['predicted_s']:.0f})"
            + (f"  {r['reason']}" if r.get("reason") else ""))
    log.close()
    return 0 if all(r["status"] in ("ok", "skipped") for r in results) else 1


def _print_gpu_plan(steps: list[str], part: int, json_path: str | None) -> int:
    """--plan: count the compiles here (needs torch and triton; no GPU) and print the schedule."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    r = subprocess.run([sys.executable, str(HERE / "gpu_lease_plan.py"), *steps], env=env, capture_output=True,
                       text=True)
    if r.returncode:
        print(r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "gpu_lease_plan failed", file=sys.stderr)
        return 1
    plan, total = json.loads(r.stdout), 0.0
    print("| step | compiles | autotuner timings | compile s | other s | predicted s | cumulative s |")
    print("|---|---|---|---|---|---|---|")
    for s in steps:
        p = plan[s]
        total += p["predicted_s"]
        print(f"| {s} | {p['compiles']} | {p['tunings']} | {p['compile_s']:.0f} | {p['run_s']:.0f} | "
              f"{p['predicted_s']:.0f} | {total:.0f} |")
        p["cumulative_s"] = round(total)
    if json_path:
        Path(json_path).write_text(json.dumps({"part": part, "steps": plan}, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
