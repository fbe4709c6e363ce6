"""What activation checkpointing (``train.activation_checkpointing``, :mod:`mhmoe.model.recompute`) saves and
costs: per preset and mode (none, moe, blocks), the memory a training forward keeps for the backward and the time
of forward + backward.

- ``held MiB``: bytes allocated by the forward and still held when the backward starts -- on a CPU by glibc's own
  count (:func:`mhmoe.runtime.cpu_malloc.held_bytes`), on CUDA by ``torch.cuda.memory_allocated``; the weights,
  gradients and optimizer state are not in it (they are the same in every mode).
- ``peak MiB`` (CUDA only): the most allocated during the forward and backward above what was allocated before.
- ``fwd+bwd ms``: the median over ``--rounds`` rounds, the modes of one preset timed round-robin in one process
  after a warm-up step each, so that whatever else the machine does slows them alike.

The loss is computed as training does (``return_logits=False``: the LM head in row chunks on a CPU), so the
logits are not in the count. Prints a markdown table; ``--json PATH`` writes the rows and the machine::

    MHMOE_MALLOC=tuned python benchmarks/activation_memory.py --json benchmarks/results/activation_memory_cpu.json
    python benchmarks/activation_memory.py --device cuda --dtypes bfloat16 --batch-size 16 --seq-len 1024
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from mhmoe.config.presets import get_preset
from mhmoe.model import build_model
from mhmoe.model.recompute import set_activation_checkpointing
from mhmoe.research.timing import machine_info
from mhmoe.runtime.cpu_malloc import held_bytes, malloc_from_env
from mhmoe.runtime.device import autocast_ctx

MODES = ("none", "moe", "blocks")
DEFAULT_PRESETS = ("paper-dense", "paper-smoe", "paper-mh3")


def allocated(device: torch.device) -> int:
    """Bytes of tensor memory allocated now on ``device`` (CPU: everything malloc holds)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    held = held_bytes()
    if held is None:
        raise SystemExit("activation_memory.py: needs glibc's mallinfo2 on a CPU (no tcmalloc/jemalloc preloaded)")
    return held


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step(model: torch.nn.Module, idx: torch.Tensor, device: torch.device, dtype: str) -> dict[str, float]:
    """One forward + backward: MiB held between them, CUDA peak MiB, seconds."""
    model.zero_grad(set_to_none=True)
    gc.collect()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before, t0 = allocated(device), time.perf_counter()
    with autocast_ctx(device, dtype):
        out = model(idx, idx, return_logits=False)
    sync(device)
    held = allocated(device) - before
    (out.loss + out.aux_loss).backward()
    sync(device)
    seconds = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated(device) - before) / 2**20 if device.type == "cuda" else None
    return {"held_mib": held / 2**20, "peak_mib": peak, "s": seconds}


def measure(preset: str, dtype: str, args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    """The modes of ``preset`` round-robin (``moe`` only where the model has MoE blocks): one row per mode."""
    run = get_preset(preset).with_overrides([f"model.vocab_size={args.vocab}",
                                             f"model.max_seq_len={args.seq_len}", f"train.seq_len={args.seq_len}",
                                             *args.set])
    torch.manual_seed(0)
    model = build_model(run.model).to(device).train()
    idx = torch.randint(0, args.vocab, (args.batch_size, args.seq_len), device=device)
    modes = [m for m in MODES if m != "moe" or set_activation_checkpointing(model, m)]
    samples: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for r in range(args.rounds + 1):  # round 0 warms up
        for mode in modes:
            set_activation_checkpointing(model, mode)
            s = step(model, idx, device, dtype)
            if r:
                samples[mode].append(s)
    rows = []
    for mode in modes:
        s = samples[mode]
        rows.append({"preset": preset, "dtype": dtype, "mode": mode, "tokens": args.batch_size * args.seq_len,
                     "held_mib": statistics.median(x["held_mib"] for x in s),
                     "peak_mib": None if s[0]["peak_mib"] is None else max(x["peak_mib"] for x in s),
                     "ms": 1e3 * statistics.median(x["s"] for x in s)})
    base = rows[0]
    for row in rows:
        row["held_vs_none"] = row["held_mib"] / base["held_mib"]
        row["time_vs_none"] = row["ms"] / base["ms"]
    del model
    gc.collect()
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    peak = any(r["peak_mib"] is not None for r in rows)
    head = "| preset | dtype | mode | held MiB | held vs none |" + (" peak MiB |" if peak else "") + \
        " fwd+bwd ms | time vs none |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        cells = [r["preset"], r["dtype"], r["mode"], f"{r['held_mib']:,.0f}", f"{r['held_vs_none']:.2f}"]
        if peak:
            cells.append(f"{r['peak_mib']:,.0f}")
        cells += [f"{r['ms']:,.0f}", f"{r['time_vs_none']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--presets", nargs="+", default=list(DEFAULT_PRESETS), help="presets (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per step (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (default: %(default)s)")
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary size (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds after a warm-up (default: %(default)s)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    p.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16", "float16"],
                   help="autocast dtypes, each timed on its own (default: %(default)s)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default; default: %(default)s)")
    p.add_argument("--set", action="append", default=[], help="config override for every preset, e.g. "
                   "model.moe.impl=sorted (repeatable)")
    p.add_argument("--json", type=Path, help="write the rows and the machine to this file")
    args = p.parse_args(argv)
    malloc_from_env()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = [row for preset in args.presets for dtype in args.dtypes for row in measure(preset, dtype, args, device)]
    machine = machine_info(device)
    print(table(rows))
    print(f"\n{args.batch_size} x {args.seq_len} tokens, vocab {args.vocab}; {machine['cpu']} "
          f"({machine['isa']}), {machine['threads']} threads, torch {machine['torch']}, device {machine['device']}")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "settings": {k: v for k, v in vars(args).items()
                                                                          if k != "json"}, "rows": rows},
                                        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
