"""Tile shapes of the Triton MoE kernels, in plain Python (no triton import): the kernels
(:mod:`~mhmoe.moe.dispatch.triton.kernels`), the compile report (:mod:`~mhmoe.moe.dispatch.triton.aot`) and
the traffic model (:mod:`mhmoe.research.traffic`) read the same table.

Shape legend: D expert in/out width, F expert hidden width, BM x BN the output tile of a program, BK the
reduction step; row-tiled kernels (``ROW_KERNELS``) take BM rows of one expert per tile (the tile table
of :func:`~mhmoe.moe.dispatch.triton.kernels.route_plan` is built for that BM), the weight-gradient
kernels reduce over one expert's rows in BK-row steps.

Candidates are per kernel and compute dtype: bf16 kernels are autotuned over their list on the GPU;
fp32 kernels run one fixed config (no autotuning: fp32 tiles are twice the bytes and their compiles
the slowest). Every candidate fits an H100 (227 KiB of shared memory per block, no register spills,
pipelined loads, wgmma in bf16), checked by compiling each one for sm_90a with the launches' real
specialisation (tests/moe/test_triton_aot.py, ``benchmarks/triton_moe.py --aot``); on a GPU with less
shared memory :func:`fits` prunes the candidates by :func:`smem_bytes` before anything is compiled.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

ROW_KERNELS = ("up_fwd", "down_fwd", "act_bwd", "dx", "act_dx")
WGRAD_KERNELS = ("wgrad_up", "wgrad_down")
KERNELS = ROW_KERNELS + WGRAD_KERNELS
H100_SMEM = 227 * 1024  # bytes of shared memory one block may opt in to on sm_90
PART = 64  # hidden units per partial sum of the routing-weight gradient in act_bwd (divides every BN)
DX_FUSE_MAX = 256  # act_dx (dx fused into act_bwd) keeps a [BM, next_pow2(D)] fp32 accumulator: D up to this
# act_dx is the default where it applies (MHMOE_TRITON_FUSE_DX=0 turns it off): it reads the hidden gradients
# once fewer (less DRAM traffic) but runs 64-row tiles, so it loads every expert's three weight panels twice as
# often as the 128-row act_bwd + dx (more L2 traffic); the traffic model (mhmoe.research.traffic), calibrated
# to the measured H100 figures, predicts it faster for mh3 with and without its L2 bound. Unmeasured on a GPU:
# benchmarks/triton_moe.py --bench times both.
FUSE_DX = os.environ.get("MHMOE_TRITON_FUSE_DX", "1") != "0"
ALIGN = 16  # widths are padded to multiples of this many elements (16-byte-divisible strides, pipelined loads)


@dataclass(frozen=True)
class Tile:
    """One launch config: output tile BM x BN, reduction step BK, warps, software-pipeline stages."""

    bm: int
    bn: int
    bk: int
    warps: int
    stages: int


def _t(*rows: tuple[int, int, int, int, int]) -> list[Tile]:
    return [Tile(*r) for r in rows]


# kernel -> compute dtype -> candidates (BM, BN, BK, warps, stages). Row kernels: one BM per kernel and dtype.
CONFIGS: dict[str, dict[str, list[Tile]]] = {
    # N = F, reduction over D; gated: two accumulators [BM, BN]
    "up_fwd": {"bf16": _t((128, 64, 64, 4, 4), (128, 128, 64, 8, 3), (128, 64, 64, 8, 4), (128, 128, 32, 8, 4)),
               "fp32": _t((64, 64, 32, 4, 3))},
    # N = D, reduction over F (activation recomputed from h1, h3 on load)
    "down_fwd": {"bf16": _t((128, 64, 64, 8, 4), (128, 128, 64, 8, 3), (128, 128, 32, 8, 4)),
                 "fp32": _t((64, 64, 32, 4, 3))},
    # N = F, reduction over D; epilogue: SwiGLU backward, routing-weight partials
    "act_bwd": {"bf16": _t((128, 64, 64, 8, 4), (128, 64, 32, 8, 4), (128, 64, 64, 8, 3)),  # BN 128 spills
                "fp32": _t((64, 64, 32, 8, 3))},
    # N = D, reduction over F (dh1 W1^T + dh3 W3^T)
    "dx": {"bf16": _t((128, 64, 64, 4, 4), (128, 128, 64, 8, 3), (128, 128, 32, 8, 4), (128, 256, 32, 8, 3)),
           "fp32": _t((64, 64, 32, 4, 3))},
    # act_bwd and dx in one pass over F per row tile (D <= DX_FUSE_MAX): BN hidden units per step, one MMA
    # each over D (the tile's dout rows are loaded once) and over 2 BN (BK unused)
    "act_dx": {"bf16": _t((64, 32, 0, 8, 3), (64, 32, 0, 8, 2))},  # bf16 only (fp32 operands spill)
    # output tile [BM of D, BN of F], reduction over an expert's rows
    "wgrad_up": {"bf16": _t((128, 64, 64, 8, 3), (128, 128, 32, 8, 3), (64, 128, 64, 4, 3), (256, 64, 32, 8, 3)),
                 "fp32": _t((64, 64, 32, 4, 3))},
    # output tile [BM of F, BN of D], reduction over an expert's rows
    "wgrad_down": {"bf16": _t((128, 64, 64, 8, 3), (128, 128, 32, 8, 3), (64, 128, 64, 4, 3), (64, 256, 32, 8, 3)),
                   "fp32": _t((64, 64, 16, 8, 3))},  # BK 32 spills 208 B at 255 registers under triton 3.6
}
# under the Triton interpreter (CPU tests): one small config, several tiles per expert and masked edges
INTERP: dict[str, Tile] = {k: Tile(16, 32, 32, 4, 1) for k in ROW_KERNELS} | {
    k: Tile(32, 32, 32, 4, 1) for k in WGRAD_KERNELS}


def dtype_key(name: str) -> str:
    """"bf16" | "fp32" from a torch/triton dtype name ("bfloat16", "torch.float32", "fp32", ...)."""
    return "bf16" if "bf" in name else "fp32"


def block_m(kernel: str, dtype: str, interpreted: bool = False) -> int:
    """Rows per tile of a row-tiled kernel (the tile table is built for it)."""
    if interpreted:
        return INTERP[kernel].bm
    (bm,) = {t.bm for t in CONFIGS[kernel].get(dtype_key(dtype), CONFIGS[kernel]["bf16"])}
    return bm


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def fuse_dx(d: int, dtype: str, enabled: bool | None = None) -> bool:
    """Whether the input gradient is computed inside the act_bwd pass (act_dx) for expert width ``d`` in
    ``dtype``: when enabled (default :data:`FUSE_DX`), for bf16 (the fp32 dout rows and dx accumulator do not
    fit the registers without spills) and D up to :data:`DX_FUSE_MAX`."""
    on = FUSE_DX if enabled is None else enabled
    return on and dtype_key(dtype) in CONFIGS["act_dx"] and next_pow2(d) <= DX_FUSE_MAX


def padded(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-n // ALIGN) * ALIGN


def smem_bytes(kernel: str, t: Tile, item: int, gated: bool = True, d: int = 256) -> int:
    """Shared memory a config needs, from its tiles: ``stages`` copies of the pipelined operand tiles plus the
    operands computed in registers and staged once (bytes; ``item`` = element size, ``d`` = D for act_dx)."""
    g = 2 if gated else 1
    a, b = t.bm * t.bk, t.bk * t.bn
    if kernel == "up_fwd":
        per_stage, once = a + g * b, 0
    elif kernel == "down_fwd":
        per_stage, once = g * a + b, a  # h1 (and h3) pipelined; the activation staged for the MMA
    elif kernel == "act_bwd":
        per_stage, once = a + b, 0
    elif kernel == "dx":
        per_stage, once = g * (a + b), 0
    elif kernel == "act_dx":  # per step: W2^T [D, BN], W1^T|W3^T [BN, D], h1|h3 [BM, BN]; dout [BM, D] once
        dp = next_pow2(d)
        per_stage, once = (1 + g) * t.bn * dp + g * t.bm * t.bn, t.bm * dp
    elif kernel == "wgrad_up":
        per_stage, once = a + g * b, 0
    elif kernel == "wgrad_down":
        per_stage, once = g * t.bk * t.bm + b, t.bm * t.bk + b  # h1/h3 and dout pipelined; act, w*dout staged
    else:
        raise ValueError(f"unknown kernel {kernel!r}: allowed {', '.join(KERNELS)}")
    return (t.stages * per_stage + once) * item


def fits(kernel: str, t: Tile, item: int, limit: int, gated: bool = True, d: int = 256) -> bool:
    """Whether a config's predicted shared memory fits ``limit`` bytes (the autotuner's early prune)."""
    return smem_bytes(kernel, t, item, gated, d) <= limit
