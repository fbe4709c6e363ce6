"""Launching the Triton MoE kernels: configs per kernel and dtype, the device-side tile table, and one
wrapper per kernel (tensors in, tensors out). The kernels themselves are in
:mod:`mhmoe.moe.dispatch.triton.kernels`; the tile shapes in :mod:`mhmoe.moe.dispatch.triton.tiles`.

Shape legend: S routed (sub-)tokens, K slots per token, SK = S*K, E experts, D expert width, F hidden
width, G tiles of one row-tiled kernel (an upper bound, so no shape depends on the routing).

Configs: bf16 kernels are autotuned (key: D, F and the dtypes) over their candidates, pruned first by
predicted shared memory against the device's limit; fp32 kernels run one fixed config. Under the
interpreter every kernel runs one small config. Every launch goes through :func:`_launch`, so
:func:`recording` can capture the launches of a real forward/backward (with their real arguments,
hence their real specialisation) without running them: :mod:`~mhmoe.moe.dispatch.triton.aot` compiles
those for a GPU target on a machine without one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import triton
from torch import Tensor

from mhmoe.moe.dispatch.precision import cuda_matmul_tf32
from mhmoe.moe.dispatch.triton import kernels as K_
from mhmoe.moe.dispatch.triton.tiles import CONFIGS, INTERP, PART, ROW_KERNELS, Tile, block_m, fits, next_pow2

INTERPRETED = K_.INTERPRETED
PART_UNITS = INTERP["act_bwd"].bn if INTERPRETED else PART  # hidden units per routing-weight partial (<= every BN)
JIT = {"up_fwd": K_._up_fwd_kernel, "down_fwd": K_._down_fwd_kernel, "act_bwd": K_._act_bwd_kernel,
       "dx": K_._dx_kernel, "act_dx": K_._act_dx_kernel, "wgrad_up": K_._wgrad_up_kernel,
       "wgrad_down": K_._wgrad_down_kernel}
TILE_NAMES = {k: ("BN", "BK") for k in ("up_fwd", "down_fwd", "act_bwd", "dx")} | {
    "act_dx": ("BN",), "wgrad_up": ("BM", "BN", "BK"), "wgrad_down": ("BM", "BN", "BK")}


def dkey(dtype: torch.dtype) -> str:
    return "bf16" if dtype == torch.bfloat16 else "fp32"


def tile_kwargs(kernel: str, t: Tile) -> dict[str, int]:
    """The constexpr tile sizes of a config (row kernels get BM from the tile table, passed separately)."""
    sizes = {"BM": t.bm, "BN": t.bn, "BK": t.bk}
    return {name: sizes[name] for name in TILE_NAMES[kernel]}


def to_config(kernel: str, t: Tile) -> triton.Config:
    return triton.Config(tile_kwargs(kernel, t), num_warps=t.warps, num_stages=t.stages)


def _smem_limit() -> int | None:
    """Shared memory one block may opt in to on the current CUDA device (None: unknown, prune nothing)."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return getattr(props, "shared_memory_per_block_optin", None)


def fits_device(kernel: str, dtype: str, gated: bool = True, d: int = 256) -> bool:
    """Whether at least one candidate config of ``kernel`` fits the current GPU's shared memory (True when
    unknown: no CUDA, e.g. under the interpreter)."""
    limit = _smem_limit()
    item = 2 if dtype == "bf16" else 4
    return limit is None or any(fits(kernel, t, item, limit, gated, d) for t in CONFIGS[kernel].get(dtype, ()))


def _pruner(kernel: str, dtype: str) -> Callable[..., list[triton.Config]]:
    """Autotuner early prune: drop the configs whose predicted shared memory exceeds the device's limit
    (all of them fit an H100; smaller GPUs lose the largest tiles). Keeps at least the smallest."""
    item = 2 if dtype == "bf16" else 4

    def tile_of(cfg: triton.Config) -> Tile:
        return next(t for t in CONFIGS[kernel][dtype] if tile_kwargs(kernel, t) == {k: cfg.kwargs[k] for k in
                    TILE_NAMES[kernel]} and (t.warps, t.stages) == (cfg.num_warps, cfg.num_stages))

    def prune(configs, named_args, **kwargs):
        limit = _smem_limit()
        if limit is None:
            return configs
        gated = bool(kwargs.get("GATED", named_args.get("GATED", True)))
        d = int(named_args.get("D", 256))
        keep = [c for c in configs if fits(kernel, tile_of(c), item, limit, gated, d)]
        return keep or configs[-1:]

    return prune


def _build_launchers() -> dict[tuple[str, str], tuple[Any, dict[str, Any]]]:
    """(kernel, dtype) -> (launchable, fixed kwargs)."""
    out = {}
    for name, fn in JIT.items():
        for dt in ("bf16", "fp32") if INTERPRETED else CONFIGS[name]:  # interpreted: every path testable
            if INTERPRETED:
                t = INTERP[name]
                out[name, dt] = fn, tile_kwargs(name, t)
            elif len(CONFIGS[name][dt]) == 1:  # fixed config: the kernel itself with the config's kwargs
                t = CONFIGS[name][dt][0]
                out[name, dt] = fn, {**tile_kwargs(name, t), "num_warps": t.warps, "num_stages": t.stages}
            else:
                cfgs = [to_config(name, t) for t in CONFIGS[name][dt]]
                tuned = triton.autotune(configs=cfgs, key=["D", "F"], prune_configs_by={
                    "early_config_prune": _pruner(name, dt)})(fn)
                out[name, dt] = tuned, {}
    return out


LAUNCHERS = _build_launchers()


class Launch(NamedTuple):
    """One recorded launch: the kernel's name, the compute dtype key, the arguments and constexprs."""

    kernel: str
    dtype: str
    args: tuple
    consts: dict[str, Any]


_RECORD: list[Launch] | None = None


@contextlib.contextmanager
def recording() -> Iterator[list[Launch]]:
    """Within the block, launches are recorded instead of run (outputs stay uninitialised)."""
    global _RECORD
    prev, _RECORD = _RECORD, []
    try:
        yield _RECORD
    finally:
        _RECORD = prev


def _launch(kernel: str, dtype: str, grid: Callable[[dict], tuple], args: tuple, **consts: Any) -> None:
    if _RECORD is not None:
        _RECORD.append(Launch(kernel, dtype, args, consts))
        return
    fn, fixed = LAUNCHERS[kernel, dtype]
    fn[grid](*args, **consts, **fixed)


def precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: fp32 inputs use TF32 only where PyTorch's matmuls would (read without raising
    through either TF32 API, :func:`~mhmoe.moe.dispatch.precision.cuda_matmul_tf32`)."""
    if dtype == torch.float32 and not cuda_matmul_tf32():
        return "ieee"
    return "tf32"


def n_parts(F: int, dtype: str) -> int:
    """Rows of act_bwd's routing-weight partials: PART-wide chunks of F rounded up to the widest BN."""
    widest = INTERP["act_bwd"].bn if INTERPRETED else max(t.bn for t in CONFIGS["act_bwd"][dtype])
    return triton.cdiv(F, widest) * (widest // PART_UNITS)


# ------------------------------------------------------------------------------------- routing glue


class Plan(NamedTuple):
    """Device-side routing tables (no host sync to build them). order [SK] int32 (slot of every sorted
    row), starts/ends [E] int32 (row range of every expert), tiles: BM -> (tile_expert, tile_row) [G] int32."""

    order: Tensor
    starts: Tensor
    ends: Tensor
    tiles: dict[int, tuple[Tensor, Tensor]]
    n_tokens: int
    top_k: int
    n_experts: int


def n_tiles(n_slots: int, n_experts: int, bm: int) -> int:
    """Upper bound on the row tiles of all experts: sum_e ceil(c_e / M) <= floor(SK / M) + min(E, SK)."""
    return n_slots // bm + min(n_experts, n_slots)


def tile_table(starts: Tensor, ends: Tensor, n_slots: int, bm: int) -> tuple[Tensor, Tensor]:
    """(tile_expert, tile_row) [G] int32 of the BM-row tiles of every expert; surplus tiles get expert E."""
    E = starts.numel()
    tiles = (ends - starts + bm - 1) // bm
    tile_end = torch.cumsum(tiles, 0)
    t = torch.arange(n_tiles(n_slots, E, bm), device=starts.device)
    tile_expert = torch.searchsorted(tile_end, t, right=True)  # E for the surplus tiles
    te = tile_expert.clamp_max(E - 1)
    tile_row = starts[te] + (t - (tile_end - tiles)[te]) * bm
    return tile_expert.to(torch.int32), tile_row.to(torch.int32)


def route_plan(experts: Tensor, valid: Tensor, n_experts: int, block_ms: tuple[int, ...] = ()) -> Plan:
    """Sort the [S, K] slots by expert (invalid slots last) and build a tile table per row-tile size, all
    on the device. ``searchsorted`` on the sorted keys gives each expert's row range (unlike ``bincount``,
    whose output size is data-dependent on CUDA, it never synchronises)."""
    S, K = experts.shape
    E, SK, dev = n_experts, experts.numel(), experts.device
    key = torch.where(valid, experts, E).reshape(-1)
    sorted_key, order = torch.sort(key, stable=True)
    ends = torch.searchsorted(sorted_key, torch.arange(E, device=dev, dtype=sorted_key.dtype), right=True)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    tiles = {bm: tile_table(starts, ends, SK, bm) for bm in sorted(set(block_ms))}
    i32 = torch.int32
    return Plan(order.to(i32), starts.to(i32), ends.to(i32), tiles, S, K, E)


def plan_block_ms(dtype: torch.dtype) -> tuple[int, ...]:
    """The row-tile sizes of the row-tiled kernels in ``dtype`` (one tile table each)."""
    dt = dkey(dtype)
    return tuple(sorted({block_m(k, dt, INTERPRETED) for k in ROW_KERNELS if dt in CONFIGS[k]}))


# --------------------------------------------------------------------------------------- launchers


def _row_grid(plan: Plan, bm: int, n: int) -> Callable[[dict], tuple]:
    G = plan.tiles[bm][0].numel()
    return lambda meta: (G, triton.cdiv(n, meta["BN"]))  # meta: every argument and constexpr of the launch


def _tiles(plan: Plan, kernel: str, dt: str) -> tuple[int, Tensor, Tensor]:
    bm = block_m(kernel, dt, INTERPRETED)
    return bm, *plan.tiles[bm]


def _ksum(src: Tensor, valid: Tensor, S: int, K: int) -> Tensor:
    """[S, D]: sum over the valid slots of each token of src [SK, D] (slot order)."""
    D = src.shape[1]
    out = src.new_empty(S, D)
    BS, BD = 16, min(128, max(16, triton.next_power_of_2(D)))
    if _RECORD is not None:
        _RECORD.append(Launch("ksum", dkey(src.dtype), (src, valid, out, S, D, K), {"BS": BS, "BD": BD}))
        return out
    K_._ksum_kernel[(triton.cdiv(S, BS), triton.cdiv(D, BD))](src, valid, out, S, D, K, BS=BS, BD=BD)
    return out


def _valid_u8(valid: Tensor) -> Tensor:
    return valid.reshape(-1).contiguous().view(torch.uint8)


def up_forward(x: Tensor, w1: Tensor, w3: Tensor | None, plan: Plan,
               store_pre: bool) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """(h1, h3, act), each [SK, F] by sorted row or None: the pre-activations when ``store_pre``
    (training; h3 only for SwiGLU), else the activation (inference)."""
    SK, E = plan.order.numel(), plan.n_experts
    D, F = w1.shape[1], w1.shape[2]
    gated, dt = w3 is not None, dkey(x.dtype)
    if w3 is not None:
        assert w3.stride() == w1.stride()
    h1 = x.new_empty(SK, F) if store_pre else None
    h3 = x.new_empty(SK, F) if store_pre and gated else None
    act = None if store_pre else x.new_empty(SK, F)
    out = h1 if store_pre else act
    bm, tile_expert, tile_row = _tiles(plan, "up_fwd", dt)
    _launch("up_fwd", dt, _row_grid(plan, bm, F),
            (x, x.stride(0), x.stride(1), w1, w3 if gated else w1, *w1.stride(), plan.order, tile_expert, tile_row,
             plan.ends, h1 if h1 is not None else out, h3 if h3 is not None else out, act if act is not None else out,
             D, F, plan.top_k, E),
            BM=bm, GATED=gated, STORE_PRE=store_pre, STORE_ACT=not store_pre, PREC=precision(x.dtype))
    return h1, h3, act


def down_forward(hid: Tensor, h3: Tensor | None, w2: Tensor, weights: Tensor, valid: Tensor, plan: Plan,
                 act: str) -> Tensor:
    """out [S, D] = sum over valid slots of w * act W2[e]. ``act``: "swiglu" (hid = h1, plus h3),
    "relu" (hid = h1) or "none" (hid = the activation). K = 1 writes the output directly."""
    S, K, E = plan.n_tokens, plan.top_k, plan.n_experts
    SK = plan.order.numel()
    F, D = w2.shape[1], w2.shape[2]
    dt = dkey(hid.dtype)
    # K = 1: slot == token, the kernel writes the output itself (zeros for the tokens it skips)
    y = hid.new_zeros(S, D) if K == 1 else hid.new_empty(SK, D)
    bm, tile_expert, tile_row = _tiles(plan, "down_fwd", dt)
    _launch("down_fwd", dt, _row_grid(plan, bm, D),
            (hid, hid if h3 is None else h3, w2, *w2.stride(), weights.reshape(-1).contiguous(), plan.order,
             tile_expert, tile_row, plan.ends, y, D, F, E),
            BM=bm, ACT={"none": 0, "swiglu": 1, "relu": 2}[act], PREC=precision(hid.dtype))
    return y if K == 1 else _ksum(y, _valid_u8(valid), S, K)


def act_backward(dout: Tensor, w2: Tensor, weights: Tensor, h1: Tensor, h3: Tensor | None, plan: Plan,
                 need_dh: bool, need_dw: bool) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """(dh1, dh3, dweights): gradients of the pre-activations [SK, F] by sorted row (when ``need_dh``)
    and of the routing weights [SK] fp32 by slot (when ``need_dw``; 0 on invalid slots)."""
    SK, E = plan.order.numel(), plan.n_experts
    F, D = w2.shape[1], w2.shape[2]
    gated, dt = h3 is not None, dkey(h1.dtype)
    dh1 = h1.new_empty(SK, F) if need_dh else None
    dh3 = h1.new_empty(SK, F) if need_dh and gated else None
    # one partial per PART hidden units, whatever BN the autotuner picked: a BN tile writes its sum into its
    # first PART chunk and zeros into the others, so every config overwrites the same entries (autotuning
    # re-runs kernels) and part.sum(0) never counts a chunk twice
    part = torch.zeros(n_parts(F, dt) if need_dw else 1, SK, dtype=torch.float32, device=h1.device)
    bm, tile_expert, tile_row = _tiles(plan, "act_bwd", dt)
    _launch("act_bwd", dt, _row_grid(plan, bm, F),
            (dout, dout.stride(0), dout.stride(1), w2, *w2.stride(), weights.reshape(-1).contiguous(), plan.order,
             tile_expert, tile_row, plan.ends, h1, h1 if h3 is None else h3, h1 if dh1 is None else dh1,
             h1 if dh3 is None else dh3, part, SK, D, F, plan.top_k, E),
            BM=bm, PART=PART_UNITS, GATED=gated, NEED_DH=need_dh, NEED_DW=need_dw, PREC=precision(h1.dtype))
    return dh1, dh3, part.sum(0) if need_dw else None


def act_dx_backward(dout: Tensor, w1: Tensor, w3: Tensor | None, w2: Tensor, weights: Tensor, h1: Tensor,
                    h3: Tensor | None, valid: Tensor, plan: Plan, store_dh: bool,
                    need_dw: bool) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """(dx [S, D], dh1, dh3, dweights) in one pass over the hidden units per row tile (D <= DX_FUSE_MAX):
    the pre-activation gradients [SK, F] only when ``store_dh`` (for the weight gradients), the routing
    weights' [SK] fp32 when ``need_dw``."""
    SK, S, K, E = plan.order.numel(), plan.n_tokens, plan.top_k, plan.n_experts
    D, F = w1.shape[1], w1.shape[2]
    gated, dt = h3 is not None, dkey(h1.dtype)
    dh1 = h1.new_empty(SK, F) if store_dh else None
    dh3 = h1.new_empty(SK, F) if store_dh and gated else None
    dw = torch.zeros(SK if need_dw else 1, dtype=torch.float32, device=h1.device)
    dxs = h1.new_zeros(S, D) if K == 1 else h1.new_empty(SK, D)
    bm, tile_expert, tile_row = _tiles(plan, "act_dx", dt)
    G = tile_expert.numel()
    _launch("act_dx", dt, lambda meta: (G,),
            (dout, dout.stride(0), dout.stride(1), w1, w3 if gated else w1, *w1.stride(), w2, *w2.stride(),
             weights.reshape(-1).contiguous(), plan.order, tile_expert, tile_row, plan.ends, h1,
             h1 if h3 is None else h3, h1 if dh1 is None else dh1, h1 if dh3 is None else dh3, dw, dxs, D, F,
             plan.top_k, E),
            BM=bm, DP=next_pow2(D), GATED=gated, STORE_DH=store_dh, NEED_DW=need_dw, PREC=precision(h1.dtype))
    gx = dxs if K == 1 else _ksum(dxs, _valid_u8(valid), S, K)
    return gx, dh1, dh3, dw if need_dw else None


def dx_backward(dh1: Tensor, dh3: Tensor | None, w1: Tensor, w3: Tensor | None, valid: Tensor,
                plan: Plan) -> Tensor:
    """dx [S, D] = sum over valid slots of dh1 W1[e]^T + dh3 W3[e]^T (K = 1: written directly)."""
    SK, S, K, E = plan.order.numel(), plan.n_tokens, plan.top_k, plan.n_experts
    D, F = w1.shape[1], w1.shape[2]
    gated, dt = dh3 is not None, dkey(dh1.dtype)
    if gated:
        assert w3 is not None and w3.stride() == w1.stride()
    dxs = dh1.new_zeros(S, D) if K == 1 else dh1.new_empty(SK, D)
    bm, tile_expert, tile_row = _tiles(plan, "dx", dt)
    _launch("dx", dt, _row_grid(plan, bm, D),
            (dh1, dh3 if gated else dh1, w1, w3 if gated else w1, *w1.stride(), plan.order, tile_expert, tile_row,
             plan.ends, dxs, D, F, E),
            BM=bm, GATED=gated, PREC=precision(dh1.dtype))
    return dxs if K == 1 else _ksum(dxs, _valid_u8(valid), S, K)


def wgrad_up(x: Tensor, dh1: Tensor, dh3: Tensor | None, plan: Plan) -> tuple[Tensor, Tensor | None]:
    """(dW1, dW3) [E, D, F]: per-expert x[tok]^T dh over the expert's rows (zeros for empty experts)."""
    E, D, F = plan.n_experts, x.shape[1], dh1.shape[1]
    gated, dt = dh3 is not None, dkey(dh1.dtype)
    gw1 = dh1.new_empty(E, D, F)
    gw3 = dh1.new_empty(E, D, F) if gated else None
    _launch("wgrad_up", dt, lambda meta: (triton.cdiv(F, meta["BN"]), triton.cdiv(D, meta["BM"]), E),
            (x, x.stride(0), x.stride(1), dh1, dh3 if gated else dh1, plan.order, plan.starts, plan.ends, gw1,
             gw3 if gated else gw1, D, F, plan.top_k),
            GATED=gated, PREC=precision(dh1.dtype))
    return gw1, gw3


def wgrad_down(h1: Tensor, h3: Tensor | None, dout: Tensor, weights: Tensor, plan: Plan) -> Tensor:
    """dW2 [E, F, D]: per-expert act^T (w * dout[tok]) over the expert's rows (zeros for empty experts)."""
    E, F, D = plan.n_experts, h1.shape[1], dout.shape[1]
    gated, dt = h3 is not None, dkey(h1.dtype)
    gw2 = h1.new_empty(E, F, D)
    _launch("wgrad_down", dt, lambda meta: (triton.cdiv(D, meta["BN"]), triton.cdiv(F, meta["BM"]), E),
            (h1, h3 if gated else h1, dout, dout.stride(0), dout.stride(1), weights.reshape(-1).contiguous(),
             plan.order, plan.starts, plan.ends, gw2, D, F, plan.top_k),
            GATED=gated, PREC=precision(h1.dtype))
    return gw2
