"""Fused dropless MoE: dispatch + grouped expert FFNs + combine in one ``autograd.Function``.

Shape legend: S tokens (sub-tokens for MH-MoE), K slots per token, E experts, D expert width,
F expert hidden width, N valid (token, slot) pairs sorted by expert, C rows per chunk.

Why a custom Function: composed from autograd ops, the per-expert loop pays for a ``torch.cat`` of
the outputs, a ``stack`` of the per-expert weight gradients, and scatter (``index_put``) kernels
for the dispatch/combine. Here every expert GEMM writes straight into preallocated buffers
(``torch.mm(..., out=...)``) -- outputs, weight gradients, input gradients -- and both directions
of the dispatch are *gathers*: rows are gathered by expert order, outputs are gathered back by the
inverse permutation and summed over the K slots (no atomics, no scatter).

Two variants (``MoEConfig.impl``):

- ``fused``: the hidden pre-activations [N, F] are stored for the backward; ``silu`` is recomputed
  from them instead of storing activation outputs.
- ``chunked``: nothing of width F is stored. Each expert's rows run in chunks of C rows whose
  [C, F] hidden block stays in cache; the backward recomputes the up-projections chunk by chunk.
  For thin, wide experts (MH-MoE at parameter parity with many heads: 16-48-dim sub-tokens,
  experts thousands wide) the [N, F] hidden tensors are hundreds of MB to GB per layer; ``chunked``
  keeps ~1/50 of the layer's activations for about one extra up-projection GEMM per expert. It
  is the memory option, and ``impl="auto"`` runs it where the CPU dispatch table says it was the
  fastest (:mod:`mhmoe.moe.dispatch.cpu_table`: bf16 thin, wide experts on the Xeon with AMX).

Parallelism across experts (CPU): with many experts per thread, whole experts are spread over
``torch.get_num_threads()`` worker threads that each run single-threaded GEMMs
(:func:`_run_blocks`), instead of splitting every small GEMM over all cores. Blocks of one expert
stay on one thread, so the weight-gradient accumulation never races; every block writes its own
rows of the preallocated buffers. Scales with the core count (each thread owns ~E/threads experts).

Correctness: tested against the per-expert loop oracle (outputs and all gradients).
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from mhmoe.moe.dispatch.cpu_table import cpu_choice
from mhmoe.moe.dispatch.layout import RowLayout, row_layout
from mhmoe.moe.dispatch.native import GEMM_ATEN, expert_gemm, expert_ops, slot_grads
from mhmoe.moe.experts import GroupedExperts
from mhmoe.moe.routers import RouterOutput

CHUNK_BYTES = 2 << 20  # hidden-block budget per chunk for impl="chunked" (fits L2/L3 slices)
MIN_EXPERTS_PER_WORKER = 2  # expert-parallel CPU threads only with this many non-empty experts per thread


def chunk_rows(d_hidden: int, itemsize: int, budget: int = CHUNK_BYTES) -> int:
    """Rows per chunk so that one [C, F] hidden block is about ``budget`` bytes: a multiple of 32 in [32, 1024]."""
    return max(32, min(1024, budget // (d_hidden * itemsize) // 32 * 32))


def _blocks(counts: list[int], chunk: int) -> list[tuple[int, slice]]:
    """(expert, row range) per block: every expert's contiguous rows, cut into chunks of ``chunk``
    rows (``chunk=0``: one block per non-empty expert)."""
    out, start = [], 0
    for e, c in enumerate(counts):
        step = chunk or max(c, 1)
        out += [(e, slice(a, min(a + step, start + c))) for a in range(start, start + c, step)]
        start += c
    return out


@functools.cache
def _expert_pool(workers: int) -> ThreadPoolExecutor:
    """Worker threads for :func:`_run_blocks`, each with one intra-op thread (created once per size).

    ``torch.set_num_threads`` acts on the whole process, not the calling thread: the workers are all started
    here, and the caller's count is set back after them (without that, every op after the first expert-parallel
    call ran on one thread). The workers then see the caller's count too (their GEMMs may split over the threads
    while the other worker runs: still measured 4% faster than one loop for the h=3 layer in bf16 on 2 cores);
    the C++ loop (:mod:`mhmoe.moe.dispatch.native`) runs experts in parallel without that."""
    threads = torch.get_num_threads()
    pool = ThreadPoolExecutor(workers, thread_name_prefix="mhmoe-expert", initializer=torch.set_num_threads,
                              initargs=(1,))
    started = threading.Barrier(workers)
    for f in [pool.submit(started.wait) for _ in range(workers)]:
        f.result()
    torch.set_num_threads(threads)
    return pool


def _run_blocks(blocks: list[tuple[int, slice]], work: Callable[[int, slice], None], workers: int) -> None:
    """Call ``work(e, rows)`` for every block. With ``workers`` > 1, whole experts run on ``workers`` threads that
    take them from one queue, longest first (as the C++ loop's lanes), each running its experts' GEMMs
    single-threaded: on CPU many small GEMMs scale better across experts than inside each GEMM. Blocks of one
    expert stay on one thread, so their weight-gradient accumulation never races; every block writes disjoint
    rows of the output buffers."""
    if workers <= 1 or len({e for e, _ in blocks}) < 2:
        for e, r in blocks:
            work(e, r)
        return
    per_expert: dict[int, list[slice]] = {}
    for e, r in blocks:
        per_expert.setdefault(e, []).append(r)
    rows = {e: sum(r.stop - r.start for r in rs) for e, rs in per_expert.items()}
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for e in sorted(rows, key=rows.__getitem__, reverse=True):
        todo.put(e)

    def lane() -> None:
        with torch.no_grad():  # grad mode is per thread; the buffers are written with out=
            while True:
                try:
                    e = todo.get_nowait()
                except queue.Empty:
                    return
                for r in per_expert[e]:
                    work(e, r)

    for f in [_expert_pool(workers).submit(lane) for _ in range(min(workers, len(rows)))]:
        f.result()


def _up(x: Tensor, w1: Tensor, w3: Tensor | None, h1: Tensor | None = None,
        h3: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """Pre-activations x W1 (and x W3 for SwiGLU), into ``h1``/``h3`` when given."""
    h1 = torch.mm(x, w1) if h1 is None else torch.mm(x, w1, out=h1)
    if w3 is None:
        return h1, None
    return h1, torch.mm(x, w3) if h3 is None else torch.mm(x, w3, out=h3)


def _wgrad(dst: Tensor, a: Tensor, b: Tensor, first: bool) -> None:
    """dst = a @ b for an expert's first block (no zero-filled gradient buffers), else dst += a @ b."""
    if first:
        torch.mm(a, b, out=dst)
    else:
        dst.addmm_(a, b)


def _zero_empty(counts: list[int], *grads: Tensor | None) -> None:
    """Zero the weight gradients of experts that got no rows (the others are written by ``_wgrad``)."""
    for e, c in enumerate(counts):
        if not c:
            for g in grads:
                if g is not None:
                    g[e].zero_()


class _FusedMoE(torch.autograd.Function):
    """Rows in a :class:`~mhmoe.moe.dispatch.layout.RowLayout` buffer; experts' GEMMs per block (a loop, maybe
    over expert threads) or, for a batched layout, as one ``bmm`` per matrix over [E, C, ·]."""

    @staticmethod
    def forward(ctx, x: Tensor, weights: Tensor, w1: Tensor, w2: Tensor, w3: Tensor | None, layout: RowLayout,
                chunk: int, workers: int, native: Any | None = None, keep: bool = True,
                gemm: int = GEMM_ATEN) -> Tensor:
        S, K = weights.shape
        D, Fh = w1.shape[1], w1.shape[2]
        R = layout.rows
        xs = x.index_select(0, layout.tok)  # [R, D] gather
        if layout.pad.numel():
            xs.index_fill_(0, layout.pad, 0)
        store = layout.batched or (chunk == 0 and keep)  # the hidden pre-activations, kept for the backward
        h1 = x.new_empty(R, Fh) if store else None
        h3 = x.new_empty(R, Fh) if store and w3 is not None else None
        ys = x.new_empty(R + 1, D)
        ys[R].zero_()  # the row invalid slots (padding, drops) read: they contribute nothing

        def block(e: int, r: slice) -> None:
            a1, a3 = _up(xs[r], w1[e], w3[e] if w3 is not None else None,
                         h1[r] if store else None, h3[r] if h3 is not None else None)
            if a3 is None:
                a = F.relu(a1) if store else a1.relu_()
            else:
                a = F.silu(a1).mul_(a3)
            torch.mm(a, w2[e], out=ys[r])

        if layout.batched:
            _batched_forward(xs, w1, w2, w3, h1, h3, ys[:R])
        elif native is not None:  # the same loop in C++ (mhmoe.moe.dispatch.native)
            native.expert_forward(xs, w1, w2, w3, h1, h3, ys[:R], layout.starts, layout.sizes, workers, gemm)
        else:
            _run_blocks(_blocks(layout.sizes, chunk), block, workers)
        # out[s] = sum_k w[s,k] ys[inv[s,k]]: gather and weighted sum over the K slots in one kernel
        out = F.embedding_bag(layout.inv.view(S, K), ys, mode="sum", per_sample_weights=weights)
        ctx.save_for_backward(xs, h1, h3, ys, weights, w1, w2, w3)
        ctx.layout, ctx.chunk, ctx.workers, ctx.native, ctx.gemm = layout, chunk, workers, native, gemm
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        xs, h1, h3, ys, weights, w1, w2, w3 = ctx.saved_tensors
        layout, chunk = ctx.layout, ctx.chunk
        S, K = weights.shape
        D, R = w1.shape[1], layout.rows
        g, dweights = _slot_grads(dout, ys, weights, layout)
        need_dx = ctx.needs_input_grad[0]  # False e.g. for a first layer fed by a frozen input
        dxs = xs.new_empty(R + 1, D) if need_dx else None
        if need_dx:
            dxs[R].zero_()
        if layout.batched:
            gw1, gw2, gw3 = _batched_backward(xs, h1, h3, g, w1, w2, w3, dxs[:R] if need_dx else None)
        elif ctx.native is not None:
            gw1, gw2, *rest = ctx.native.expert_backward(xs, h1, h3, g, w1, w2, w3, dxs[:R] if need_dx else None,
                                                         layout.starts, layout.sizes, ctx.workers, ctx.gemm)
            gw3 = rest[0] if rest else None
        else:
            gw1, gw2, gw3 = _blocks_backward(xs, h1, h3, g, w1, w2, w3, dxs, layout, chunk, ctx.workers)
        # dx[s] = sum_k dxs[row of slot (s,k)]: gather by the inverse permutation and sum over K in one kernel
        dx = F.embedding_bag(layout.inv.view(S, K), dxs, mode="sum") if need_dx else None
        return dx, dweights, gw1, gw2, gw3, None, None, None, None, None, None


def _slot_grads(dout: Tensor, ys: Tensor, weights: Tensor, layout: RowLayout) -> tuple[Tensor, Tensor]:
    """The rows' output gradients g [R, D] (``d y_row = w[slot] * dout[token]``; zero on padding rows, so zero weight
    gradients from them) and the combine weights' gradients [S, K] (``d w[slot] = <y_row, dout[token]>``; zero on
    invalid slots): one C++ pass where the extension runs (:func:`mhmoe.moe.dispatch.native.slot_grads`), else
    torch ops. dout [S, D], ys [R + 1, D], weights [S, K]."""
    S, K = weights.shape
    R = layout.rows
    native = slot_grads(dout, ys, weights, layout.tok, layout.slot, layout.inv)
    if native is not None:
        return native
    g = dout.contiguous().index_select(0, layout.tok)  # [R, D]: dout of each row's token
    if layout.pad.numel():
        g.index_fill_(0, layout.pad, 0)
    dw_rows = weights.new_zeros(R + 1)  # d w per row; row R (invalid slots) stays 0
    torch.sum(ys[:R] * g, 1, out=dw_rows[:R])
    g.mul_(weights.reshape(-1).index_select(0, layout.slot).unsqueeze(1))
    return g, dw_rows.index_select(0, layout.inv).view(S, K)


def _blocks_backward(xs: Tensor, h1: Tensor | None, h3: Tensor | None, dy: Tensor, w1: Tensor, w2: Tensor,
                     w3: Tensor | None, dxs: Tensor | None, layout: RowLayout, chunk: int,
                     workers: int) -> tuple[Tensor, Tensor, Tensor | None]:
    """The backward of the per-block forward from the rows' output gradients ``dy`` [R, D]: the weight gradients
    (returned) and the rows' input gradients ``dxs`` [R, D] (written in place). In bf16 the weight gradients of
    W1/W3 take every block's rows transposed into a contiguous copy first: oneDNN's bf16 GEMM with a transposed
    left operand ran at about half speed (MKL's float32 GEMM transposes as fast itself)."""
    transpose_x = xs.dtype == torch.bfloat16
    gw1, gw2 = torch.empty_like(w1), torch.empty_like(w2)
    gw3 = torch.empty_like(w3) if w3 is not None else None
    _zero_empty(layout.sizes, gw1, gw2, gw3)

    def block(e: int, r: slice) -> None:
        first = r.start == layout.starts[e]
        x_, dy_ = xs[r], dy[r]
        if chunk:  # recompute the up-projections of this chunk (private buffers)
            a1, a3 = _up(x_, w1[e], w3[e] if w3 is not None else None)
        else:
            a1, a3 = h1[r], h3[r] if h3 is not None else None
        da = torch.mm(dy_, w2[e].t())
        xt = x_.t().contiguous() if transpose_x else x_.t()
        if a3 is not None:
            act = F.silu(a1)
            dh3 = da * act
            _wgrad(gw2[e], act.mul_(a3).t(), dy_, first)  # the activation W2 saw: silu(h1) * h3
            dh1 = torch.ops.aten.silu_backward.grad_input(da.mul_(a3), a1, grad_input=da)
            _wgrad(gw3[e], xt, dh3, first)
            if dxs is not None:
                torch.mm(dh3, w3[e].t(), out=dxs[r])
                dxs[r].addmm_(dh1, w1[e].t())
        else:
            _wgrad(gw2[e], F.relu(a1).t(), dy_, first)
            dh1 = torch.ops.aten.threshold_backward(da, a1, 0)
            if dxs is not None:
                torch.mm(dh1, w1[e].t(), out=dxs[r])
        _wgrad(gw1[e], xt, dh1, first)

    _run_blocks(_blocks(layout.sizes, chunk), block, workers)
    return gw1, gw2, gw3


def _batched_forward(xs: Tensor, w1: Tensor, w2: Tensor, w3: Tensor | None, h1: Tensor, h3: Tensor | None,
                     ys: Tensor) -> None:
    """All experts at once on equal blocks: xs [E*C, D] -> h1, h3 [E*C, F] and ys [E*C, D] (written in place)."""
    E, D, Fh = w1.shape
    C = xs.shape[0] // E if E else 0
    xb = xs.view(E, C, D)
    torch.bmm(xb, w1, out=h1.view(E, C, Fh))
    if w3 is None:
        a = F.relu(h1)
    else:
        torch.bmm(xb, w3, out=h3.view(E, C, Fh))
        a = F.silu(h1).mul_(h3)
    torch.bmm(a.view(E, C, Fh), w2, out=ys.view(E, C, D))


def _batched_backward(xs: Tensor, h1: Tensor, h3: Tensor | None, g: Tensor, w1: Tensor, w2: Tensor,
                      w3: Tensor | None, dxs: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """Backward of :func:`_batched_forward` from the rows' output gradients ``g`` [E*C, D]: the weight gradients
    [E, ...] (returned) and the rows' input gradients ``dxs`` [E*C, D] (written in place)."""
    E, D, Fh = w1.shape
    C = xs.shape[0] // E if E else 0
    dy = g.view(E, C, D)
    xt = xs.view(E, C, D).transpose(1, 2)
    if xs.dtype == torch.bfloat16:  # as in _blocks_backward: 2-D transposed copies (the 3-D copy is element-wise)
        xt = torch.stack([xe.t().contiguous() for xe in xs.view(E, C, D)]) if E else xt
    da = torch.bmm(dy, w2.transpose(1, 2)).view(-1, Fh)  # [E*C, F]
    gw3 = None
    if h3 is not None:
        act = F.silu(h1)
        dh3 = da * act
        gw2 = torch.bmm(act.mul_(h3).view(E, C, Fh).transpose(1, 2), dy)
        dh1 = torch.ops.aten.silu_backward.grad_input(da.mul_(h3), h1, grad_input=da)
        gw3 = torch.bmm(xt, dh3.view(E, C, Fh))
    else:
        gw2 = torch.bmm(F.relu(h1).view(E, C, Fh).transpose(1, 2), dy)
        dh1 = torch.ops.aten.threshold_backward(da, h1, 0)
    gw1 = torch.bmm(xt, dh1.view(E, C, Fh))
    if dxs is not None:
        dxb = dxs.view(E, C, D)
        torch.bmm(dh1.view(E, C, Fh), w1.transpose(1, 2), out=dxb)
        if h3 is not None:
            dxb.baddbmm_(dh3.view(E, C, Fh), w3.transpose(1, 2))
    return gw1, gw2, gw3


def expert_workers(counts: list[int], device: torch.device) -> int:
    """Threads for :func:`_run_blocks`: on CPU, ``torch.get_num_threads()`` when there are at least
    ``MIN_EXPERTS_PER_WORKER`` non-empty experts per thread (then whole experts keep every core
    busy with single-threaded GEMMs, measured faster than splitting each small GEMM -- and far less
    hurt by other processes on the cores, which stall every GEMM split over threads), else 1.
    Also 1 under a ``TorchDispatchMode`` (``FlopCounterMode``, fake tensors): modes are per thread,
    so ops run on worker threads would escape them."""
    threads = torch.get_num_threads() if device.type == "cpu" and not is_in_torch_dispatch_mode() else 1
    active = sum(1 for c in counts if c)
    return threads if threads > 1 and active >= MIN_EXPERTS_PER_WORKER * threads else 1


def fused_moe(x: Tensor, route: RouterOutput, experts: GroupedExperts, chunk: int = 0,
              workers: int | None = None, align: int | None = None, max_batch_padding: float | None = None,
              native: bool | None = None) -> Tensor:
    """Fused dropless MoE (bias-free experts). x: [S, D] -> [S, D].

    ``chunk`` > 0 gives the ``chunked`` variant: rows in chunks of ``chunk``, hidden recomputed in
    the backward (see the module docstring). ``workers``: CPU threads running whole experts in
    parallel (None = :func:`expert_workers`; 1 = one loop, each GEMM using all intra-op threads).
    ``align``: every expert's rows padded to a multiple of ``align`` with zero rows (the GEMM shapes repeat from
    step to step); ``max_batch_padding``: all experts run as one ``bmm`` per matrix, every expert padded to the
    largest, when that pads at most this fraction of the rows (``inf``: always; negative: never; ``chunk`` and
    ``workers`` then do not apply): :mod:`mhmoe.moe.dispatch.layout`. ``native``: the per-expert loop (not
    chunked, not batched) in C++ (:mod:`mhmoe.moe.dispatch.native`; None: on a CPU where it builds and
    :func:`mhmoe.moe.dispatch.native.disabled` is not in force -- the export check's reference runs the Python
    loop, the exported model's code; False: the Python loop). Forward-only calls (no gradient: evaluation,
    generation) keep no [R, F] hidden buffers: every expert's pre-activations are freed after its GEMMs.
    None: the CPU dispatch table's values
    (:mod:`mhmoe.moe.dispatch.cpu_table`) on a CPU, 1 and never elsewhere; the table also says whether
    ``workers=None`` may use expert threads.
    Under autocast the experts run in the autocast dtype: their weights are cast to it, except fp32 weights for
    the C++ loop in bf16, which takes them as they are (:func:`_loop_weight`; the same numbers).
    Biased and quantized (bitnet158) experts are not supported (the hand-written backward has no biases,
    activation quantization or sub-norms): :func:`mhmoe.moe.dispatch.choose_impl` runs ``sorted`` for them.
    """
    if experts.quantized or experts.b1 is not None:
        raise ValueError("invalid impl='fused'/'chunked' with biased or quantized experts: allowed sorted | "
                         "grouped_mm | loop (choose_impl falls back to sorted)")
    dtype = x.dtype
    if torch.is_autocast_enabled(x.device.type):  # run in the autocast dtype, autocast off inside
        dtype = torch.get_autocast_dtype(x.device.type)
    # under a TorchDispatchMode (FlopCounterMode, fake tensors) the table's padding is left out: a FLOP count is
    # the model's, the same on every CPU, not the padded rows this CPU would run
    entry = cpu_choice(dtype, experts) if x.device.type == "cpu" and not is_in_torch_dispatch_mode() else None
    align = align if align is not None else (entry.align if entry else 1)
    if max_batch_padding is None:
        max_batch_padding = entry.max_batch_padding if entry else -1.0
    layout = row_layout(route.experts, route.valid, experts.n_experts, align, -1.0 if chunk else max_batch_padding)
    ops = _native_ops(native, x.device, dtype) if not chunk and not layout.batched else None
    gemm = expert_gemm(dtype, experts.d_in, experts.d_hidden) if ops is not None else GEMM_ATEN
    in_loop = ops is not None and dtype == torch.bfloat16
    ws = [_loop_weight(w, dtype, in_loop) for w in (experts.w1, experts.w2, experts.w3)]
    if workers is None:
        threads = entry is None or entry.expert_threads
        workers = expert_workers(layout.counts, x.device) if threads and not layout.batched else 1
    trains = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, route.weights, *ws))
    with torch.autocast(x.device.type, enabled=False):
        return _FusedMoE.apply(x.to(dtype), route.weights.to(dtype), ws[0], ws[1], ws[2], layout, chunk, workers,
                               ops, trains, gemm)


def _loop_weight(w: Tensor | None, dtype: torch.dtype, in_loop: bool) -> Tensor | None:
    """An expert weight as the loop takes it: cast to the compute ``dtype``, except an fp32 weight (bf16 autocast)
    for the C++ loop (``in_loop``), which rounds it to bf16 as the cast does, expert by expert (its own kernels while
    they pack it, ATen's GEMMs on a cast of that expert's matrix), and widens its gradient as it writes it: the
    cast's numbers, without the layer's bf16 weight copy (kept for the backward) and the cast of its gradient back,
    two passes over every expert weight per step."""
    if w is None or (in_loop and w.dtype == torch.float32):
        return w
    return w.to(dtype)


def _native_ops(native: bool | None, device: torch.device, dtype: torch.dtype) -> Any | None:
    """The C++ loop's ops for a per-expert loop (not chunked, not batched), or None for the Python loop: see
    :func:`fused_moe`'s ``native``. Never under a dispatch mode (the loop's ATen ops must stay visible: FLOP
    counts)."""
    if native is False or device.type != "cpu" or is_in_torch_dispatch_mode():
        return None
    ops = expert_ops(dtype)
    if ops is None and native:
        raise ValueError("invalid native=True: the C++ CPU expert loop is not available here "
                         "(float32/bfloat16 rows, a C++ compiler and ninja, MHMOE_NATIVE unset)")
    return ops


def chunked_moe(x: Tensor, route: RouterOutput, experts: GroupedExperts, align: int | None = None) -> Tensor:
    """``impl="chunked"``: :func:`fused_moe` with cache-sized row chunks and recompute. x: [S, D] -> [S, D]."""
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    return fused_moe(x, route, experts, chunk_rows(experts.d_hidden, dtype.itemsize), align=align)
