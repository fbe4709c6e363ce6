"""Triton kernels of the dropless grouped MoE path and their launch wrappers (tensors in, tensors out).

Shape legend: S routed (sub-)tokens, K slots per token, SK = S*K slots, E experts, D expert in/out
width, F expert hidden width, G tiles (an upper bound on the BLOCK_M row tiles of all experts).

Rows: the SK slots sorted (stably) by expert -- sorted row r is slot ``order[r]`` = token
``order[r] // K``; expert e owns rows [starts[e], ends[e]); invalid slots sort last and belong to no
tile. Hidden buffers [SK, F] are indexed by sorted row; [SK, D] buffers by slot; x, dout by token.
Tile table (:func:`route_plan`): tile t covers rows [tile_row[t], min(tile_row[t] + BLOCK_M,
ends[tile_expert[t]])) of expert tile_expert[t]; tiles past the real ones have tile_expert = E and
their programs return at once.

The algorithm is described in :mod:`mhmoe.moe.dispatch.triton.ops`. This module needs triton; it is imported on
first use. Whether the kernels run compiled or under the interpreter is fixed when this module is
imported (``TRITON_INTERPRET=1`` is read by ``@triton.jit``); :data:`INTERPRETED` says which.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

# --------------------------------------------------------------------------------------------- kernels


@triton.jit
def _probe():
    pass


INTERPRETED = type(_probe).__name__ == "InterpretedFunction"


def _mma_body(a, b, acc, PREC: tl.constexpr):
    """acc + a @ b, fp32 accumulation."""
    return tl.dot(a, b, acc, input_precision=PREC)


def _mma_upcast(a, b, acc, PREC):
    """Interpreter version, a plain function (a nested jit call costs the interpreter ~2 ms): the
    interpreter's tl.dot mishandles bf16 operands, so upcast them first -- the same products, as
    bf16 x bf16 is exact in fp32."""
    return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")


_mma = _mma_upcast if INTERPRETED else triton.jit(_mma_body)


def _to_body(x, dtype: tl.constexpr):
    """x cast to dtype (round to nearest even, the GPU's default for downcasts)."""
    return x.to(dtype)


def _to_rtne(x, dtype):
    """Interpreter version: its fp32 -> bf16 cast truncates, so round to nearest even by hand first."""
    if dtype == tl.bfloat16 and x.dtype == tl.float32:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


_to = _to_rtne if INTERPRETED else triton.jit(_to_body)


@triton.jit
def _up_fwd_kernel(
    x_ptr, sx_s, sx_d,  # x [S, D] (any strides)
    w1_ptr, w3_ptr, sw_e, sw_d, sw_f,  # W1, W3 [E, D, F] (same strides)
    order_ptr, tile_expert_ptr, tile_row_ptr, ends_ptr,
    h1_ptr, h3_ptr, act_ptr,  # out: [SK, F] by sorted row
    D, F, K, E,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    GATED: tl.constexpr, STORE_PRE: tl.constexpr, STORE_ACT: tl.constexpr, PREC: tl.constexpr,
):
    """h1 = x[tok] W1[e], h3 = x[tok] W3[e] for one [BM rows, BN hidden] tile; x rows gathered by token.
    Stores the pre-activations (training) and/or the activation silu(h1)*h3 | relu(h1) (inference)."""
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(tile_expert_ptr + pid_t)
    if e >= E:
        return
    row0 = tl.load(tile_row_ptr + pid_t)
    rows = row0 + tl.arange(0, BM)
    rmask = rows < tl.load(ends_ptr + e)
    tok = (tl.load(order_ptr + rows, mask=rmask, other=0) // K).to(tl.int64)
    cols = pid_n * BN + tl.arange(0, BN)
    cmask = cols < F
    ks = tl.arange(0, BK)
    a_base = x_ptr + tok[:, None] * sx_s
    b_base = e.to(tl.int64) * sw_e + cols[None, :] * sw_f
    acc1 = tl.zeros((BM, BN), dtype=tl.float32)
    acc3 = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, D, BK):
        kk = k0 + ks
        kmask = kk < D
        a = tl.load(a_base + kk[None, :] * sx_d, mask=rmask[:, None] & kmask[None, :], other=0.0)
        b_off = b_base + kk[:, None] * sw_d
        bmask = kmask[:, None] & cmask[None, :]
        acc1 = _mma(a, tl.load(w1_ptr + b_off, mask=bmask, other=0.0), acc1, PREC)
        if GATED:
            acc3 = _mma(a, tl.load(w3_ptr + b_off, mask=bmask, other=0.0), acc3, PREC)
    out = rows.to(tl.int64)[:, None] * F + cols[None, :]
    omask = rmask[:, None] & cmask[None, :]
    if STORE_PRE:
        tl.store(h1_ptr + out, _to(acc1, h1_ptr.dtype.element_ty), mask=omask)
        if GATED:
            tl.store(h3_ptr + out, _to(acc3, h3_ptr.dtype.element_ty), mask=omask)
    if STORE_ACT:
        if GATED:
            act = acc1 * (1.0 / (1.0 + tl.exp(-acc1))) * acc3
        else:
            act = tl.maximum(acc1, 0.0)
        tl.store(act_ptr + out, _to(act, act_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _down_fwd_kernel(
    h1_ptr, h3_ptr,  # [SK, F] by sorted row: pre-activations (ACT 1, 2) or the activation (ACT 0)
    w2_ptr, sw_e, sw_f, sw_d,  # W2 [E, F, D]
    weights_ptr,  # [SK] routing weights by slot
    order_ptr, tile_expert_ptr, tile_row_ptr, ends_ptr,
    y_ptr,  # out: [SK, D] by slot (w[slot] * y_slot)
    D, F, E,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ACT: tl.constexpr, PREC: tl.constexpr,
):
    """y[slot] = w[slot] * act[row] W2[e] for one [BM rows, BN out] tile; the activation is computed
    from the stored pre-activations on load (ACT 1: silu(h1)*h3, 2: relu(h1), 0: stored as is);
    the epilogue scatters the rows back to slot order (inverse permutation, no collisions)."""
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(tile_expert_ptr + pid_t)
    if e >= E:
        return
    row0 = tl.load(tile_row_ptr + pid_t)
    rows = row0 + tl.arange(0, BM)
    rmask = rows < tl.load(ends_ptr + e)
    slot = tl.load(order_ptr + rows, mask=rmask, other=0).to(tl.int64)
    cols = pid_n * BN + tl.arange(0, BN)
    cmask = cols < D
    ks = tl.arange(0, BK)
    a_base = rows.to(tl.int64)[:, None] * F
    b_base = e.to(tl.int64) * sw_e + cols[None, :] * sw_d
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, F, BK):
        kk = k0 + ks
        kmask = kk < F
        amask = rmask[:, None] & kmask[None, :]
        a = tl.load(h1_ptr + a_base + kk[None, :], mask=amask, other=0.0)
        if ACT == 1:
            h = a.to(tl.float32)
            g = tl.load(h3_ptr + a_base + kk[None, :], mask=amask, other=0.0).to(tl.float32)
            a = _to(h * (1.0 / (1.0 + tl.exp(-h))) * g, h1_ptr.dtype.element_ty)
        elif ACT == 2:
            a = _to(tl.maximum(a.to(tl.float32), 0.0), h1_ptr.dtype.element_ty)
        b = tl.load(w2_ptr + b_base + kk[:, None] * sw_f, mask=kmask[:, None] & cmask[None, :], other=0.0)
        acc = _mma(a, b, acc, PREC)
    w = tl.load(weights_ptr + slot, mask=rmask, other=0.0).to(tl.float32)
    acc = acc * w[:, None]
    tl.store(y_ptr + slot[:, None] * D + cols[None, :], _to(acc, y_ptr.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _ksum_kernel(
    src_ptr,  # [SK, D] by slot
    valid_ptr,  # [SK] uint8
    out_ptr,  # [S, D]
    S, D, K,
    BS: tl.constexpr, BD: tl.constexpr,
):
    """out[s] = sum over valid k of src[s*K + k], in slot order k = 0..K-1 (deterministic, fp32 sum)."""
    rows = tl.program_id(0) * BS + tl.arange(0, BS)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    rmask = rows < S
    cmask = cols < D
    acc = tl.zeros((BS, BD), dtype=tl.float32)
    for k in range(0, K):
        slot = rows.to(tl.int64) * K + k
        v = tl.load(valid_ptr + slot, mask=rmask, other=0) != 0
        acc += tl.load(src_ptr + slot[:, None] * D + cols[None, :], mask=v[:, None] & cmask[None, :],
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :], _to(acc, out_ptr.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _act_bwd_kernel(
    dout_ptr, sd_s, sd_d,  # dout [S, D] (any strides)
    w2_ptr, sw_e, sw_f, sw_d,  # W2 [E, F, D]
    weights_ptr,  # [SK] by slot
    order_ptr, tile_expert_ptr, tile_row_ptr, ends_ptr,
    h1_ptr, h3_ptr,  # [SK, F] saved pre-activations
    dh1_ptr, dh3_ptr,  # out: [SK, F] gradients of the pre-activations
    part_ptr,  # out: [n_parts, SK] fp32 partial sums of d weights, by slot
    SK, D, F, K, E,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PART: tl.constexpr,
    GATED: tl.constexpr, NEED_DH: tl.constexpr, NEED_DW: tl.constexpr, PREC: tl.constexpr,
):
    """G = dout[tok] W2[e]^T for one [BM rows, BN hidden] tile (dout gathered by token); epilogue:
    dact = w * G -> SwiGLU / ReLU backward -> dh1, dh3; and the routing-weight gradient's partial
    sum <act, G> over these BN hidden units (d w[slot] = <y_slot, dout[tok]> = <act, dout W2^T>)."""
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(tile_expert_ptr + pid_t)
    if e >= E:
        return
    row0 = tl.load(tile_row_ptr + pid_t)
    rows = row0 + tl.arange(0, BM)
    rmask = rows < tl.load(ends_ptr + e)
    slot = tl.load(order_ptr + rows, mask=rmask, other=0).to(tl.int64)
    tok = slot // K
    cols = pid_n * BN + tl.arange(0, BN)
    cmask = cols < F
    ks = tl.arange(0, BK)
    a_base = dout_ptr + tok[:, None] * sd_s
    b_base = e.to(tl.int64) * sw_e + cols[None, :] * sw_f  # W2[e]^T: element (d, f) at f*sw_f + d*sw_d
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, D, BK):
        kk = k0 + ks
        kmask = kk < D
        a = tl.load(a_base + kk[None, :] * sd_d, mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(w2_ptr + b_base + kk[:, None] * sw_d, mask=kmask[:, None] & cmask[None, :], other=0.0)
        acc = _mma(a, b, acc, PREC)
    hid = rows.to(tl.int64)[:, None] * F + cols[None, :]
    hmask = rmask[:, None] & cmask[None, :]
    h1 = tl.load(h1_ptr + hid, mask=hmask, other=0.0).to(tl.float32)
    w = tl.load(weights_ptr + slot, mask=rmask, other=0.0).to(tl.float32)
    da = acc * w[:, None]
    if GATED:
        h3 = tl.load(h3_ptr + hid, mask=hmask, other=0.0).to(tl.float32)
        sig = (1.0 / (1.0 + tl.exp(-h1)))
        silu = h1 * sig
        act = silu * h3
        if NEED_DH:
            tl.store(dh3_ptr + hid, _to(da * silu, dh3_ptr.dtype.element_ty), mask=hmask)
            dh1 = da * h3 * sig * (1.0 + h1 * (1.0 - sig))
            tl.store(dh1_ptr + hid, _to(dh1, dh1_ptr.dtype.element_ty), mask=hmask)
    else:
        act = tl.maximum(h1, 0.0)
        if NEED_DH:
            tl.store(dh1_ptr + hid, _to(tl.where(h1 > 0.0, da, 0.0), dh1_ptr.dtype.element_ty), mask=hmask)
    if NEED_DW:
        # one partial per PART hidden units, whatever BN the autotuner picked: a BN tile writes its sum
        # into its first PART chunk and zeros into the others, so every config overwrites the same
        # entries (autotuning re-runs kernels) and part.sum(0) never counts a chunk twice. part has
        # room for the widest config's tiles (n_parts() rows): chunks past F only ever get zeros.
        chunk = pid_n * (BN // PART)
        tl.store(part_ptr + chunk.to(tl.int64) * SK + slot, tl.sum(act * acc, axis=1), mask=rmask)
        for j in tl.static_range(1, BN // PART):
            tl.store(part_ptr + (chunk + j).to(tl.int64) * SK + slot, tl.zeros((BM,), dtype=tl.float32), mask=rmask)


@triton.jit
def _dx_kernel(
    dh1_ptr, dh3_ptr,  # [SK, F] by sorted row
    w1_ptr, w3_ptr, sw_e, sw_d, sw_f,  # W1, W3 [E, D, F] (same strides)
    order_ptr, tile_expert_ptr, tile_row_ptr, ends_ptr,
    dx_ptr,  # out: [SK, D] by slot
    D, F, E,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GATED: tl.constexpr, PREC: tl.constexpr,
):
    """dx[slot] = dh1 W1[e]^T + dh3 W3[e]^T for one [BM rows, BN in] tile, scattered to slot order."""
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(tile_expert_ptr + pid_t)
    if e >= E:
        return
    row0 = tl.load(tile_row_ptr + pid_t)
    rows = row0 + tl.arange(0, BM)
    rmask = rows < tl.load(ends_ptr + e)
    slot = tl.load(order_ptr + rows, mask=rmask, other=0).to(tl.int64)
    cols = pid_n * BN + tl.arange(0, BN)
    cmask = cols < D
    ks = tl.arange(0, BK)
    a_base = rows.to(tl.int64)[:, None] * F
    b_base = e.to(tl.int64) * sw_e + cols[None, :] * sw_d  # W^T: element (f, d) at d*sw_d + f*sw_f
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, F, BK):
        kk = k0 + ks
        kmask = kk < F
        amask = rmask[:, None] & kmask[None, :]
        b_off = b_base + kk[:, None] * sw_f
        bmask = kmask[:, None] & cmask[None, :]
        a = tl.load(dh1_ptr + a_base + kk[None, :], mask=amask, other=0.0)
        acc = _mma(a, tl.load(w1_ptr + b_off, mask=bmask, other=0.0), acc, PREC)
        if GATED:
            a = tl.load(dh3_ptr + a_base + kk[None, :], mask=amask, other=0.0)
            acc = _mma(a, tl.load(w3_ptr + b_off, mask=bmask, other=0.0), acc, PREC)
    tl.store(dx_ptr + slot[:, None] * D + cols[None, :], _to(acc, dx_ptr.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _wgrad_up_kernel(
    x_ptr, sx_s, sx_d,  # x [S, D] (any strides)
    dh1_ptr, dh3_ptr,  # [SK, F] by sorted row
    order_ptr, starts_ptr, ends_ptr,
    gw1_ptr, gw3_ptr,  # out: [E, D, F] contiguous
    D, F, K,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GATED: tl.constexpr, PREC: tl.constexpr,
):
    """dW1[e] = x[tok]^T dh1, dW3[e] = x[tok]^T dh3 for one [BM in, BN hidden] tile of expert e,
    reduced over the expert's rows in BK-row steps (x rows gathered by token); no rows -> zeros."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    e = tl.program_id(2)
    start = tl.load(starts_ptr + e)
    end = tl.load(ends_ptr + e)
    dcols = pid_m * BM + tl.arange(0, BM)
    fcols = pid_n * BN + tl.arange(0, BN)
    dmask = dcols < D
    fmask = fcols < F
    ks = tl.arange(0, BK)
    acc1 = tl.zeros((BM, BN), dtype=tl.float32)
    acc3 = tl.zeros((BM, BN), dtype=tl.float32)
    for r0 in range(start, end, BK):
        rows = r0 + ks
        rm = rows < end
        tok = (tl.load(order_ptr + rows, mask=rm, other=0) // K).to(tl.int64)
        xt = tl.load(x_ptr + tok[None, :] * sx_s + dcols[:, None] * sx_d, mask=dmask[:, None] & rm[None, :],
                     other=0.0)  # [BM, BK] = x[tok]^T
        hid = rows.to(tl.int64)[:, None] * F + fcols[None, :]
        hmask = rm[:, None] & fmask[None, :]
        acc1 = _mma(xt, tl.load(dh1_ptr + hid, mask=hmask, other=0.0), acc1, PREC)
        if GATED:
            acc3 = _mma(xt, tl.load(dh3_ptr + hid, mask=hmask, other=0.0), acc3, PREC)
    out = e.to(tl.int64) * D * F + dcols[:, None] * F + fcols[None, :]
    omask = dmask[:, None] & fmask[None, :]
    tl.store(gw1_ptr + out, _to(acc1, gw1_ptr.dtype.element_ty), mask=omask)
    if GATED:
        tl.store(gw3_ptr + out, _to(acc3, gw3_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _wgrad_down_kernel(
    h1_ptr, h3_ptr,  # [SK, F] saved pre-activations by sorted row
    dout_ptr, sd_s, sd_d,  # dout [S, D] (any strides)
    weights_ptr,  # [SK] by slot
    order_ptr, starts_ptr, ends_ptr,
    gw2_ptr,  # out: [E, F, D] contiguous
    D, F, K,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GATED: tl.constexpr, PREC: tl.constexpr,
):
    """dW2[e] = act^T (w * dout[tok]) for one [BM hidden, BN out] tile of expert e: the activation is
    recomputed from the pre-activations on load, dout rows gathered by token and scaled by the
    routing weight on load; reduced over the expert's rows in BK-row steps; no rows -> zeros."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    e = tl.program_id(2)
    start = tl.load(starts_ptr + e)
    end = tl.load(ends_ptr + e)
    fcols = pid_m * BM + tl.arange(0, BM)
    dcols = pid_n * BN + tl.arange(0, BN)
    fmask = fcols < F
    dmask = dcols < D
    ks = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for r0 in range(start, end, BK):
        rows = r0 + ks
        rm = rows < end
        slot = tl.load(order_ptr + rows, mask=rm, other=0).to(tl.int64)
        hid = rows.to(tl.int64)[None, :] * F + fcols[:, None]  # [BM, BK] = act^T
        hmask = fmask[:, None] & rm[None, :]
        h = tl.load(h1_ptr + hid, mask=hmask, other=0.0).to(tl.float32)
        if GATED:
            g = tl.load(h3_ptr + hid, mask=hmask, other=0.0).to(tl.float32)
            at = h * (1.0 / (1.0 + tl.exp(-h))) * g
        else:
            at = tl.maximum(h, 0.0)
        w = tl.load(weights_ptr + slot, mask=rm, other=0.0).to(tl.float32)
        dy = tl.load(dout_ptr + (slot // K)[:, None] * sd_s + dcols[None, :] * sd_d,
                     mask=rm[:, None] & dmask[None, :], other=0.0).to(tl.float32) * w[:, None]
        dt = h1_ptr.dtype.element_ty
        acc = _mma(_to(at, dt), _to(dy, dt), acc, PREC)
    out = e.to(tl.int64) * F * D + fcols[:, None] * D + dcols[None, :]
    tl.store(gw2_ptr + out, _to(acc, gw2_ptr.dtype.element_ty), mask=fmask[:, None] & dmask[None, :])


# ------------------------------------------------------------------------------------- tile configs
#
# BLOCK_M (rows per tile of the row-tiled kernels) is fixed, not tuned: the tile table is built for it
# in torch before the launch. 64 rows keep the padding of small experts low (on average BLOCK_M/2 wasted
# rows per expert) and map onto one H100 warpgroup MMA (m64). The autotuner picks the other sizes per
# (D, F, dtype): BN/BK in 64..256 fit thin experts (D = 256..768) and hidden widths F = 512..2048.
# Under the interpreter: one fixed small config (autotuning interpreted kernels would take minutes).

BLOCK_M = 16 if INTERPRETED else 64
PART = 32 if INTERPRETED else 64  # hidden units per partial sum of the routing-weight gradient (<= every BN)


def _cfgs(rows: list[tuple[int, ...]], names: tuple[str, ...]) -> list[triton.Config]:
    return [triton.Config(dict(zip(names, r[:-2], strict=True)), num_warps=r[-2], num_stages=r[-1]) for r in rows]


# (BN, BK, num_warps, num_stages); "up" kernels: N = F, reduction over D; "down" kernels: N = D, over F
_UP_CFGS = _cfgs([(64, 64, 4, 3), (128, 64, 4, 3), (128, 32, 4, 4), (128, 64, 8, 3), (256, 64, 8, 3),
                  (64, 32, 4, 4)], ("BN", "BK"))
_DOWN_CFGS = _cfgs([(64, 64, 4, 3), (128, 64, 4, 3), (128, 32, 4, 4), (64, 128, 4, 3), (256, 64, 8, 3),
                    (128, 64, 8, 4)], ("BN", "BK"))
# (BM, BN, BK, num_warps, num_stages) for the weight gradients: reduction over an expert's rows
_WGRAD_CFGS = _cfgs([(64, 64, 32, 4, 3), (64, 128, 32, 4, 3), (128, 64, 32, 4, 3), (128, 128, 32, 8, 3),
                     (128, 128, 64, 8, 3), (64, 64, 64, 4, 4)], ("BM", "BN", "BK"))
_INTERP = {"up": {"BN": 64, "BK": 32}, "down": {"BN": 64, "BK": 32}, "wgrad": {"BM": 32, "BN": 64, "BK": 32}}


def _launcher(kernel, kind: str, configs: list[triton.Config], key: list[str]):
    """(kernel to index with a grid, fixed constexprs): autotuned on GPU, one small config interpreted."""
    if INTERPRETED:
        return kernel, _INTERP[kind]
    return triton.autotune(configs=configs, key=key)(kernel), {}


_UP_FWD = _launcher(_up_fwd_kernel, "up", _UP_CFGS, ["D", "F"])
_ACT_BWD = _launcher(_act_bwd_kernel, "up", _UP_CFGS, ["D", "F"])
_DOWN_FWD = _launcher(_down_fwd_kernel, "down", _DOWN_CFGS, ["D", "F"])
_DX = _launcher(_dx_kernel, "down", _DOWN_CFGS, ["D", "F"])
_WGRAD_UP = _launcher(_wgrad_up_kernel, "wgrad", _WGRAD_CFGS, ["D", "F"])
_WGRAD_DOWN = _launcher(_wgrad_down_kernel, "wgrad", _WGRAD_CFGS, ["D", "F"])
_UP_BN = [_INTERP["up"]["BN"]] if INTERPRETED else [c.kwargs["BN"] for c in _UP_CFGS]
assert all(bn % PART == 0 and max(_UP_BN) % bn == 0 for bn in _UP_BN)


def _n_parts(F: int) -> int:
    """Rows of the routing-weight partials: PART-wide chunks of F rounded up to the widest BN."""
    return triton.cdiv(F, max(_UP_BN)) * (max(_UP_BN) // PART)


def _precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: fp32 inputs use TF32 only where torch's matmul would (allow_tf32)."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


# ------------------------------------------------------------------------------------- routing glue


class Plan(NamedTuple):
    """Device-side routing tables (no host sync to build them). order [SK] int32 (slot of every sorted
    row), starts/ends [E] int32 (row range of every expert), tile_expert/tile_row [G] int32."""

    order: Tensor
    starts: Tensor
    ends: Tensor
    tile_expert: Tensor
    tile_row: Tensor
    n_tokens: int
    top_k: int
    n_experts: int


def n_tiles(n_slots: int, n_experts: int, block_m: int) -> int:
    """Upper bound on the row tiles of all experts: sum_e ceil(c_e / M) <= floor(SK / M) + min(E, SK)."""
    return n_slots // block_m + min(n_experts, n_slots)


def route_plan(experts: Tensor, valid: Tensor, n_experts: int, block_m: int | None = None) -> Plan:
    """Sort the [S, K] slots by expert (invalid slots last) and build the tile table, all on the device.

    ``torch.sort`` gives the expert of every sorted row; ``searchsorted`` on it gives each expert's row
    range (unlike ``bincount``, whose output size is data-dependent on CUDA, it never synchronises).
    """
    block_m = BLOCK_M if block_m is None else block_m
    S, K = experts.shape
    E, SK, dev = n_experts, experts.numel(), experts.device
    key = torch.where(valid, experts, E).reshape(-1)
    sorted_key, order = torch.sort(key, stable=True)
    ends = torch.searchsorted(sorted_key, torch.arange(E, device=dev, dtype=sorted_key.dtype), right=True)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    tiles = (ends - starts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)
    t = torch.arange(n_tiles(SK, E, block_m), device=dev)
    tile_expert = torch.searchsorted(tile_end, t, right=True)  # E for the surplus tiles
    te = tile_expert.clamp_max(E - 1)
    tile_row = starts[te] + (t - (tile_end - tiles)[te]) * block_m
    i32 = torch.int32
    return Plan(order.to(i32), starts.to(i32), ends.to(i32), tile_expert.to(i32), tile_row.to(i32), S, K, E)


# --------------------------------------------------------------------------------------- launchers


def _ksum(src: Tensor, valid: Tensor, S: int, K: int) -> Tensor:
    """[S, D]: sum over the valid slots of each token of src [SK, D] (slot order)."""
    D = src.shape[1]
    out = src.new_empty(S, D)
    BS, BD = 16, min(128, max(16, triton.next_power_of_2(D)))
    _ksum_kernel[(triton.cdiv(S, BS), triton.cdiv(D, BD))](src, valid, out, S, D, K, BS=BS, BD=BD)
    return out


def _valid_u8(valid: Tensor) -> Tensor:
    return valid.reshape(-1).contiguous().view(torch.uint8)


def up_forward(x: Tensor, w1: Tensor, w3: Tensor | None, plan: Plan,
               store_pre: bool) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """(h1, h3, act), each [SK, F] by sorted row or None: the pre-activations when ``store_pre``
    (training; h3 only for SwiGLU), else the activation (inference)."""
    SK, E = plan.order.numel(), plan.n_experts
    D, F = w1.shape[1], w1.shape[2]
    gated = w3 is not None
    if gated:
        assert w3.stride() == w1.stride()
    h1 = x.new_empty(SK, F) if store_pre else None
    h3 = x.new_empty(SK, F) if store_pre and gated else None
    act = None if store_pre else x.new_empty(SK, F)
    any_out = h1 if store_pre else act
    kernel, fixed = _UP_FWD
    grid = lambda meta: (plan.tile_expert.numel(), triton.cdiv(F, meta["BN"]))  # noqa: E731
    kernel[grid](x, x.stride(0), x.stride(1), w1, w3 if gated else w1, *w1.stride(),
                 plan.order, plan.tile_expert, plan.tile_row, plan.ends,
                 any_out if h1 is None else h1, any_out if h3 is None else h3, any_out if act is None else act,
                 D, F, plan.top_k, E, BM=BLOCK_M, GATED=gated, STORE_PRE=store_pre, STORE_ACT=not store_pre,
                 PREC=_precision(x.dtype), **fixed)
    return h1, h3, act


def down_forward(hid: Tensor, h3: Tensor | None, w2: Tensor, weights: Tensor, valid: Tensor, plan: Plan,
                 act: str) -> Tensor:
    """out [S, D] = sum over valid slots of w * act W2[e]. ``act``: "swiglu" (hid = h1, plus h3),
    "relu" (hid = h1) or "none" (hid = the activation). K = 1 writes the output directly."""
    SK, S, K, E = plan.order.numel(), plan.n_tokens, plan.top_k, plan.n_experts
    F, D = w2.shape[1], w2.shape[2]
    # K = 1: slot == token, the kernel writes the output itself (zeros for the tokens it skips)
    y = hid.new_zeros(S, D) if K == 1 else hid.new_empty(SK, D)
    kernel, fixed = _DOWN_FWD
    grid = lambda meta: (plan.tile_expert.numel(), triton.cdiv(D, meta["BN"]))  # noqa: E731
    kernel[grid](hid, hid if h3 is None else h3, w2, *w2.stride(), weights.reshape(-1).contiguous(),
                 plan.order, plan.tile_expert, plan.tile_row, plan.ends, y, D, F, E,
                 BM=BLOCK_M, ACT={"none": 0, "swiglu": 1, "relu": 2}[act], PREC=_precision(hid.dtype), **fixed)
    return y if K == 1 else _ksum(y, _valid_u8(valid), S, K)


def act_backward(dout: Tensor, w2: Tensor, weights: Tensor, h1: Tensor, h3: Tensor | None, plan: Plan,
                 need_dh: bool, need_dw: bool) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """(dh1, dh3, dweights): gradients of the pre-activations [SK, F] by sorted row (when ``need_dh``)
    and of the routing weights [SK] fp32 by slot (when ``need_dw``; 0 on invalid slots)."""
    SK, E = plan.order.numel(), plan.n_experts
    F, D = w2.shape[1], w2.shape[2]
    gated = h3 is not None
    dh1 = h1.new_empty(SK, F) if need_dh else None
    dh3 = h1.new_empty(SK, F) if need_dh and gated else None
    part = torch.zeros(_n_parts(F) if need_dw else 1, SK, dtype=torch.float32, device=h1.device)
    kernel, fixed = _ACT_BWD
    grid = lambda meta: (plan.tile_expert.numel(), triton.cdiv(F, meta["BN"]))  # noqa: E731
    kernel[grid](dout, dout.stride(0), dout.stride(1), w2, *w2.stride(), weights.reshape(-1).contiguous(),
                 plan.order, plan.tile_expert, plan.tile_row, plan.ends,
                 h1, h1 if h3 is None else h3, h1 if dh1 is None else dh1, h1 if dh3 is None else dh3, part,
                 SK, D, F, plan.top_k, E, BM=BLOCK_M, PART=PART, GATED=gated, NEED_DH=need_dh,
                 NEED_DW=need_dw, PREC=_precision(h1.dtype), **fixed)
    return dh1, dh3, part.sum(0) if need_dw else None


def dx_backward(dh1: Tensor, dh3: Tensor | None, w1: Tensor, w3: Tensor | None, valid: Tensor,
                plan: Plan) -> Tensor:
    """dx [S, D] = sum over valid slots of dh1 W1[e]^T + dh3 W3[e]^T (K = 1: written directly)."""
    SK, S, K, E = plan.order.numel(), plan.n_tokens, plan.top_k, plan.n_experts
    D, F = w1.shape[1], w1.shape[2]
    gated = dh3 is not None
    if gated:
        assert w3.stride() == w1.stride()
    dxs = dh1.new_zeros(S, D) if K == 1 else dh1.new_empty(SK, D)
    kernel, fixed = _DX
    grid = lambda meta: (plan.tile_expert.numel(), triton.cdiv(D, meta["BN"]))  # noqa: E731
    kernel[grid](dh1, dh3 if gated else dh1, w1, w3 if gated else w1, *w1.stride(),
                 plan.order, plan.tile_expert, plan.tile_row, plan.ends, dxs, D, F, E,
                 BM=BLOCK_M, GATED=gated, PREC=_precision(dh1.dtype), **fixed)
    return dxs if K == 1 else _ksum(dxs, _valid_u8(valid), S, K)


def wgrad_up(x: Tensor, dh1: Tensor, dh3: Tensor | None, plan: Plan) -> tuple[Tensor, Tensor | None]:
    """(dW1, dW3) [E, D, F]: per-expert x[tok]^T dh over the expert's rows (zeros for empty experts)."""
    E, D, F = plan.n_experts, x.shape[1], dh1.shape[1]
    gated = dh3 is not None
    gw1 = dh1.new_empty(E, D, F)
    gw3 = dh1.new_empty(E, D, F) if gated else None
    kernel, fixed = _WGRAD_UP
    grid = lambda meta: (triton.cdiv(F, meta["BN"]), triton.cdiv(D, meta["BM"]), E)  # noqa: E731
    kernel[grid](x, x.stride(0), x.stride(1), dh1, dh3 if gated else dh1, plan.order, plan.starts, plan.ends,
                 gw1, gw3 if gated else gw1, D, F, plan.top_k, GATED=gated, PREC=_precision(dh1.dtype), **fixed)
    return gw1, gw3


def wgrad_down(h1: Tensor, h3: Tensor | None, dout: Tensor, weights: Tensor, plan: Plan) -> Tensor:
    """dW2 [E, F, D]: per-expert act^T (w * dout[tok]) over the expert's rows (zeros for empty experts)."""
    E, F, D = plan.n_experts, h1.shape[1], dout.shape[1]
    gated = h3 is not None
    gw2 = h1.new_empty(E, F, D)
    kernel, fixed = _WGRAD_DOWN
    grid = lambda meta: (triton.cdiv(D, meta["BN"]), triton.cdiv(F, meta["BM"]), E)  # noqa: E731
    kernel[grid](h1, h3 if gated else h1, dout, dout.stride(0), dout.stride(1), weights.reshape(-1).contiguous(),
                 plan.order, plan.starts, plan.ends, gw2, D, F, plan.top_k, GATED=gated,
                 PREC=_precision(h1.dtype), **fixed)
    return gw2
