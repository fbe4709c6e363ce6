"""What making a checkpoint durable costs: ``save_checkpoint`` of a paper-mh3-sized model (weights, AdamW
moments, tokenizer) with the fsyncs of ``mhmoe.runtime.files`` (every file and directory before the
rename that publishes the checkpoint, the parent after it) and with ``MHMOE_FSYNC=0``::

    python benchmarks/checkpoint_fsync.py --json benchmarks/results/checkpoint_fsync.json

The two settings alternate (round robin, ``--repeats`` each), every save into a fresh run directory on
the same file system as ``--dir``, and before each save the page cache of the previous one is written
back (``sync``), so neither setting pays for the other's dirty pages. Reported: the checkpoint's size,
the median seconds of each setting, the time spent inside ``fsync`` during the durable saves, and the
overhead. (Without fsync the kernel still writes the pages back, in the background or, past its dirty
limit, by slowing the writer down; on a shared virtual disk the two settings vary run to run.)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from mhmoe.checkpoint.write import save_checkpoint
from mhmoe.config.presets import get_preset
from mhmoe.data.tokenizer import ByteTokenizer
from mhmoe.model import build_model
from mhmoe.runtime import files
from mhmoe.runtime.cpu import cpu_info
from mhmoe.runtime.files import FSYNC_ENV
from mhmoe.train.optim import build_optimizer


def trainer_state(model: torch.nn.Module, run) -> dict:
    """What a real checkpoint holds: the AdamW state after one step (two moments per parameter)."""
    opt = build_optimizer(model, run.train)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    return {"step": 1, "nan_total": 0, "tokens_seen": 0, "train_s": 0.0, "optimizer": opt.state_dict(),
            "rng_cpu": torch.get_rng_state()}


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="paper-mh3")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory under /tmp)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    run = get_preset(args.preset)
    model = build_model(run.model)
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.preset}: {params / 1e6:.1f}M parameters; building the optimizer state...", file=sys.stderr)
    state = trainer_state(model, run)
    root = Path(tempfile.mkdtemp(prefix="mhmoe-fsync-", dir=args.dir))
    times: dict[str, list[float]] = {"fsync": [], "no_fsync": []}
    in_fsync: list[float] = []  # seconds spent inside os.fsync during each durable save
    real_fsync = files.os.fsync

    def timed_fsync(fd: int) -> None:
        t = time.perf_counter()
        real_fsync(fd)
        in_fsync[-1] += time.perf_counter() - t

    files.os.fsync = timed_fsync
    size = 0
    try:
        for i in range(args.repeats):
            for setting in ("fsync", "no_fsync"):
                os.environ[FSYNC_ENV] = "1" if setting == "fsync" else "0"
                out = root / f"{setting}-{i}"
                os.sync()  # write back the previous save's pages first
                in_fsync.append(0.0)
                t0 = time.perf_counter()
                ck = save_checkpoint(out, 1, model, run, ByteTokenizer(), state)
                times[setting].append(time.perf_counter() - t0)
                size = dir_bytes(ck)
                print(f"  {setting:9s} repeat {i}: {times[setting][-1]:.2f} s", file=sys.stderr)
                shutil.rmtree(out)
    finally:
        files.os.fsync = real_fsync
        os.environ.pop(FSYNC_ENV, None)
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "preset": args.preset, "params": params, "checkpoint_bytes": size,
        "seconds_fsync": med["fsync"], "seconds_no_fsync": med["no_fsync"],
        "overhead_s": med["fsync"] - med["no_fsync"], "overhead_ratio": med["fsync"] / med["no_fsync"],
        "seconds_in_fsync": statistics.median(in_fsync[0::2]), "runs": times,
        "runs_seconds_in_fsync": in_fsync[0::2], "repeats": args.repeats,
        "machine": {"cpu": cpu_info()[0], "cores": os.cpu_count(), "platform": platform.platform(),
                    "torch": torch.__version__, "file_system": _fs(root.parent)},
        "command": "python benchmarks/checkpoint_fsync.py " + " ".join(argv or sys.argv[1:]),
        "date": datetime.date.today().isoformat(),
    }
    print(f"{args.preset}: checkpoint {size / 2**30:.2f} GiB; save {med['fsync']:.2f} s with fsync "
          f"({result['seconds_in_fsync']:.2f} s inside fsync), {med['no_fsync']:.2f} s without "
          f"({result['overhead_ratio']:.2f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


def _fs(path: Path) -> str:
    """The file system type and device of ``path`` (from /proc/mounts), for the record."""
    try:
        mounts = [ln.split() for ln in Path("/proc/mounts").read_text().splitlines()]
        best = max((m for m in mounts if str(path.resolve()).startswith(m[1])), key=lambda m: len(m[1]))
        return f"{best[2]} on {best[0]}"
    except (OSError, ValueError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
