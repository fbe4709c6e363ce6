"""Op-level timings behind the dispatch choices of :mod:`mhmoe.moe.dispatch.fused` and :mod:`mhmoe.moe.dispatch`.

At MH-MoE h=3 shapes (4,096 tokens -> S=12,288 sub-tokens of 256, top-3 over 96 experts:
36,864 routed rows), median of 20 after warm-up, 2 threads by default:

- row gather by expert order, forward + backward: ``x[idx]`` vs ``x.index_select(0, idx)``;
- combine ``out[s] = sum_k w[s,k] * y[slot(s,k)]``: gather + ``bmm`` (the CUDA combine),
  scatter + weighted sum, and one ``F.embedding_bag`` with
  ``per_sample_weights`` -- forward only, and forward + backward through autograd;
- SwiGLU backward on one expert block [384, 512]: the 5 ATen ops of :mod:`mhmoe.moe.dispatch.fused` vs one
  ``torch.compile``d kernel (``--compile``; its compile time is printed).

    python benchmarks/dispatch_ops.py [--threads 2] [--compile] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from mhmoe.research.timing import machine_info, time_fn
from mhmoe.runtime.cpu_malloc import malloc_from_env

S, K, E, D, BLOCK_ROWS, FH = 12288, 3, 96, 256, 384, 512


def routing(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, inv, tok): slots sorted by expert, the inverse permutation, each sorted row's token."""
    gen = torch.Generator().manual_seed(seed)
    key = torch.rand(S, E, generator=gen).topk(K, dim=1).indices.reshape(-1)
    order = torch.argsort(key, stable=True)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(S * K)
    return order, inv, order // K


def swiglu_backward_eager(a1: torch.Tensor, a3: torch.Tensor, da: torch.Tensor):
    """As in mhmoe.moe.dispatch.fused: returns (act, dh1, dh3); ``da`` is overwritten."""
    act = F.silu(a1)
    dh3 = da * act
    act.mul_(a3)
    dh1 = torch.ops.aten.silu_backward.grad_input(da.mul_(a3), a1, grad_input=da)
    return act, dh1, dh3


def swiglu_backward_fp32(a1: torch.Tensor, a3: torch.Tensor, da: torch.Tensor):
    """The same math in one expression (what ``torch.compile`` fuses into a single loop)."""
    h, g, d = a1.float(), a3.float(), da.float()
    sig = torch.sigmoid(h)
    silu = h * sig
    dh1 = d * g * sig * (1 + h * (1 - sig))
    return (silu * g).to(a1.dtype), dh1.to(a1.dtype), (d * silu).to(a1.dtype)


def measure(dtype: torch.dtype, compile_: bool, repeats: int) -> list[dict]:
    dev = torch.device("cpu")
    order, inv, tok = routing()
    x = torch.randn(S, D, dtype=dtype, requires_grad=True)
    y = torch.randn(S * K, D, dtype=dtype, requires_grad=True)
    w = torch.rand(S, K, dtype=dtype, requires_grad=True)
    gy, gout = torch.randn(S * K, D, dtype=dtype), torch.randn(S, D, dtype=dtype)
    rows: list[dict] = []

    def add(op: str, variant: str, fn) -> None:
        rows.append({"dtype": str(dtype).replace("torch.", ""), "op": op, "variant": variant,
                     "ms": time_fn(fn, dev, repeats)})

    add("gather fwd+bwd", "x[idx]", lambda: x[tok].backward(gy))
    add("gather fwd+bwd", "index_select", lambda: x.index_select(0, tok).backward(gy))
    yd, wd = y.detach(), w.detach()
    with torch.no_grad():
        add("combine fwd", "gather + bmm", lambda: torch.bmm(wd.unsqueeze(1), yd.index_select(0, inv).view(S, K, D)))
        add("combine fwd", "embedding_bag", lambda: F.embedding_bag(inv.view(S, K), yd, mode="sum",
                                                                     per_sample_weights=wd))

    def scatter_sum() -> None:
        slots = y.new_zeros(S * K, D)
        slots[order] = y
        (slots.view(S, K, D) * w[:, :, None]).sum(1).backward(gout)

    add("combine fwd+bwd", "scatter + weighted sum", scatter_sum)
    add("combine fwd+bwd", "embedding_bag", lambda: F.embedding_bag(inv.view(S, K), y, mode="sum",
                                                                    per_sample_weights=w).backward(gout))
    a1, a3, da = (torch.randn(BLOCK_ROWS, FH, dtype=dtype) for _ in range(3))
    add("SwiGLU bwd block", "5 ATen ops", lambda: swiglu_backward_eager(a1, a3, da.clone()))
    if compile_:
        t0 = time.perf_counter()
        fused = torch.compile(swiglu_backward_fp32, dynamic=True)
        fused(a1, a3, da)
        rows.append({"dtype": rows[-1]["dtype"], "op": "SwiGLU bwd block", "variant": "torch.compile: compile time",
                     "ms": (time.perf_counter() - t0) * 1e3})
        add("SwiGLU bwd block", "torch.compile", lambda: fused(a1, a3, da))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--compile", action="store_true", help="also time a torch.compile'd SwiGLU backward")
    ap.add_argument("--json")
    args = ap.parse_args()
    malloc_from_env()
    torch.set_num_threads(args.threads)
    rows = [r for dt in (torch.bfloat16, torch.float32) for r in measure(dt, args.compile, args.repeats)]
    print("| dtype | op | variant | ms |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['dtype']} | {r['op']} | {r['variant']} | {r['ms']:.2f} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"machine": machine_info(torch.device("cpu")), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
