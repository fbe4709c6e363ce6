"""The C++ expert loop's two GEMM back ends on bf16 MoE layers: ATen's ``at::mm`` (oneDNN) against the loop's own
kernel for this CPU (``dot_gemm.h``, the AVX-512 BF16 dot product, or ``amx_gemm.h``, AMX tiles; ``auto`` uses it
where :func:`mhmoe.moe.dispatch.native.expert_gemm` says).

Each layer (``benchmarks/cpu_dispatch.py``'s configurations, ``auto``'s row layout) runs forward + backward
with both back ends in turn, round-robin in one process; medians, the speedup and how many of the output and
gradient tensors came out bit-identical (both sum in K order in fp32; where oneDNN splits a long K the last bit
differs). With ``--presets``, whole training steps of those presets instead (``benchmarks/train_throughput.py``'s
step, bf16), each back end with rows aligned to 16 and to 32, against the dense preset's FLOP rate. With
``--autocast``, each layer in fp32 under bf16 autocast instead (as training with ``train.dtype=bfloat16`` runs it):
``auto``'s loop on the fp32 expert weights as they are (rounded expert by expert: its own kernels while packing
them) against the same loop on weights cast to bf16 first::

    MHMOE_MALLOC=tuned python benchmarks/expert_gemm.py --threads 2 \\
        --json benchmarks/results/expert_gemm_avx512bf16_2t.json
    MHMOE_MALLOC=tuned python benchmarks/expert_gemm.py --threads 2 --presets tiny-mh2 tiny-mh3 \\
        --json benchmarks/results/expert_gemm_models_avx512bf16_2t.json
    MHMOE_MALLOC=tuned python benchmarks/expert_gemm.py --threads 2 --autocast \\
        --json benchmarks/results/expert_gemm_autocast_amx_2t.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from cpu_dispatch import layer_configs  # noqa: E402
from thin_experts import saved_bytes  # noqa: E402

import mhmoe.moe.dispatch.fused as fused  # noqa: E402
from mhmoe.moe.dispatch import native  # noqa: E402
from mhmoe.moe.experts import GroupedExperts  # noqa: E402
from mhmoe.moe.layers import build_ffn_layer  # noqa: E402
from mhmoe.runtime.cpu import cpu_info, cpu_isa  # noqa: E402
from mhmoe.runtime.cpu_malloc import malloc_from_env  # noqa: E402

ISAS = ("avx512_bf16", "amx")  # the kernel runs where the CPU has AVX-512 BF16 (auto: DOT_GEMM_ISAS)
LAYERS = ["tiny-mh3", "tiny-mh2", "tiny-fgmoe", "tiny-smoe", "mh3", "mh2", "fgmoe", "smoe", "icml-h2", "icml-h4"]


@contextmanager
def own_kernel(on: bool, align: int | None = None) -> Iterator[None]:
    """Within the block the fused path's C++ loop uses its own kernel (on) or at::mm (off) for every layer, and
    with ``align`` rows aligned to it instead of the dispatch table's alignment."""
    rule, table = fused.expert_gemm, fused.cpu_choice
    kernel = native.own_gemm() if on else native.GEMM_ATEN
    fused.expert_gemm = lambda *args: kernel  # type: ignore[assignment]
    if align:
        fused.cpu_choice = lambda *a, **k: replace(table(*a, **k), align=align)  # type: ignore[assignment]
    try:
        yield
    finally:
        fused.expert_gemm, fused.cpu_choice = rule, table  # type: ignore[assignment]


def _step(layer: torch.nn.Module, x: torch.Tensor, autocast: bool = False) -> list[torch.Tensor]:
    """Forward (under bf16 autocast with ``autocast``) + backward; the output and every gradient (inputs first)."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = layer(x, mask=None).out
    out.float().square().mean().backward()
    return [out.detach(), x.grad] + [p.grad for p in layer.parameters() if p.grad is not None]


def _round_robin(layer: torch.nn.Module, x: torch.Tensor, variant: Callable[[bool], Any], rounds: int,
                 autocast: bool = False) -> tuple[dict[bool, float], list[bool]]:
    """Median ms of fwd+bwd within ``variant(False)`` and ``variant(True)`` (context managers), in turn over
    ``rounds``, and which output / gradient tensors the two gave bit-identical."""
    results, times = {}, {False: [], True: []}
    for flag in (False, True):
        with variant(flag):
            results[flag] = _step(layer, x, autocast)
    for _ in range(rounds):
        for flag in (False, True):
            with variant(flag):
                t0 = time.perf_counter()
                _step(layer, x, autocast)
                times[flag].append(time.perf_counter() - t0)
    equal = [torch.equal(a, b) for a, b in zip(results[False], results[True], strict=True)]
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}, equal


def _layer_row(name: str, layer: torch.nn.Module, tokens: int, equal: list[bool]) -> dict:
    """The layer's routed experts and whether ``auto`` runs them on the own kernel, with the equality count."""
    experts = next(m for m in layer.modules() if isinstance(m, GroupedExperts))  # the routed experts
    return {"layer": name, "d_in": experts.d_in, "d_hidden": experts.d_hidden, "n_experts": experts.n_experts,
            "tokens": tokens, "auto_uses_own": native.expert_gemm(torch.bfloat16, experts.d_in,
                                                                  experts.d_hidden) != native.GEMM_ATEN,
            "tensors_equal": sum(equal), "tensors": len(equal)}


def measure(name: str, rounds: int, seed: int = 0) -> dict:
    d, moe, tokens = layer_configs()[name]
    torch.manual_seed(seed)
    layer = build_ffn_layer(d, replace(moe, impl="auto")).to(torch.bfloat16)
    x = torch.randn(1, tokens or 2048, d, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    ms, equal = _round_robin(layer, x, own_kernel, rounds)
    return {**_layer_row(name, layer, tokens or 2048, equal), "ms_aten": ms[False], "ms_own": ms[True],
            "speedup": ms[False] / ms[True]}


@contextmanager
def cast_first(on: bool) -> Iterator[None]:
    """Within the block (on) the fused path casts fp32 expert weights to the autocast dtype before the loop, as it
    does for its Python loop, instead of handing them to the C++ loop as they are (fused._loop_weight)."""
    rule = fused._loop_weight
    if on:
        fused._loop_weight = lambda w, dtype, in_loop: None if w is None else w.to(dtype)  # type: ignore[assignment]
    try:
        yield
    finally:
        fused._loop_weight = rule  # type: ignore[assignment]


def measure_autocast(name: str, rounds: int, seed: int = 0) -> dict:
    """The fp32 layer under bf16 autocast, fwd+bwd: the loop on its fp32 weights against casting them first (time
    and what the backward keeps)."""
    d, moe, tokens = layer_configs()[name]
    torch.manual_seed(seed)
    layer = build_ffn_layer(d, replace(moe, impl="auto"))
    x = torch.randn(1, tokens or 2048, d, generator=torch.Generator().manual_seed(seed))
    ms, equal = _round_robin(layer, x, cast_first, rounds, autocast=True)
    saved = {}
    for flag in (False, True):  # what the backward keeps: the saved tensors but the parameters (thin_experts.py)
        with cast_first(flag):
            saved[flag] = saved_bytes(layer, x, torch.bfloat16) / 1e6
    return {**_layer_row(name, layer, tokens or 2048, equal), "ms_cast": ms[True], "ms_fp32_weights": ms[False],
            "speedup": ms[True] / ms[False], "saved_mb_cast": saved[True], "saved_mb_fp32_weights": saved[False]}


def measure_models(presets: list[str], rounds: int, dense: str = "tiny-dense") -> list[dict]:
    """Training steps of ``presets`` (bf16) per (back end, alignment), round-robin with the ``dense`` preset."""
    from train_throughput import prepare_preset

    cpu = torch.device("cpu")
    steps = {name: prepare_preset(name, cpu, "bfloat16") for name in [dense, *presets]}
    variants = [(dense, False, None)] + [(p, on, a) for p in presets for on in (False, True) for a in (16, 32)]
    times: dict[tuple, list[float]] = {v: [] for v in variants}
    for r in range(rounds + 2):  # two warm-up rounds
        for v in variants:
            with own_kernel(v[1], v[2]):
                seconds = steps[v[0]][0](r)[0]
            if r >= 2:
                times[v].append(seconds)
    base = statistics.median(times[variants[0]]) / steps[dense][1]["fwd_flops_per_token"]
    return [{"preset": p, "gemm": "own kernel" if on else "at::mm", "align": a,
             "ms_per_step": statistics.median(times[(p, on, a)]) * 1e3,
             "vs_dense": base * steps[p][1]["fwd_flops_per_token"] / statistics.median(times[(p, on, a)])}
            for p, on, a in variants]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", nargs="+", default=LAYERS, choices=sorted(layer_configs()), help="layers to time")
    p.add_argument("--presets", nargs="+", default=None,
                   help="time whole bf16 training steps of these presets instead of layers (against tiny-dense)")
    p.add_argument("--autocast", action="store_true",
                   help="time the fp32 layers under bf16 autocast instead: the loop on the fp32 weights as they are "
                        "against casting them to bf16 first")
    p.add_argument("--rounds", type=int, default=9, help="timed round-robin rounds")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", type=Path, default=None, help="write the rows as JSON")
    args = p.parse_args(argv)
    malloc_from_env()
    if args.threads:
        torch.set_num_threads(args.threads)
    if native.expert_ops(torch.bfloat16) is None or native.capability() != "AVX512" or cpu_isa() not in ISAS:
        print("expert_gemm: needs the C++ expert loop built for AVX-512 and a CPU with AVX-512 BF16 "
              f"({', '.join(ISAS)}; this one: {cpu_isa()})", file=sys.stderr)
        return 2
    rows = []
    if args.presets:
        rows = measure_models(args.presets, args.rounds)
        for row in rows:
            print(f"{row['preset']:11s} {row['gemm']:12s} align {row['align'] or '-':>2}  "
                  f"{row['ms_per_step']:7.1f} ms/step  vs dense {row['vs_dense']:.3f}")
    for name in args.layers if args.autocast and not args.presets else []:
        row = measure_autocast(name, args.rounds)
        rows.append(row)
        print(f"{name:11s} cast first {row['ms_cast']:7.1f} ms  fp32 weights {row['ms_fp32_weights']:7.1f} ms  "
              f"speedup {row['speedup']:.3f}  kept {row['saved_mb_cast']:.1f} / {row['saved_mb_fp32_weights']:.1f} MB  "
              f"equal {row['tensors_equal']}/{row['tensors']}  "
              f"auto: {'own' if row['auto_uses_own'] else 'at::mm'}")
    for name in [] if args.presets or args.autocast else args.layers:
        row = measure(name, args.rounds)
        rows.append(row)
        print(f"{name:11s} at::mm {row['ms_aten']:7.1f} ms  own {row['ms_own']:7.1f} ms  "
              f"speedup {row['speedup']:.3f}  equal {row['tensors_equal']}/{row['tensors']}  "
              f"auto: {'own' if row['auto_uses_own'] else 'at::mm'}")
    model = cpu_info()[0]
    print(f"{model} ({cpu_isa()}), {torch.get_num_threads()} threads, torch {torch.__version__}")
    if args.json:
        out = {"machine": {"cpu": model, "isa": cpu_isa(), "threads": torch.get_num_threads(),
                           "torch": torch.__version__},
               "date": datetime.date.today().isoformat(), "command": " ".join(["python", *sys.argv]),
               "rounds": args.rounds, "rows": rows}
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
