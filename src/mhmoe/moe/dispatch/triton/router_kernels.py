"""The Triton kernels of the fused token-choice router (``@triton.jit`` functions only; the launches, the
custom ops and the autograd formula are in :mod:`mhmoe.moe.dispatch.triton.router`).

Shape legend: S routed (sub-)tokens, D router input width, E experts (EP = E rounded up to a power of two,
at least 16), K top-k slots, BM tokens per program, BK / BN reduction / output steps.

Exact fp32 scores from bf16 tensor-core MMAs: the fp32 router weight W [E, D] is stored as three bf16 parts,
W = W_hi + W_mid + W_lo exactly (each part the bf16 rounding of what the previous ones leave; 3 x 8 bits of
significand cover fp32's 24). A bf16 x bf16 product is exact in fp32, so for bf16 inputs
x W^T = x W_hi^T + x W_mid^T + x W_lo^T with fp32 accumulation is the fp32 product up to the order of the
fp32 additions. fp32 inputs are split the same way in registers, and the six products whose parts add up
to at least 2^-16 of the leading term are summed (i + j <= 2: hi.hi, hi.mid, mid.hi, hi.lo, mid.mid,
lo.hi), which leaves an error of the order of fp32 rounding. The backward GEMMs split the fp32 score
gradient the same way.

Every token's routing is a function of its own row of x (and W, the selection bias): no statistic across
tokens enters it, so it is causal. The per-expert counts and probability sums are per-program partial sums
([programs, EP], summed in torch): no atomics, deterministic.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mhmoe.moe.dispatch.triton.kernels import _mma, _to


@triton.jit
def _split3(x):
    """fp32 x -> (hi, mid, lo) bf16 with hi + mid + lo == x (exactly, in fp32)."""
    hi = _to(x, tl.bfloat16)
    r = x - hi.to(tl.float32)
    mid = _to(r, tl.bfloat16)
    lo = _to(r - mid.to(tl.float32), tl.bfloat16)
    return hi, mid, lo


@triton.jit
def _split_mma(a, b_hi, b_mid, b_lo, acc, A_SPLIT: tl.constexpr):
    """acc + a @ (b_hi + b_mid + b_lo) in fp32 from bf16 MMAs. a: bf16 (A_SPLIT False: exact operand) or fp32
    (A_SPLIT True: split in registers, six products)."""
    if A_SPLIT:
        a_hi, a_mid, a_lo = _split3(a.to(tl.float32))
        acc = _mma(a_lo, b_hi, acc, "tf32")
        acc = _mma(a_mid, b_mid, acc, "tf32")
        acc = _mma(a_hi, b_lo, acc, "tf32")
        acc = _mma(a_mid, b_hi, acc, "tf32")
        acc = _mma(a_hi, b_mid, acc, "tf32")
        acc = _mma(a_hi, b_hi, acc, "tf32")
    else:
        a = a.to(tl.bfloat16)
        acc = _mma(a, b_lo, acc, "tf32")
        acc = _mma(a, b_mid, acc, "tf32")
        acc = _mma(a, b_hi, acc, "tf32")
    return acc


@triton.jit
def _gate(logits, cmask, SIGMOID: tl.constexpr):
    """(gate, probs) [BM, EP] of the scores: softmax (gate = probs) or sigmoid (probs = gate / row sum);
    columns past E (cmask False) get 0."""
    if SIGMOID:
        gate = tl.where(cmask[None, :], 1.0 / (1.0 + tl.exp(-logits)), 0.0)
        probs = gate / tl.sum(gate, axis=1)[:, None]
    else:
        z = tl.where(cmask[None, :], logits, float("-inf"))
        p = tl.exp(z - tl.max(z, axis=1)[:, None])
        probs = p / tl.sum(p, axis=1)[:, None]
        gate = probs
    return gate, probs


@triton.jit
def _scores(x_ptr, sx_s, sx_d, w_ptr, rows, rmask, cols, cmask, D, E,
            BM: tl.constexpr, BK: tl.constexpr, EP: tl.constexpr, X_SPLIT: tl.constexpr):
    """logits [BM, EP] fp32 = x[rows] W^T; W parts at w_ptr [3, E, D] (hi, mid, lo) contiguous."""
    acc = tl.zeros((BM, EP), dtype=tl.float32)
    ks = tl.arange(0, BK)
    for k0 in range(0, D, BK):
        kk = k0 + ks
        kmask = kk < D
        a = tl.load(x_ptr + rows.to(tl.int64)[:, None] * sx_s + kk[None, :] * sx_d,
                    mask=rmask[:, None] & kmask[None, :], other=0.0)
        off = cols[None, :] * D + kk[:, None]  # W^T tile [BK, EP]
        bmask = kmask[:, None] & cmask[None, :]
        b_hi = tl.load(w_ptr + off, mask=bmask, other=0.0)
        b_mid = tl.load(w_ptr + E * D + off, mask=bmask, other=0.0)
        b_lo = tl.load(w_ptr + 2 * E * D + off, mask=bmask, other=0.0)
        acc = _split_mma(a, b_hi, b_mid, b_lo, acc, X_SPLIT)
    return acc


@triton.jit
def _router_fwd_kernel(
    x_ptr, sx_s, sx_d,  # x [S, D] (bf16 or fp32, any strides)
    w_ptr,  # [3, E, D] bf16: the router weight's hi, mid, lo parts
    bias_ptr,  # [E] fp32 selection bias (HAS_BIAS)
    mask_ptr,  # [S] uint8: the token takes part in routing
    logits_ptr, probs_ptr,  # out: [S, E] fp32
    weights_ptr, experts_ptr,  # out: [S, K] fp32 combine weights (0 on masked tokens), int64 expert ids
    counts_ptr,  # out: [programs, EP] int32 partial per-expert counts of the valid slots
    lse_ptr, ent_ptr,  # out: [S] fp32 each row's logsumexp of the scores and entropy of the probabilities
    psum_ptr,  # out: [programs, EP] fp32 partial sums of the routed tokens' probabilities per expert
    S, D, E,
    K: tl.constexpr, KP: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, EP: tl.constexpr,
    X_SPLIT: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
):
    """Scores, gate, top-k of (gate + bias), combine weights (renormalised over the k when RENORM; the
    1e-9 floor of the reference) and the per-expert counts of BM tokens, in one pass over their x rows; and the
    router losses' reductions of the same rows (logsumexp, entropy, probabilities summed per expert)."""
    pid = tl.program_id(0)
    rows = pid * BM + tl.arange(0, BM)
    rmask = rows < S
    cols = tl.arange(0, EP)
    cmask = cols < E
    logits = _scores(x_ptr, sx_s, sx_d, w_ptr, rows, rmask, cols, cmask, D, E, BM, BK, EP, X_SPLIT)
    out = rows.to(tl.int64)[:, None] * E + cols[None, :]
    omask = rmask[:, None] & cmask[None, :]
    tl.store(logits_ptr + out, logits, mask=omask)
    gate, probs = _gate(logits, cmask, SIGMOID)
    tl.store(probs_ptr + out, probs, mask=omask)
    choice = gate
    if HAS_BIAS:
        choice = gate + tl.load(bias_ptr + cols, mask=cmask, other=0.0)[None, :]
    choice = tl.where(cmask[None, :], choice, float("-inf"))
    live = (tl.load(mask_ptr + rows, mask=rmask, other=0) != 0) & rmask
    z = tl.where(cmask[None, :], logits, float("-inf"))
    zmax = tl.max(z, axis=1)
    tl.store(lse_ptr + rows, zmax + tl.log(tl.sum(tl.exp(z - zmax[:, None]), axis=1)), mask=rmask)
    plogp = tl.where(cmask[None, :], probs * tl.log(probs + 1.1754943508222875e-38), 0.0)  # log(p + fp32 tiny)
    tl.store(ent_ptr + rows, -tl.sum(plogp, axis=1), mask=rmask)
    tl.store(psum_ptr + pid * EP + cols, tl.sum(tl.where(live[:, None] & cmask[None, :], probs, 0.0), axis=0))
    kcols = tl.arange(0, KP)
    wk = tl.zeros((BM, KP), dtype=tl.float32)
    ek = tl.zeros((BM, KP), dtype=tl.int32)
    counts = tl.zeros((EP,), dtype=tl.int32)
    for j in tl.static_range(K):  # the largest remaining choice; the lowest expert id among equal ones
        best = tl.max(choice, axis=1)
        idx = tl.min(tl.where(choice == best[:, None], cols[None, :], EP), axis=1)
        hit = cols[None, :] == idx[:, None]
        wk = tl.where(kcols[None, :] == j, tl.sum(tl.where(hit, gate, 0.0), axis=1)[:, None], wk)
        ek = tl.where(kcols[None, :] == j, idx[:, None], ek)
        counts += tl.sum((hit & live[:, None]).to(tl.int32), axis=0)
        choice = tl.where(hit, float("-inf"), choice)
    if RENORM:
        wk = wk / tl.maximum(tl.sum(wk, axis=1), 1e-9)[:, None]
    wk = tl.where(live[:, None], wk, 0.0)
    kout = rows.to(tl.int64)[:, None] * K + kcols[None, :]
    kmask = rmask[:, None] & (kcols[None, :] < K)
    tl.store(weights_ptr + kout, wk, mask=kmask)
    tl.store(experts_ptr + kout, ek.to(tl.int64), mask=kmask)
    tl.store(counts_ptr + pid * EP + cols, counts)


@triton.jit
def _router_bwd_kernel(
    logits_ptr,  # [S, E] fp32 saved scores
    experts_ptr,  # [S, K] int64
    mask_ptr,  # [S] uint8
    g_logits_ptr, g_probs_ptr, g_weights_ptr,  # incoming gradients [S, E], [S, E], [S, K] fp32 (HAS_G*)
    w_ptr,  # [3, E, D] bf16 weight parts (for dx)
    dl_ptr,  # out: [S, E] fp32 gradient of the scores (for the weight gradient)
    dx_ptr, sdx_s,  # out (NEED_DX): [S, D] in x's dtype
    S, D, E,
    K: tl.constexpr, KP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, EP: tl.constexpr,
    SIGMOID: tl.constexpr, RENORM: tl.constexpr, HAS_GL: tl.constexpr, HAS_GP: tl.constexpr,
    HAS_GW: tl.constexpr, NEED_DX: tl.constexpr,
):
    """d logits of BM tokens from the gradients of logits, probs and the combine weights (gate and top-k
    recomputed from the saved scores, bitwise as in the forward), stored; then dx = d logits W."""
    pid = tl.program_id(0)
    rows = pid * BM + tl.arange(0, BM)
    rmask = rows < S
    cols = tl.arange(0, EP)
    cmask = cols < E
    out = rows.to(tl.int64)[:, None] * E + cols[None, :]
    omask = rmask[:, None] & cmask[None, :]
    logits = tl.load(logits_ptr + out, mask=omask, other=0.0)
    gate, probs = _gate(logits, cmask, SIGMOID)
    dgate = tl.zeros((BM, EP), dtype=tl.float32)
    if HAS_GW:  # combine weights w_j = live * gate[e_j] / max(sum_i gate[e_i], 1e-9) (RENORM) | live * gate[e_j]
        live = (tl.load(mask_ptr + rows, mask=rmask, other=0) != 0) & rmask
        kcols = tl.arange(0, KP)
        kout = rows.to(tl.int64)[:, None] * K + kcols[None, :]
        kmask = rmask[:, None] & (kcols[None, :] < K)
        ek = tl.load(experts_ptr + kout, mask=kmask, other=EP).to(tl.int32)
        gw = tl.where(live[:, None], tl.load(g_weights_ptr + kout, mask=kmask, other=0.0), 0.0)
        raw = tl.zeros((BM, KP), dtype=tl.float32)
        for j in tl.static_range(K):
            e_j = tl.sum(tl.where(kcols[None, :] == j, ek, 0), axis=1)
            g_j = tl.sum(tl.where(cols[None, :] == e_j[:, None], gate, 0.0), axis=1)
            raw = tl.where(kcols[None, :] == j, g_j[:, None], raw)
        if RENORM:
            tot = tl.sum(raw, axis=1)
            den = tl.maximum(tot, 1e-9)
            dot_gr = tl.sum(gw * raw, axis=1)
            draw = gw / den[:, None] - tl.where(tot >= 1e-9, dot_gr / (den * den), 0.0)[:, None]
        else:
            draw = gw
        for j in tl.static_range(K):
            e_j = tl.sum(tl.where(kcols[None, :] == j, ek, 0), axis=1)
            d_j = tl.sum(tl.where(kcols[None, :] == j, draw, 0.0), axis=1)
            dgate += tl.where(cols[None, :] == e_j[:, None], d_j[:, None], 0.0)
    if HAS_GP:
        gp = tl.load(g_probs_ptr + out, mask=omask, other=0.0)
        if SIGMOID:  # probs = gate / sum(gate)
            tot = tl.sum(gate, axis=1)
            dgate += (gp - tl.sum(gp * probs, axis=1)[:, None]) / tot[:, None]
        else:  # gate = probs
            dgate += gp
    if SIGMOID:
        dl = dgate * gate * (1.0 - gate)
    else:
        dl = probs * (dgate - tl.sum(dgate * probs, axis=1)[:, None])
    if HAS_GL:
        dl += tl.load(g_logits_ptr + out, mask=omask, other=0.0)
    dl = tl.where(omask, dl, 0.0)
    tl.store(dl_ptr + out, dl, mask=omask)
    if NEED_DX:
        dl_hi, dl_mid, dl_lo = _split3(dl)
        ds = tl.arange(0, BN)
        for d0 in range(0, D, BN):
            dd = d0 + ds
            dmask = dd < D
            off = cols[:, None] * D + dd[None, :]  # W tile [EP, BN]
            bmask = cmask[:, None] & dmask[None, :]
            b_hi = tl.load(w_ptr + off, mask=bmask, other=0.0)
            b_mid = tl.load(w_ptr + E * D + off, mask=bmask, other=0.0)
            b_lo = tl.load(w_ptr + 2 * E * D + off, mask=bmask, other=0.0)
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            acc = _mma(dl_lo, b_hi, acc, "tf32")
            acc = _mma(dl_mid, b_mid, acc, "tf32")
            acc = _mma(dl_hi, b_lo, acc, "tf32")
            acc = _mma(dl_mid, b_hi, acc, "tf32")
            acc = _mma(dl_hi, b_mid, acc, "tf32")
            acc = _mma(dl_hi, b_hi, acc, "tf32")
            tl.store(dx_ptr + rows.to(tl.int64)[:, None] * sdx_s + dd[None, :],
                     _to(acc, dx_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


@triton.jit
def _router_wgrad_kernel(
    dl_ptr,  # [S, E] fp32 gradient of the scores
    x_ptr, sx_s, sx_d,  # x [S, D]
    part_ptr,  # out: [chunks, E, D] fp32 partial dW, one per chunk of ROWS rows
    S, D, E, ROWS,
    BN: tl.constexpr, BK: tl.constexpr, EP: tl.constexpr, X_SPLIT: tl.constexpr,
):
    """dW partial = d logits^T x over the rows [chunk * ROWS, (chunk + 1) * ROWS) (ROWS a multiple of BK), computed
    transposed as a [BN, EP] tile (x^T d logits: BN rows for the MMA whatever E) and summed over the chunks in
    torch (fixed order: deterministic)."""
    pid_n = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = tl.arange(0, EP)
    cmask = cols < E
    dd = pid_n * BN + tl.arange(0, BN)
    dmask = dd < D
    ks = tl.arange(0, BK)
    acc = tl.zeros((BN, EP), dtype=tl.float32)
    r_end = tl.minimum((chunk + 1) * ROWS, S)
    for r0 in range(chunk * ROWS, r_end, BK):
        rr = r0 + ks
        rm = rr < r_end
        dl = tl.load(dl_ptr + rr.to(tl.int64)[:, None] * E + cols[None, :], mask=rm[:, None] & cmask[None, :],
                     other=0.0)  # [BK, EP]
        b_hi, b_mid, b_lo = _split3(dl)
        xt = tl.load(x_ptr + rr.to(tl.int64)[None, :] * sx_s + dd[:, None] * sx_d, mask=dmask[:, None] & rm[None, :],
                     other=0.0)  # [BN, BK] = x^T
        acc = _split_mma(xt, b_hi, b_mid, b_lo, acc, X_SPLIT)
    tl.store(part_ptr + chunk.to(tl.int64) * E * D + cols[None, :] * D + dd[:, None], acc,
             mask=dmask[:, None] & cmask[None, :])
