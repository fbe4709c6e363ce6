"""Training throughput of the presets: tokens/s of one full optimizer step (forward + backward +
gradient clipping + fused AdamW that skips non-finite steps on the device + aux-free balance step, the
pieces :meth:`mhmoe.train.loop.Trainer.train_step` runs, with its loss scaling in float16 and the activation
checkpointing ``--set train.activation_checkpointing=`` names) on random token batches of the preset's
``batch_size x seq_len``. Every row reports the model's analytic forward FLOPs per token
(:func:`mhmoe.config.flops.model_flops_per_token`, the same for every execution path) and, on a GPU
whose bf16 peak is known (or with ``--peak-tflops``), the model FLOPs utilisation
MFU = 3 x FLOPs/token x tokens/s / peak.

Timing: the presets are built together and timed **round-robin** in one process: ``--warmup`` untimed
steps each, then ``--steps`` rounds in which every preset runs one step in turn; the median per preset (CUDA
steps are synchronised), split into forward + backward and the rest (clipping, optimizer, balance step).
``vs dense``: tokens/s over the same family's dense preset's (``tiny-mh3`` -> ``tiny-dense``) times the
ratio of FLOPs per token (1.00: the same FLOP rate); ``vs dense paired``: the median over the rounds of that
ratio from the two presets' steps of the same round (on a machine whose speed moves between rounds, the steps of
one round mostly see the same speed); ``fwd+bwd vs dense``: the same paired ratio of the forward + backward
times alone (without clipping, optimizer and balance step, whose cost grows with the parameter count). Prints
a markdown table and, with ``--json PATH``, writes the rows plus a ``machine`` object (CPU model and ISA,
threads, torch version, devices, load averages)::

    python benchmarks/train_throughput.py                                  # the 9 tiny-* presets
    python benchmarks/train_throughput.py --presets tiny-dense tiny-smoe tiny-mh3 --json bench.json
    python benchmarks/train_throughput.py --device cuda --dtype bfloat16 --presets paper-mh3
    python benchmarks/train_throughput.py --presets tiny-icml-mh4-8 --set model.moe.impl=sorted

``--device all`` (the default) runs on the CPU and, when one is available, on CUDA as well.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from mhmoe.config.flops import model_flops_per_token
from mhmoe.config.presets import get_preset, preset_names
from mhmoe.errors import ConfigError
from mhmoe.model.lm import LM
from mhmoe.model.recompute import set_activation_checkpointing
from mhmoe.research.timing import bf16_peak_tflops
from mhmoe.runtime.cpu_malloc import ENV as MALLOC_ENV
from mhmoe.runtime.cpu_malloc import malloc_from_env
from mhmoe.runtime.device import autocast_ctx
from mhmoe.train.loss_scale import LossScale
from mhmoe.train.optim import build_optimizer
from mhmoe.train.parallelism import SingleProcess

DEFAULT_PRESETS = [n for n in preset_names() if n.startswith("tiny-") and "-icml-" not in n and "-bitnet" not in n]


def machine_info(devices: list[str]) -> dict[str, Any]:
    from mhmoe.runtime.cpu import ISA_NAMES, cpu_info, cpu_isa

    info: dict[str, Any] = {
        "cpu": cpu_info()[0],
        "isa": ISA_NAMES[cpu_isa()],
        "loadavg": list(os.getloadavg()),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "malloc": os.environ.get(MALLOC_ENV) or "default",  # as given; main() applies MHMOE_MALLOC=tuned
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "devices": devices,
    }
    if "cuda" in devices:
        info["cuda_device"] = torch.cuda.get_device_name(0)
        info["cuda_version"] = torch.version.cuda
    return info


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prepare_preset(name: str, device: torch.device, dtype: str, batch_size: int | None = None,
                   seq_len: int | None = None, seed: int = 0, overrides: list[str] | None = None,
                   peak_tflops: float | None = None, batches: int = 4):
    """(step, row): ``step(i)`` runs one full optimizer step on batch ``i`` (of ``batches`` random ones) and returns
    its (total, forward + backward, clipping + optimizer + balance) seconds; ``row`` holds the preset's facts."""
    run = get_preset(name)
    sets = [f"train.dtype={dtype}", *(overrides or [])]
    if batch_size:
        sets.append(f"train.batch_size={batch_size}")
    if seq_len:
        sets += [f"train.seq_len={seq_len}"] + ([f"model.max_seq_len={seq_len}"]
                                                 if seq_len > run.model.max_seq_len else [])
    run = run.with_overrides(sets)
    cfg = run.train
    torch.manual_seed(seed)
    model = LM(run.model).to(device)
    set_activation_checkpointing(model, cfg.activation_checkpointing)  # --set train.activation_checkpointing=moe
    flops = model_flops_per_token(run.model, cfg.seq_len).total
    par = SingleProcess(device)
    opt = build_optimizer(model, cfg, fused=par.fused_optimizer)
    scale = LossScale(device, enabled=cfg.dtype == "float16")
    g = torch.Generator(device="cpu").manual_seed(seed)
    V, B, T = run.model.vocab_size, cfg.batch_size, cfg.seq_len
    data = [torch.randint(0, V, (B, T + 1), generator=g).to(device) for _ in range(batches)]
    model.train()

    def step(i: int) -> tuple[float, float, float]:
        batch = data[i % len(data)]
        _sync(device)
        t0 = time.perf_counter()
        with autocast_ctx(device, cfg.dtype):
            out = model(batch[:, :-1], batch[:, 1:], return_logits=False)  # as training does
        scale.scaled(out.loss + out.aux_loss).backward()
        _sync(device)
        t1 = time.perf_counter()
        scale.unscale_(model.parameters())
        gnorm = par.finish_grads(model, cfg.grad_clip or math.inf, torch.isfinite(out.loss + out.aux_loss))
        scale.update(torch.isfinite(gnorm))
        par.optimizer_step(opt, torch.isfinite(gnorm))
        opt.zero_grad(set_to_none=True)
        if out.routing:
            model.balance_step(out.routing, torch.isfinite(gnorm))
        _sync(device)
        t2 = time.perf_counter()
        return t2 - t0, t1 - t0, t2 - t1

    row = {"preset": name, "overrides": list(overrides or []), "device": device.type, "dtype": dtype,
           "params": model.num_params(), "fwd_flops_per_token": flops, "batch_size": B, "seq_len": T,
           "tokens_per_step": B * T, "peak_tflops": peak_tflops or (bf16_peak_tflops(device) if dtype != "float32"
                                                                     else None)}
    return step, row


def _finish(row: dict[str, Any], times: list[tuple[float, float, float]]) -> dict[str, Any]:
    sec = statistics.median(t[0] for t in times)
    peak = row["peak_tflops"]
    row.update({"ms_per_step": sec * 1e3, "tokens_per_s": row["tokens_per_step"] / sec,
                "ms_fwd_bwd": statistics.median(t[1] for t in times) * 1e3,
                "ms_optimizer": statistics.median(t[2] for t in times) * 1e3,
                "mfu": 3 * row["fwd_flops_per_token"] * row["tokens_per_step"] / sec / (peak * 1e12) if peak else None,
                "step_times_s": [t[0] for t in times], "fwd_bwd_times_s": [t[1] for t in times],
                "loadavg": list(os.getloadavg())})
    return row


def bench_preset(name: str, device: torch.device, dtype: str, steps: int, warmup: int,
                 batch_size: int | None = None, seq_len: int | None = None, seed: int = 0,
                 overrides: list[str] | None = None, peak_tflops: float | None = None) -> dict[str, Any]:
    """One preset alone: ``warmup`` untimed steps, then the median of ``steps`` timed ones."""
    step, row = prepare_preset(name, device, dtype, batch_size, seq_len, seed, overrides, peak_tflops)
    for i in range(warmup):
        step(i)
    return _finish(row, [step(warmup + i) for i in range(steps)])


def bench_round_robin(names: list[str], device: torch.device, dtype: str, steps: int, warmup: int,
                      batch_size: int | None = None, seq_len: int | None = None, seed: int = 0,
                      overrides: list[str] | None = None, peak_tflops: float | None = None) -> list[dict[str, Any]]:
    """Several presets timed round-robin in one process: every timed step index runs each preset's step in turn,
    so whatever else the machine does slows them alike (medians of ``steps``, after ``warmup`` steps each)."""
    prepared = [prepare_preset(n, device, dtype, batch_size, seq_len, seed, overrides, peak_tflops) for n in names]
    for i in range(warmup):
        for step, _ in prepared:
            step(i)
    times: list[list[tuple[float, float, float]]] = [[] for _ in prepared]
    for i in range(steps):
        for k, (step, _) in enumerate(prepared):
            times[k].append(step(warmup + i))
    return [_finish(row, t) for (_, row), t in zip(prepared, times, strict=True)]


def paired_ratio(dense_s: list[float], own_s: list[float], flops_ratio: float) -> float | None:
    """The median over rounds of ``dense time / own time`` (the same round's steps) times ``flops_ratio``; None
    without equally many steps of both."""
    if not own_s or len(dense_s) != len(own_s):
        return None
    return statistics.median(d / o for d, o in zip(dense_s, own_s, strict=True)) * flops_ratio


def vs_dense(rows: list[dict[str, Any]]) -> None:
    """Each row's tokens/s over its family's dense preset's (``tiny-mh3`` -> ``tiny-dense``, same device, dtype and
    overrides), scaled by the FLOPs per token (``vs_dense`` = 1: the same FLOP rate; None without a dense row);
    ``vs_dense_paired`` and ``vs_dense_fwd_bwd``: the paired per-round ratios of the whole steps and of their
    forward + backward (:func:`paired_ratio`; the presets of one :func:`bench_round_robin` run step in turn)."""
    for r in rows:
        family = r["preset"].split("-")[0]
        d = next((x for x in rows if x["preset"] == f"{family}-dense" and x["device"] == r["device"]
                  and x["dtype"] == r["dtype"] and x["overrides"] == r["overrides"]), None)
        flops = r["fwd_flops_per_token"] / d["fwd_flops_per_token"] if d else 0.0
        r["vs_dense"] = r["tokens_per_s"] * flops / d["tokens_per_s"] if d else None
        r["vs_dense_paired"] = paired_ratio(d["step_times_s"], r["step_times_s"], flops) if d else None
        r["vs_dense_fwd_bwd"] = (paired_ratio(d.get("fwd_bwd_times_s", []), r.get("fwd_bwd_times_s", []), flops)
                                 if d else None)


def format_table(rows: list[dict[str, Any]]) -> str:
    head = ["preset", "device", "dtype", "params", "fwd FLOPs/token", "tokens/s", "ms/step", "fwd+bwd ms",
            "optimizer ms", "vs dense", "vs dense paired", "fwd+bwd vs dense", "MFU"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def ratio(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    for r in rows:
        mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        vs = " | ".join(ratio(r.get(k)) for k in ("vs_dense", "vs_dense_paired", "vs_dense_fwd_bwd"))
        lines.append(f"| {r['preset']} | {r['device']} | {r['dtype']} | {r['params'] / 1e6:.2f}M | "
                     f"{r['fwd_flops_per_token'] / 1e6:.2f}M | {r['tokens_per_s']:,.0f} | {r['ms_per_step']:.1f} | "
                     f"{r.get('ms_fwd_bwd', 0):.1f} | {r.get('ms_optimizer', 0):.1f} | {vs} | {mfu} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=DEFAULT_PRESETS, metavar="NAME",
                   help="presets to run (default: the 9 tiny-* presets without the ICML ones)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per preset (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="autocast dtype (float16 with the training loop's loss scaling)")
    p.add_argument("--device", default="all", choices=["all", "cpu", "cuda"],
                   help="all = cpu, plus cuda when available")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    p.add_argument("--batch-size", type=int, help="override the presets' batch size")
    p.add_argument("--seq-len", type=int, help="override the presets' sequence length")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="config override for every preset, e.g. model.moe.impl=sorted (repeatable)")
    p.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak for MFU (default: known GPUs)")
    p.add_argument("--json", metavar="PATH", help="also write the rows and machine info as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    malloc_from_env()  # as the mhmoe command does (MHMOE_MALLOC=tuned, docs/PERFORMANCE.md)
    try:
        if args.steps < 1 or args.warmup < 0 or args.threads < 0:
            raise ConfigError("--steps/--warmup/--threads", (args.steps, args.warmup, args.threads),
                              "--steps >= 1, --warmup >= 0, --threads >= 0")
        for name in args.presets:
            get_preset(name).with_overrides(args.overrides)
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device", "cuda", "cpu | all (no CUDA device is available)")
    except ConfigError as exc:
        print(f"train_throughput: error: {exc}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    devices = ["cpu"] if args.device in ("all", "cpu") else []
    if args.device == "cuda" or (args.device == "all" and torch.cuda.is_available()):
        devices.append("cuda")
    rows = []
    for dev in devices:
        done = bench_round_robin(args.presets, torch.device(dev), args.dtype, args.steps, args.warmup,
                                 args.batch_size, args.seq_len, overrides=args.overrides, peak_tflops=args.peak_tflops)
        for row in done:
            print(f"[{dev}] {row['preset']}: {row['tokens_per_s']:,.0f} tok/s, {row['ms_per_step']:.1f} ms/step",
                  file=sys.stderr, flush=True)
        rows += done
    vs_dense(rows)
    machine = machine_info(devices)
    print(format_table(rows))
    print(f"\n{machine['cpu']}, {machine['threads']} threads, torch {machine['torch']}"
          + (f", {machine['cuda_device']}" if "cuda_device" in machine else "")
          + f"; median of {args.steps} steps after {args.warmup} warm-up")
    if args.json:
        out = {"machine": machine, "steps": args.steps, "warmup": args.warmup, "dtype": args.dtype, "rows": rows}
        Path(args.json).write_text(json.dumps(out, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
