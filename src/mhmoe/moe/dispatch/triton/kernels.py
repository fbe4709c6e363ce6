"""The Triton kernels of the dropless grouped MoE path (``@triton.jit`` functions only; the launch
configs, the tile table and the launch wrappers are in :mod:`mhmoe.moe.dispatch.triton.launch`).

Shape legend: S routed (sub-)tokens, K slots per token, SK = S*K slots, E experts, D expert in/out
width, F expert hidden width, G tiles (an upper bound on the BM-row tiles of all experts).

Rows: the SK slots sorted (stably) by expert -- sorted row r is slot ``order[r]`` = token
``order[r] // K``; expert e owns rows [starts[e], ends[e]); invalid slots sort last and belong to no
tile. Hidden buffers [SK, F] are indexed by sorted row; [SK, D] buffers by slot; x, dout by token.
Tile table: tile t covers rows [tile_row[t], min(tile_row[t] + BM, ends[tile_expert[t]])) of expert
tile_expert[t]; tiles past the real ones have tile_expert = E and their programs return at once.

The algorithm is described in :mod:`mhmoe.moe.dispatch.triton.ops`. This module needs triton. Whether
the kernels run compiled or under the interpreter is fixed when this module is imported
(``TRITON_INTERPRET=1`` is read by ``@triton.jit``); :data:`INTERPRETED` says which.
"""

from __future__ import annotations

import triton
import triton.language as tl

# --------------------------------------------------------------------------------------------- kernels


@triton.jit
def _probe():
    pass


INTERPRETED = type(_probe).__name__ == "InterpretedFunction"


def _interpreter_numpy_compat() -> None:
    """Triton's interpreter before 3.7 turns a scalar kernel argument into a Python int with ``int()`` of a
    one-element array, which numpy 2.4 and later refuse, so every ``range(0, D, BK)`` over a scalar argument
    fails; make it squeeze the array first, as newer tritons do (the interpreter only: CPU tests)."""
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "mhmoe_compat", False):
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched.mhmoe_compat = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


if INTERPRETED:
    _interpreter_numpy_compat()


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


@triton.jit
def _act_dx_kernel(
    dout_ptr, sd_s, sd_d,  # dout [S, D] (any strides)
    w1_ptr, w3_ptr, sw_e, sw_d, sw_f,  # W1, W3 [E, D, F] (same strides)
    w2_ptr, s2_e, s2_f, s2_d,  # W2 [E, F, D]
    weights_ptr,  # [SK] by slot
    order_ptr, tile_expert_ptr, tile_row_ptr, ends_ptr,
    h1_ptr, h3_ptr,  # [SK, F] saved pre-activations
    dh1_ptr, dh3_ptr,  # out (STORE_DH): [SK, F] gradients of the pre-activations
    dw_ptr,  # out (NEED_DW): [SK] fp32 routing-weight gradients by slot
    dx_ptr,  # out: [SK, D] by slot ([S, D] by token when K = 1)
    D, F, K, E,
    BM: tl.constexpr, BN: tl.constexpr, DP: tl.constexpr,
    GATED: tl.constexpr, STORE_DH: tl.constexpr, NEED_DW: tl.constexpr, PREC: tl.constexpr,
):
    """act_bwd and dx in one pass over the hidden units for one tile of BM rows (D <= DP, a power of two).
    The tile's dout rows [BM, DP] are loaded once; for every BN-wide slice of the hidden units:
    G = dout W2[e]^T (one MMA, reduction over D), the SwiGLU / ReLU backward gives dh1, dh3 (stored for the
    weight gradients when STORE_DH), and dx += [dh1 | dh3] [W1[e]^T ; W3[e]^T] (one MMA over 2 BN, the two
    operands interleaved) into a [BM, DP] fp32 accumulator -- the hidden gradients are never read back for
    dx. The routing-weight gradient <act, G> is summed over all hidden units in registers, written once."""
    pid_t = tl.program_id(0)
    e = tl.load(tile_expert_ptr + pid_t)
    if e >= E:
        return
    row0 = tl.load(tile_row_ptr + pid_t)
    rows = row0 + tl.arange(0, BM)
    rmask = rows < tl.load(ends_ptr + e)
    slot = tl.load(order_ptr + rows, mask=rmask, other=0).to(tl.int64)
    e64 = e.to(tl.int64)
    w = tl.load(weights_ptr + slot, mask=rmask, other=0.0).to(tl.float32)
    dcols = tl.arange(0, DP)
    dmask = dcols < D
    dt = h1_ptr.dtype.element_ty
    a = tl.load(dout_ptr + (slot // K)[:, None] * sd_s + dcols[None, :] * sd_d, mask=rmask[:, None] & dmask[None, :],
                other=0.0)  # dout rows gathered by token, once
    dx = tl.zeros((BM, DP), dtype=tl.float32)
    dw = tl.zeros((BM,), dtype=tl.float32)
    for f0 in range(0, F, BN):
        cols = f0 + tl.arange(0, BN)
        cmask = cols < F
        b = tl.load(w2_ptr + e64 * s2_e + (cols[None, :] * s2_f + dcols[:, None] * s2_d),
                    mask=dmask[:, None] & cmask[None, :], other=0.0)  # W2[e]^T slice [DP, BN]
        acc = _mma(a, b, tl.zeros((BM, BN), dtype=tl.float32), PREC)
        hid = rows.to(tl.int64)[:, None] * F + cols[None, :]
        hmask = rmask[:, None] & cmask[None, :]
        h1 = tl.load(h1_ptr + hid, mask=hmask, other=0.0).to(tl.float32)
        da = acc * w[:, None]
        wt = e64 * sw_e + (dcols[None, :] * sw_d + cols[:, None] * sw_f)  # W^T slice [BN, DP]: (f, d)
        wmask = cmask[:, None] & dmask[None, :]
        if GATED:
            h3 = tl.load(h3_ptr + hid, mask=hmask, other=0.0).to(tl.float32)
            sig = 1.0 / (1.0 + tl.exp(-h1))
            silu = h1 * sig
            if NEED_DW:
                dw += tl.sum(silu * h3 * acc, axis=1)
            g1 = _to(da * h3 * sig * (1.0 + h1 * (1.0 - sig)), dt)
            g3 = _to(da * silu, dt)
            if STORE_DH:
                tl.store(dh1_ptr + hid, g1, mask=hmask)
                tl.store(dh3_ptr + hid, g3, mask=hmask)
            ga = tl.reshape(tl.join(g1, g3), (BM, 2 * BN))  # column 2 f + j: dh1 (j = 0), dh3 (j = 1)
            wb = tl.reshape(tl.permute(tl.join(tl.load(w1_ptr + wt, mask=wmask, other=0.0),
                                               tl.load(w3_ptr + wt, mask=wmask, other=0.0)), (0, 2, 1)),
                            (2 * BN, DP))  # row 2 f + j: W1[e]^T (j = 0), W3[e]^T (j = 1)
            dx = _mma(ga, wb, dx, PREC)
        else:
            if NEED_DW:
                dw += tl.sum(tl.maximum(h1, 0.0) * acc, axis=1)
            g1 = _to(tl.where(h1 > 0.0, da, 0.0), dt)
            if STORE_DH:
                tl.store(dh1_ptr + hid, g1, mask=hmask)
            dx = _mma(g1, tl.load(w1_ptr + wt, mask=wmask, other=0.0), dx, PREC)
    if NEED_DW:
        tl.store(dw_ptr + slot, dw, mask=rmask)
    tl.store(dx_ptr + slot[:, None] * D + dcols[None, :], _to(dx, dx_ptr.dtype.element_ty),
             mask=rmask[:, None] & dmask[None, :])
