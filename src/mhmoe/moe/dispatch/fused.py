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
  is the memory option, not the CPU default: measured faster than ``sorted`` only with glibc's
  default malloc, which page-faults every large tensor again on every step (docs/PERFORMANCE.md,
  "Thin experts"; :mod:`mhmoe.runtime.cpu_malloc`).

Parallelism across experts (CPU): with many experts per thread, whole experts are spread over
``torch.get_num_threads()`` worker threads that each run single-threaded GEMMs
(:func:`_run_blocks`), instead of splitting every small GEMM over all cores. Blocks of one expert
stay on one thread, so the weight-gradient accumulation never races; every block writes its own
rows of the preallocated buffers. Scales with the core count (each thread owns ~E/threads experts).

Correctness: tested against the per-expert loop oracle (outputs and all gradients).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from mhmoe.moe.capacity import expert_counts
from mhmoe.moe.experts import GroupedExperts
from mhmoe.moe.routers import RouterOutput

CHUNK_BYTES = 2 << 20  # hidden-block budget per chunk for impl="chunked" (fits L2/L3 slices)
MIN_EXPERTS_PER_WORKER = 8  # expert-parallel CPU threads only with this many non-empty experts per thread


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
    """Worker threads for :func:`_run_blocks`, each with one intra-op thread (created once per size)."""
    return ThreadPoolExecutor(workers, thread_name_prefix="mhmoe-expert", initializer=torch.set_num_threads,
                              initargs=(1,))


def _run_blocks(blocks: list[tuple[int, slice]], work: Callable[[int, slice], None], workers: int) -> None:
    """Call ``work(e, rows)`` for every block. With ``workers`` > 1, whole experts are spread over
    ``workers`` threads (longest first onto the least-loaded thread), each running its experts'
    GEMMs single-threaded: on CPU many small GEMMs scale better across experts than inside each
    GEMM. Blocks of one expert stay on one thread, so their weight-gradient accumulation never races;
    every block writes disjoint rows of the output buffers."""
    if workers <= 1 or len({e for e, _ in blocks}) < 2:
        for e, r in blocks:
            work(e, r)
        return
    per_expert: dict[int, list[slice]] = {}
    for e, r in blocks:
        per_expert.setdefault(e, []).append(r)
    rows = {e: sum(r.stop - r.start for r in rs) for e, rs in per_expert.items()}
    lanes: list[list[tuple[int, slice]]] = [[] for _ in range(workers)]
    loads = [0] * workers
    for e in sorted(rows, key=rows.__getitem__, reverse=True):
        i = loads.index(min(loads))
        lanes[i] += [(e, r) for r in per_expert[e]]
        loads[i] += rows[e]

    def lane(items: list[tuple[int, slice]]) -> None:
        with torch.no_grad():  # grad mode is per thread; the buffers are written with out=
            for e, r in items:
                work(e, r)

    for f in [_expert_pool(workers).submit(lane, items) for items in lanes if items]:
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
    @staticmethod
    def forward(ctx, x: Tensor, weights: Tensor, w1: Tensor, w2: Tensor, w3: Tensor | None, order: Tensor,
                inv: Tensor, counts: list[int], chunk: int, workers: int) -> Tensor:
        S, K = weights.shape
        D, Fh = w1.shape[1], w1.shape[2]
        N = sum(counts)
        tok = torch.div(order[:N], K, rounding_mode="floor")
        xs = x.index_select(0, tok)  # [N, D] gather
        store = chunk == 0
        h1 = x.new_empty(N, Fh) if store else None
        h3 = x.new_empty(N, Fh) if store and w3 is not None else None
        ys = x.new_empty(S * K, D)
        ys[N:].zero_()  # invalid slots (padding, drops) contribute nothing
        def block(e: int, r: slice) -> None:
            a1, a3 = _up(xs[r], w1[e], w3[e] if w3 is not None else None,
                         h1[r] if store else None, h3[r] if h3 is not None else None)
            if a3 is None:
                a = F.relu(a1) if store else a1.relu_()
            else:
                a = F.silu(a1).mul_(a3)
            torch.mm(a, w2[e], out=ys[r])

        _run_blocks(_blocks(counts, chunk), block, workers)
        # out[s] = sum_k w[s,k] ys[inv[s,k]]: gather and weighted sum over the K slots in one kernel
        out = F.embedding_bag(inv.view(S, K), ys, mode="sum", per_sample_weights=weights)
        ctx.save_for_backward(xs, h1, h3, ys, weights, w1, w2, w3, order, inv)
        ctx.counts, ctx.chunk, ctx.workers = counts, chunk, workers
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        xs, h1, h3, ys, weights, w1, w2, w3, order, inv = ctx.saved_tensors
        counts, chunk = ctx.counts, ctx.chunk
        S, K = weights.shape
        D = w1.shape[1]
        N = sum(counts)
        sorted_slots = order[:N]
        tok = torch.div(sorted_slots, K, rounding_mode="floor")
        g = dout.contiguous().index_select(0, tok)  # [N, D]: dout of each row's token (private, scaled in place)
        w_rows = weights.reshape(-1).index_select(0, sorted_slots).unsqueeze(1)  # [N, 1]
        dw_rows = weights.new_zeros(S * K)  # d w per sorted row; rows >= N (invalid slots) stay 0
        gw1, gw2 = torch.empty_like(w1), torch.empty_like(w2)
        gw3 = torch.empty_like(w3) if w3 is not None else None
        _zero_empty(counts, gw1, gw2, gw3)
        starts = [0, *itertools.accumulate(counts[:-1])]  # first sorted row of every expert
        need_dx = ctx.needs_input_grad[0]  # False e.g. for a first layer fed by a frozen input
        dxs = xs.new_empty(S * K, D) if need_dx else None
        if need_dx:
            dxs[N:].zero_()
        def block(e: int, r: slice) -> None:
            first = r.start == starts[e]
            x_, dy = xs[r], g[r]
            torch.sum(ys[r] * dy, 1, out=dw_rows[r])  # d w[slot] = <y_slot, dout[token]>
            dy.mul_(w_rows[r])  # d y_slot = w[slot] * dout[token]
            if chunk:  # recompute the up-projections of this chunk (private buffers)
                a1, a3 = _up(x_, w1[e], w3[e] if w3 is not None else None)
            else:
                a1, a3 = h1[r], h3[r] if h3 is not None else None
            da = torch.mm(dy, w2[e].t())
            if a3 is not None:
                act = F.silu(a1)
                dh3 = da * act
                _wgrad(gw2[e], act.mul_(a3).t(), dy, first)  # the activation W2 saw: silu(h1) * h3
                dh1 = torch.ops.aten.silu_backward.grad_input(da.mul_(a3), a1, grad_input=da)
                _wgrad(gw3[e], x_.t(), dh3, first)
                if need_dx:
                    torch.mm(dh3, w3[e].t(), out=dxs[r])
                    dxs[r].addmm_(dh1, w1[e].t())
            else:
                _wgrad(gw2[e], F.relu(a1).t(), dy, first)
                dh1 = torch.ops.aten.threshold_backward(da, a1, 0)
                if need_dx:
                    torch.mm(dh1, w1[e].t(), out=dxs[r])
            _wgrad(gw1[e], x_.t(), dh1, first)

        _run_blocks(_blocks(counts, chunk), block, ctx.workers)
        dweights = dw_rows.index_select(0, inv).view(S, K)
        # dx[s] = sum_k dxs[slot (s,k)]: gather by the inverse permutation and sum over K in one kernel
        dx = F.embedding_bag(inv.view(S, K), dxs, mode="sum") if need_dx else None
        return dx, dweights, gw1, gw2, gw3, None, None, None, None, None


def expert_workers(counts: list[int], device: torch.device) -> int:
    """Threads for :func:`_run_blocks`: on CPU, ``torch.get_num_threads()`` when there are at least
    ``MIN_EXPERTS_PER_WORKER`` non-empty experts per thread (then whole experts keep every core
    busy with single-threaded GEMMs, measured faster than splitting each small GEMM), else 1.
    Also 1 under a ``TorchDispatchMode`` (``FlopCounterMode``, fake tensors): modes are per thread,
    so ops run on worker threads would escape them."""
    threads = torch.get_num_threads() if device.type == "cpu" and not is_in_torch_dispatch_mode() else 1
    active = sum(1 for c in counts if c)
    return threads if threads > 1 and active >= MIN_EXPERTS_PER_WORKER * threads else 1


def fused_moe(x: Tensor, route: RouterOutput, experts: GroupedExperts, chunk: int = 0,
              workers: int | None = None) -> Tensor:
    """Fused dropless MoE (bias-free experts). x: [S, D] -> [S, D].

    ``chunk`` > 0 gives the ``chunked`` variant: rows in chunks of ``chunk``, hidden recomputed in
    the backward (see the module docstring). ``workers``: CPU threads running whole experts in
    parallel (None = :func:`expert_workers`; 1 = one loop, each GEMM using all intra-op threads).
    Biased and quantized (bitnet158) experts are not supported (the hand-written backward has no biases,
    activation quantization or sub-norms): :func:`mhmoe.moe.dispatch.choose_impl` runs ``sorted`` for them.
    """
    if experts.quantized or experts.b1 is not None:
        raise ValueError("invalid impl='fused'/'chunked' with biased or quantized experts: allowed sorted | "
                         "grouped_mm | loop (choose_impl falls back to sorted)")
    S, K = route.experts.shape
    E = experts.n_experts
    key = torch.where(route.valid, route.experts, E).reshape(-1)
    order = torch.argsort(key, stable=True)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    counts = expert_counts(key, E + 1)[:E].tolist()
    ws = [experts.w1, experts.w2, experts.w3]
    dtype = x.dtype
    if torch.is_autocast_enabled(x.device.type):  # run in the autocast dtype, autocast off inside
        dtype = torch.get_autocast_dtype(x.device.type)
    ws = [None if w is None else w.to(dtype) for w in ws]
    with torch.autocast(x.device.type, enabled=False):
        return _FusedMoE.apply(x.to(dtype), route.weights.to(dtype), ws[0], ws[1], ws[2], order, inv, counts, chunk,
                               expert_workers(counts, x.device) if workers is None else workers)


def chunked_moe(x: Tensor, route: RouterOutput, experts: GroupedExperts) -> Tensor:
    """``impl="chunked"``: :func:`fused_moe` with cache-sized row chunks and recompute. x: [S, D] -> [S, D]."""
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    return fused_moe(x, route, experts, chunk_rows(experts.d_hidden, dtype.itemsize))
