"""A traffic model of the Triton MoE kernels: FLOPs and bytes moved per kernel, from the kernels' tiling
(:mod:`mhmoe.moe.dispatch.triton.tiles`), and a roofline time per kernel on a GPU whose peak numbers
are given. It predicts; it measures nothing. ``mhmoe bench moe`` prints its layer prediction beside the
measured times (``pred_*`` keys) so a GPU run confirms or refutes it; ``benchmarks/traffic_model.py``
prints the per-kernel tables.

Shape legend: S routed sub-tokens, K top-k, N = S*K routed rows, E experts, D expert width, F hidden
width, b bytes per element, BM x BN a program's output tile, T row tiles (sum over experts of
ceil(rows_e / BM)), g = 2 for SwiGLU (W1 and W3), 1 for ReLU.

Per kernel three quantities (routing assumed balanced: N / E rows per expert):

- ``flops``: MMA FLOPs executed, padding rows of the last tile of every expert included;
- ``l2``: bytes that programs load (every tile of every operand, every time a program loads it: the
  weight panel of an expert is loaded once per row tile, the rows once per output column tile) plus
  the bytes they store -- traffic between L2 and the SMs;
- ``hbm``: compulsory DRAM traffic, every tensor read and written once (what perfect L2 reuse leaves).

Time = max(flops / (peak x mma_eff), hbm / (hbm_bw x mem_eff), l2 / l2_bw) + one launch overhead; the
autotuner is emulated by taking each kernel's candidate config with the least predicted time. The dense
reference is modelled the same way (cuBLAS-like 128 x 256 tiles in 2-CTA clusters: the Hopper GEMMs fetch
the tile both CTAs of a cluster share from L2 once, by TMA multicast; the Triton kernels do not).

Calibration (:data:`H100_SXM`) against what was measured on the lent H100 80GB HBM3: an 8192^3 bf16
matmul through PyTorch ran at 798 TFLOP/s (``mma_eff`` = 798 / 989.4), a device-to-device copy moved about
3.0 TB/s counting bytes read and written (``mem_eff`` = 3.0 / 3.35). The L2 -> SM bandwidth has no data
sheet: 5.5 TB/s was measured (a third-party microbenchmark) on an H100 *PCIe* (114 SMs, at most 1755 MHz,
power-limited), so the SXM part (132 SMs at 1980 MHz) gets it scaled by SMs x clock, 7.2 TB/s, as an
achieved figure (not derated again). The measured GEMM bounds it from below: its tiles moved 8.7 GB
from L2 in 1.38 ms, >= 6.3 TB/s. (The model before this calibration derated 5.5 TB/s by 0.85 and counted
no multicast, which capped that GEMM at 394 TFLOP/s, half the measurement.) The L2 figure stays the least
certain number, so every prediction also comes without any L2 bound (:func:`without_l2`: DRAM and tensor
cores only). Not modelled: wave quantisation, imbalance between experts, the routing glue (sort and tile
table, ~N int32 passes), register or bank-conflict stalls.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from mhmoe.moe.dispatch.triton.tiles import CONFIGS, Tile, fuse_dx, next_pow2, padded

# measured on the lent H100 80GB HBM3 (PyTorch, random data): the figures the model is calibrated to
H100_GEMM_TFLOPS = 798.0  # an 8192 x 8192 x 8192 bf16 matmul
H100_COPY_TBS = 3.0  # a device-to-device copy, bytes read + written
L2_PCIE_TBS, PCIE_SMS, PCIE_MHZ = 5.5, 114, 1755  # third-party L2 bandwidth microbenchmark of an H100 PCIe
SXM_SMS, SXM_MHZ = 132, 1980


@dataclass(frozen=True)
class Device:
    """Peak numbers of a GPU (vendor data sheets) and the fractions of them that were reached (measured on the
    lent H100, see the module docstring); ``l2_tbs`` is an achieved L2 -> SM bandwidth, used as it is."""

    name: str
    bf16_tflops: float  # dense tensor-core peak
    tf32_tflops: float
    fp32_tflops: float  # FMA (no tensor cores)
    hbm_tbs: float
    l2_tbs: float
    mma_eff: float = H100_GEMM_TFLOPS / 989.4
    mem_eff: float = H100_COPY_TBS / 3.35
    launch_us: float = 4.0
    cluster: int = 2  # CTAs per cluster of the vendor GEMMs (TMA multicast of the shared operand tile)


L2_SXM_TBS = round(L2_PCIE_TBS * SXM_SMS / PCIE_SMS * SXM_MHZ / PCIE_MHZ, 1)  # 7.2
H100_SXM = Device("H100 SXM", 989.4, 494.7, 66.9, 3.35, L2_SXM_TBS)
DEVICES = {"H100": H100_SXM, "H200": Device("H200", 989.4, 494.7, 66.9, 4.8, L2_SXM_TBS)}


def without_l2(dev: Device) -> Device:
    """The same device with no L2 bound (DRAM and tensor cores only): the optimistic variant."""
    return replace(dev, l2_tbs=0.0)

# the configs of the design before the Hopper rework (64-row tiles everywhere, act_bwd and dx separate),
# kept to quote the model's before/after numbers
_UP = ((64, 64, 4, 3), (128, 64, 4, 3), (128, 32, 4, 4), (128, 64, 8, 3), (256, 64, 8, 3), (64, 32, 4, 4))
_DOWN = ((64, 64, 4, 3), (128, 64, 4, 3), (128, 32, 4, 4), (64, 128, 4, 3), (256, 64, 8, 3), (128, 64, 8, 4))
LEGACY: dict[str, dict[str, list[Tile]]] = {
    "up_fwd": {"bf16": [Tile(64, bn, bk, w, s) for bn, bk, w, s in _UP]},
    "down_fwd": {"bf16": [Tile(64, bn, bk, w, s) for bn, bk, w, s in _DOWN]},
    "wgrad": {"bf16": [Tile(*r) for r in ((64, 64, 32, 4, 3), (64, 128, 32, 4, 3), (128, 64, 32, 4, 3),
                                          (128, 128, 32, 8, 3), (128, 128, 64, 8, 3), (64, 64, 64, 4, 4))]},
}
LEGACY["act_bwd"], LEGACY["dx"] = LEGACY["up_fwd"], LEGACY["down_fwd"]
LEGACY["wgrad_up"] = LEGACY["wgrad_down"] = LEGACY["wgrad"]


@dataclass
class KernelCost:
    kernel: str
    tile: str  # the config: "BMxBNxBK w{warps} s{stages}"
    flops: float
    l2: float  # bytes
    hbm: float  # bytes
    us: float  # predicted microseconds
    bound: str  # mma | hbm | l2

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Shape:
    """The expert part of one MoE layer call: N = s * k routed rows over e experts of width d x f."""

    s: int
    k: int
    e: int
    d: int
    f: int
    item: int = 2  # bytes per element (bf16)
    gated: bool = True

    @property
    def n(self) -> int:
        return self.s * self.k

    def tiles(self, bm: int) -> int:
        """Row tiles of all experts at balanced routing."""
        per = math.ceil(self.n / self.e)
        return self.e * math.ceil(per / bm) if per else 0


def _time(dev: Device, flops: float, l2: float, hbm: float, dtype: str) -> tuple[float, str]:
    peak = {"bf16": dev.bf16_tflops, "tf32": dev.tf32_tflops, "fp32": dev.fp32_tflops}[dtype]
    terms = {"mma": flops / (peak * 1e12 * dev.mma_eff), "hbm": hbm / (dev.hbm_tbs * 1e12 * dev.mem_eff),
             "l2": l2 / (dev.l2_tbs * 1e12) if dev.l2_tbs else 0.0}
    bound = max(terms, key=terms.get)
    return terms[bound] * 1e6 + dev.launch_us, bound


def kernel_traffic(kernel: str, sh: Shape, t: Tile, train: bool = True, store_dh: bool = True) -> tuple[float, ...]:
    """(flops, l2 bytes, hbm bytes) of one kernel with config ``t`` (act_dx: ``t.bn`` hidden units per step)."""
    b, g, n, e, d, f = sh.item, 2 if sh.gated else 1, sh.n, sh.e, sh.d, sh.f
    T = sh.tiles(t.bm)
    rows = T * t.bm  # rows executed, padding included
    nf, nd = math.ceil(f / t.bn), math.ceil(d / t.bn)
    x_hbm = sh.s * d * b  # x / dout: the unique token rows (gathered K times, from L2)
    if kernel == "up_fwd":
        outs = g if train else 1
        flops = 2 * g * rows * d * nf * t.bn
        l2 = nf * rows * d * b + T * g * d * nf * t.bn * b + outs * n * f * b
        hbm = x_hbm + g * e * d * f * b + outs * n * f * b
    elif kernel == "down_fwd":
        ins = g if train else 1
        flops = 2 * rows * f * nd * t.bn
        l2 = nd * ins * rows * f * b + T * f * nd * t.bn * b + n * d * b
        hbm = ins * n * f * b + e * f * d * b + n * d * b
    elif kernel == "act_bwd":
        flops = 2 * rows * d * nf * t.bn
        l2 = nf * rows * d * b + T * d * nf * t.bn * b + 2 * g * n * f * b
        hbm = x_hbm + e * f * d * b + 2 * g * n * f * b
    elif kernel == "dx":
        flops = 2 * g * rows * f * nd * t.bn
        l2 = nd * g * rows * f * b + T * g * f * nd * t.bn * b + n * d * b
        hbm = g * n * f * b + g * e * d * f * b + n * d * b
    elif kernel == "act_dx":
        dp = next_pow2(d)
        stores = (g * n * f * b if store_dh else 0) + n * d * b
        flops = 2 * rows * dp * nf * t.bn * (1 + g)
        l2 = rows * dp * b + T * (1 + g) * dp * nf * t.bn * b + g * n * f * b + stores
        hbm = x_hbm + (1 + g) * e * d * f * b + g * n * f * b + stores
    elif kernel == "wgrad_up":  # output [BM of D, BN of F] per expert, reduction over rows
        nf, nd = math.ceil(f / t.bn), math.ceil(d / t.bm)
        flops = 2 * g * n * d * f
        l2 = nf * n * nd * t.bm * b + nd * g * n * nf * t.bn * b + g * e * d * f * b
        hbm = x_hbm + g * n * f * b + g * e * d * f * b
    elif kernel == "wgrad_down":  # output [BM of F, BN of D]
        nf, nd = math.ceil(f / t.bm), math.ceil(d / t.bn)
        flops = 2 * n * d * f
        l2 = nd * g * n * nf * t.bm * b + nf * n * nd * t.bn * b + e * f * d * b
        hbm = g * n * f * b + x_hbm + e * f * d * b
    elif kernel == "ksum":
        flops, l2 = 0.0, n * d * b + sh.s * d * b
        hbm = l2
    else:
        raise ValueError(f"unknown kernel {kernel!r}")
    return float(flops), float(l2), float(hbm)


def best_config(kernel: str, sh: Shape, dtype: str, dev: Device, legacy: bool = False,
                train: bool = True) -> KernelCost:
    """The candidate config with the least predicted time (what the autotuner should pick)."""
    table = LEGACY if legacy else CONFIGS
    cands = table[kernel]["bf16" if dtype == "bf16" else "fp32"] if not legacy else table[kernel]["bf16"]
    prec = dtype
    best = None
    for t in cands:
        flops, l2, hbm = kernel_traffic(kernel, sh, t, train)
        us, bound = _time(dev, flops, l2, hbm, prec)
        cost = KernelCost(kernel, f"{t.bm}x{t.bn}x{t.bk} w{t.warps} s{t.stages}", flops, l2, hbm, us, bound)
        if best is None or cost.us < best.us:
            best = cost
    return best


def _ksum(sh: Shape, dev: Device) -> list[KernelCost]:
    if sh.k == 1:
        return []
    flops, l2, hbm = kernel_traffic("ksum", sh, Tile(16, 128, 0, 4, 1))
    us, bound = _time(dev, flops, l2, hbm, "bf16")
    return [KernelCost("ksum", "16x128", flops, l2, hbm, us, bound)]


def expert_kernels(sh: Shape, dtype: str = "bf16", dev: Device = H100_SXM, legacy: bool = False,
                   pass_: str = "fwd_bwd", fused: bool | None = None) -> list[KernelCost]:
    """The kernels of one call of the Triton path, in launch order, each at its best config. ``dtype``:
    bf16 | tf32 | fp32 (fp32 inputs with TF32 off); ``legacy``: the design before the Hopper rework;
    ``fused``: act_dx instead of act_bwd + dx (default: what the kernels run, ``tiles.fuse_dx``)."""
    cost = lambda k, train=True: best_config(k, sh, dtype, dev, legacy, train)  # noqa: E731
    if pass_ == "fwd":
        return [cost("up_fwd", train=False), cost("down_fwd", train=False), *_ksum(sh, dev)]
    out = [cost("up_fwd"), cost("down_fwd"), *_ksum(sh, dev)]
    if not legacy and fuse_dx(sh.d, dtype, fused):
        out += [cost("act_dx"), *_ksum(sh, dev)]
    else:
        out += [cost("act_bwd"), cost("dx"), *_ksum(sh, dev)]
    return out + [cost("wgrad_up"), cost("wgrad_down")]


def dense_gemm(m: int, k: int, n: int, dev: Device, dtype: str = "bf16", item: int = 2,
               bm: int = 128, bn: int = 256) -> KernelCost:
    """A vendor GEMM [m, k] x [k, n] with BM x BN output tiles in clusters of ``dev.cluster`` CTAs along M:
    A loaded once per column tile, B once per cluster of row tiles (TMA multicast), the result stored once
    (L2 traffic); operands and result read/written once (DRAM)."""
    b_loads = math.ceil(math.ceil(m / bm) / dev.cluster)
    l2 = (math.ceil(n / bn) * m * k + b_loads * k * n + m * n) * item
    flops = 2 * m * k * n
    us, bound = _time(dev, flops, l2, (m * k + k * n + m * n) * item, dtype)
    return KernelCost("gemm", f"{bm}x{bn} cluster {dev.cluster}", flops, l2, (m * k + k * n + m * n) * item, us, bound)


def dense_gemm_us(m: int, k: int, n: int, dev: Device, dtype: str = "bf16", item: int = 2,
                  bm: int = 128, bn: int = 256) -> float:
    """Predicted microseconds of :func:`dense_gemm`."""
    return dense_gemm(m, k, n, dev, dtype, item, bm, bn).us


def _elementwise_us(elements: float, passes: int, dev: Device, item: int) -> float:
    """``passes`` streaming passes over ``elements`` elements (reads + writes) at DRAM bandwidth."""
    return passes * elements * item / (dev.hbm_tbs * 1e12 * dev.mem_eff) * 1e6


# element-wise passes (one read or write of the whole tensor each) over the [S, E] fp32 scores in eager PyTorch,
# counted from the ops, forward / forward + backward:
REF_ROUTER_PASSES = (3, 12)  # softmax, top-k; backward: the weights' gradient scattered into [S, E], summed
# into the probabilities' gradient, the softmax backward
LOSS_PASSES = (13, 16)  # the balance (3 forward, 3 backward), z (2) and entropy (8) losses: all three computed
# forward for the statistics, only the balance loss differentiated at the default weights (z and entropy at
# weight 0 take no part in the backward; with both trained the backward adds about 16 more passes)
FUSED_LOSS_PASSES = (0, 1)  # the fused router's kernel reduces the scores for the losses itself (per-row and
# per-expert results only); backward: the balance loss's gradient written out as the probabilities' gradient
ROUTER_BM = 64  # tokens per program of the fused router kernels (mhmoe.moe.dispatch.triton.router)


def router_kernels(s: int, d: int, e: int, k: int, dtype: str = "bf16", dev: Device = H100_SXM,
                   pass_: str = "fwd_bwd") -> list[KernelCost]:
    """The fused router's kernels for s tokens of width d, e experts, top-k: split-bf16 MMAs over the padded
    experts (3 products for bf16 inputs, 6 for fp32), the [S, E] fp32 scores and probabilities written once,
    the backward reading the saved scores and the incoming gradients once; the router weight's three bf16 parts
    are loaded by every program (L2)."""
    b = 2 if dtype == "bf16" else 4
    ep = max(16, 1 << max(0, e - 1).bit_length())
    prods = 3 if dtype == "bf16" else 6
    progs = math.ceil(s / ROUTER_BM)
    w_parts = 3 * e * d * 2
    se, sk = s * e * 4, s * k * 12  # fp32 [S, E]; fp32 weights + int64 ids [S, K]
    rows = [("router_fwd", 2 * s * d * ep * prods, s * d * b + 2 * se + sk + w_parts, progs * w_parts)]
    if pass_ != "fwd":
        chunks = min(64, math.ceil(s / 256))
        rows += [("router_bwd", 2 * s * ep * d * 6, 4 * se + sk + s * d * b + w_parts, progs * w_parts),
                 ("router_wgrad", 2 * s * ep * d * prods, se + s * d * b + 2 * chunks * e * d * 4,
                  (math.ceil(d / 64) - 1) * se)]
    out = []
    for name, flops, hbm, l2_extra in rows:
        us, bound = _time(dev, flops, hbm + l2_extra, hbm, "bf16")
        out.append(KernelCost(name, f"{ROUTER_BM} tokens", float(flops), float(hbm + l2_extra), float(hbm), us, bound))
    return out


def router_prediction(s: int, d: int, e: int, k: int, dtype: str = "bf16", pass_: str = "fwd_bwd",
                      dev: Device = H100_SXM, fused: bool = True) -> dict[str, float]:
    """Predicted ms of the router and of its losses for s (sub-)tokens of width d: ``fused`` the Triton kernels
    (:func:`router_kernels`), else the reference (x copied to fp32, an fp32 CUDA-core GEMM -- TF32 off, PyTorch's
    default -- and its two backward GEMMs, :data:`REF_ROUTER_PASSES`); the losses: from the fused kernel's own
    reductions (:data:`FUSED_LOSS_PASSES`) or eager passes over the scores (:data:`LOSS_PASSES`)."""
    b = 2 if dtype == "bf16" else 4
    fwd = pass_ == "fwd"
    if fused:
        router = sum(c.us for c in router_kernels(s, d, e, k, dtype, dev, pass_))
    else:
        casts = s * d * (b + 4) * (1 if fwd else 2)  # x to fp32; its gradient back to x's dtype
        router = ((1 if fwd else 3) * dense_gemm_us(s, d, e, dev, "fp32", 4) + _elementwise_us(casts, 1, dev, 1)
                  + _elementwise_us(s * e, REF_ROUTER_PASSES[0 if fwd else 1], dev, 4))
    losses = _elementwise_us(s * e, (FUSED_LOSS_PASSES if fused else LOSS_PASSES)[0 if fwd else 1], dev, 4)
    return {"router_ms": router / 1e3, "losses_ms": losses / 1e3}


def layer_prediction(tokens: int, d_model: int, experts: int, d_expert: int, top_k: int, heads: int,
                     dtype: str = "bf16", pass_: str = "fwd_bwd", dev: Device = H100_SXM,
                     legacy: bool = False, fused: bool | None = None, router: str = "fused") -> dict[str, float]:
    """Predicted ms of one MoE layer on the Triton path, by part: the expert kernels (``fused``: act_dx or not,
    default what the kernels run), the head and merge projections (MH-MoE; backward = 2 GEMMs per forward GEMM),
    the router (``router``: "fused" | "reference", :func:`router_prediction`) and its losses."""
    item = 2 if dtype == "bf16" else 4
    d = d_model // heads
    sh = Shape(tokens * heads, top_k, experts, padded(d), padded(d_expert), item)
    kern = sum(c.us for c in expert_kernels(sh, dtype, dev, legacy, pass_, fused))
    mult = 1 if pass_ == "fwd" else 3
    proj = mult * 2 * dense_gemm_us(tokens, d_model, d_model, dev, dtype, item) if heads > 1 else 0.0
    parts = {"experts_ms": kern / 1e3, "proj_ms": proj / 1e3,
             **router_prediction(tokens * heads, d, experts, top_k, dtype, pass_, dev, router == "fused")}
    return {**parts, "layer_ms": sum(parts.values())}


def dense_prediction(tokens: int, d_model: int, d_hidden: int, dtype: str = "bf16", pass_: str = "fwd_bwd",
                     dev: Device = H100_SXM) -> float:
    """Predicted ms of the dense SwiGLU FFN as it runs in eager PyTorch (:class:`mhmoe.moe.experts.DenseFFN`):
    3 GEMMs forward and 6 backward, plus the element-wise SwiGLU passes over [tokens, d_hidden] (silu, the
    product: 5 reads/writes forward; their backward: 9 more)."""
    item = 2 if dtype == "bf16" else 4
    up = dense_gemm_us(tokens, d_model, d_hidden, dev, dtype, item)
    down = dense_gemm_us(tokens, d_hidden, d_model, dev, dtype, item)
    fwd = pass_ == "fwd"
    ew = _elementwise_us(tokens * d_hidden, 5 if fwd else 14, dev, item)
    return ((1 if fwd else 3) * (2 * up + down) + ew) / 1e3


def device_for(gpu_name: str | None) -> Device | None:
    """The model's device for a CUDA device name (None: no model for it)."""
    for key, dev in DEVICES.items():
        if gpu_name and key in gpu_name:
            return dev
    return None
