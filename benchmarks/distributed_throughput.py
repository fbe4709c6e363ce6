"""Training throughput of 1 vs 2 processes on CPU (gloo): DDP, FSDP2 and DDP + expert parallelism.

Every process runs one thread (``torch.set_num_threads(1)``), so "2 processes" uses two cores where
"1 process" uses one -- the fair comparison on a 2-core machine. Each rank trains on its own random
``batch_size x seq_len`` micro-batch (weak scaling: the global batch doubles with 2 processes); one
step = forward + backward + gradient sync + clipping + AdamW, as in :func:`mhmoe.train.train`.
tokens/s = global tokens per step / median step time over ``--steps`` timed steps (after ``--warmup``).

The all-to-all volume is what one rank sends to the other rank per optimizer step in the expert
all-to-alls (routed rows there and results back, forward and backward; the backward mirrors the
forward), plus the split-size exchange; gradient all-reduce traffic (DDP) is not included::

    python benchmarks/distributed_throughput.py                       # tiny-smoe, table + JSON
    python benchmarks/distributed_throughput.py --preset tiny-mh3 --steps 20 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mhmoe.config.presets import get_preset
from mhmoe.errors import ConfigError
from mhmoe.model.lm import LM
from mhmoe.train.optim import build_optimizer

MODES = {  # name -> (processes, parallel mode, ep)
    "1 process": (1, "none", 1),
    "2 proc DDP": (2, "ddp", 1),
    "2 proc FSDP2": (2, "fsdp", 1),
    "2 proc DDP+EP2": (2, "ddp", 2),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, mode: str, ep: int, args: argparse.Namespace, out_path: str) -> None:
    torch.set_num_threads(1)
    run = get_preset(args.preset).with_overrides([f"model.vocab_size={args.vocab}"])
    torch.manual_seed(0)
    model = LM(run.model)
    par = None
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
        from mhmoe.parallel.data_parallel import parallelize
        from mhmoe.parallel.env import init_distributed
        from mhmoe.parallel.expert_parallel import a2a_bytes

        par = parallelize(model, init_distributed("cpu", ep), mode)
    opt = build_optimizer(model, run.train)
    fwd = model if par is None else par.module
    g = torch.Generator().manual_seed(rank)
    times, volumes = [], []
    for i in range(args.warmup + args.steps):
        x = torch.randint(0, args.vocab, (args.batch_size, args.seq_len + 1), generator=g)
        if par is not None:
            dist.barrier()
            a2a_bytes(model, reset=True)
        t0 = time.perf_counter()
        out = fwd(x[:, :-1], x[:, 1:])
        (out.loss + out.aux_loss).backward()
        if par is None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        else:
            par.finish_grads()
            par.clip_grad_norm(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        if par is not None:
            t = torch.tensor([dt], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step ends when the slowest rank is done
            dt = float(t)
        if i >= args.warmup:
            times.append(dt)
            volumes.append(2 * a2a_bytes(model) if par is not None else 0)  # backward mirrors the forward
    if rank == 0:
        step_s = statistics.median(times)
        tokens = world * args.batch_size * args.seq_len
        Path(out_path).write_text(json.dumps({"processes": world, "step_s": step_s, "tokens_per_step": tokens,
                                         "tokens_per_s": tokens / step_s,
                                         "a2a_bytes_per_step_per_rank": statistics.mean(volumes),
                                         "params": model.num_params() if par is None else None}))
    if par is not None:
        dist.destroy_process_group()


def run_mode(name: str, args: argparse.Namespace) -> dict[str, Any]:
    world, mode, ep = MODES[name]
    with tempfile.TemporaryDirectory() as td:
        out = str(Path(td) / "r.json")
        torch.multiprocessing.spawn(_worker, args=(world, _free_port(), mode, ep, args, out), nprocs=world, join=True)
        return {"mode": name, "parallel": mode, "ep": ep, **json.loads(Path(out).read_text())}


def format_table(rows: list[dict[str, Any]]) -> str:
    base = rows[0]["tokens_per_s"]
    lines = ["| mode | processes | tokens/step | step ms | tokens/s | speed-up | all-to-all bytes/step/rank |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['processes']} | {r['tokens_per_step']:,} | {1000 * r['step_s']:.1f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / base:.2f}x | "
                     f"{r['a2a_bytes_per_step_per_rank']:,.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny-smoe")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--modes", nargs="+", default=list(MODES), help=" | ".join(MODES))
    p.add_argument("--json", default="benchmarks/results/distributed_cpu_2core.json", metavar="PATH")
    p.add_argument("--note", default="", help="free text stored with the results (e.g. machine load)")
    args = p.parse_args(argv)
    bad = [m for m in args.modes if m not in MODES]
    if bad or min(args.batch_size, args.seq_len, args.steps, args.vocab) < 1 or args.warmup < 0:
        raise ConfigError("distributed_throughput", bad or vars(args), f"--modes from {list(MODES)}, positive sizes")
    if not (dist.is_available() and dist.is_gloo_available()):
        print("torch.distributed with gloo is not available", file=sys.stderr)
        return 2
    rows = []
    for name in args.modes:
        print(f"[bench] {name} ...", file=sys.stderr, flush=True)
        rows.append(run_mode(name, args))
    table = format_table(rows)
    print(table)
    meta = {"preset": args.preset, "batch_size_per_rank": args.batch_size, "seq_len": args.seq_len,
            "vocab": args.vocab, "steps": args.steps, "warmup": args.warmup, "threads_per_process": 1,
            "cpu_count": os.cpu_count(), "torch": torch.__version__, "note": args.note,
            "command": "python benchmarks/distributed_throughput.py " + " ".join(argv or sys.argv[1:])}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows, "table": table}, indent=2),
                                   encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
