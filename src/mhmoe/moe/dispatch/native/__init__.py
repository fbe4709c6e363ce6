"""The fused path's CPU expert loop and the head of its backward, the router's top-k, the slots' grouping by expert,
the LM loss's rows and generation's expert pairs in C++ (``expert_loop.cpp``, ``slot_grads.cpp``, ``router_topk.cpp``,
``group_rows.cpp``, ``token_xent.cpp``, ``gathered_ffn.cpp``), compiled on first use.

What it is: the per-expert loop of :mod:`mhmoe.moe.dispatch.fused` -- the same ATen GEMMs (oneDNN / MKL) in the same
order, or for small bf16 experts on CPUs with AVX-512 BF16 its own GEMM kernel (:func:`expert_gemm`: the bf16
dot-product instruction, or AMX tiles where the CPU has them) -- with the SwiGLU element-wise work fused into one
vectorised pass per direction (the Python loop makes about seven passes over each [C, F] hidden block) and no Python
between the kernels; experts are spread over the intra-op threads in C++. The element-wise passes use ATen's silu /
silu_backward formulas and round to bf16 where the Python loop stores a bf16 intermediate, so both loops give the
same numbers (bit-identical in the tests; where ATen splits one of its element-wise ops over threads, its
vector/scalar boundaries move and the last bit may differ). Why C++ and not ``torch.compile``: the loop's row counts
change every step (recompiles), and a compiled function's per-call overhead is as large as the per-expert work it
would save (docs/PERFORMANCE.md).

How it is built (:mod:`mhmoe.moe.dispatch.native.extension`): :func:`torch.utils.cpp_extension.load` (needs a C++
compiler and ``ninja``, a dependency) into torch's extension cache (``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``), once per machine, ISA, torch, Python and source version (the name carries a digest of
them all, so checkouts of different versions keep a build each instead of rebuilding over each other), under a lock
that a killed build cannot leave behind: about 25-30 s on 2 cores. ``python -m mhmoe.moe.dispatch.native``
builds it ahead of time (``make install`` does). Where it cannot be built the fused path runs its Python loop (one
warning); ``MHMOE_NATIVE=0`` turns it off, :func:`disabled` within a block (the export check compares the exported
code, which has no C++ ops, with the library's Python loop). Forward-only calls pass no hidden buffers: each
expert's pre-activations are freed after its GEMMs.

Under bf16 autocast the loop takes fp32 expert weights as they are (:func:`mhmoe.moe.dispatch.fused.fused_moe`):
it rounds each expert's matrices to bf16 as ``Tensor.to`` does as it uses them (its own kernels while packing them,
ATen's GEMMs on a cast of the matrix), and writes each weight gradient as the bf16 product widened to fp32, so the
numbers are those of casting the weights first and the gradients back, without the layer's bf16 weight copies (kept
for the backward) and the cast of the gradients.

The head of the fused path's backward (:func:`slot_grads`): every row's output gradient (the token's gradient times
its combine weight) and every combine weight's gradient (the dot product of the row's output and the token's
gradient) in one pass over the rows, where ATen took five.

The router's top-k (:func:`topk_indices`): one vectorised pass per row, every vector lane keeping its own sorted
k + 1 largest scores (merged at the end), instead of ATen's copy into (value, index) pairs with ``nth_element`` and a
sort (115 vs 880 ns per row of 96 experts, top-3, one thread; k <= 8). Rows where equal scores or a NaN leave the
choice or the order to ``torch.topk``'s tie handling are recomputed by ``torch.topk``, so the experts are
``torch.topk``'s on every row, with or without the extension.

The softmax router's element-wise work (:mod:`mhmoe.moe.dispatch.native.router`, ``router_topk.cpp``): the softmax,
the top-k and the combine weights in one pass per row after the score GEMM, and their backward in another.

The slots' grouping by expert (:func:`group_rows`): a stable counting sort of the slots by expert and the slots per
expert, the numbers ``torch.argsort(key, stable=True)`` and a bincount give (ATen's CPU sort runs
``std::stable_sort`` below 32,768 keys).

The LM loss's rows (:func:`token_xent_`, used by :func:`mhmoe.model.lm_loss.chunked_token_loss`): each row's
cross-entropy and its logit gradient in one pass per step over the row, in place of the logits.

Generation's pairs (:func:`gathered_ffn`, used by :mod:`mhmoe.moe.dispatch.gathered`): each (token, slot) pair's
FFN read straight from its expert's weights instead of gathering weight copies.

The ops: ``torch.ops.mhmoe_cpu.expert_forward`` / ``expert_backward`` / ``slot_grads`` / ``topk_rows`` /
``softmax_topk`` / ``softmax_topk_backward`` / ``group_rows`` / ``token_xent_`` / ``gathered_ffn`` (schemas in the .cpp
files).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from mhmoe.moe.dispatch.native.extension import HEADERS, SOURCES, build, capability
from mhmoe.runtime.cpu import cpu_isa

DTYPES = (torch.float32, torch.bfloat16)
# bf16 experts whose weight matrices have at most DOT_GEMM_WEIGHTS elements (AMX_GEMM_WEIGHTS on AMX CPUs), at least
# DOT_GEMM_MIN_IN input features and at most DOT_GEMM_MAX_RATIO times as many hidden ones run their GEMMs on the
# loop's own kernel (dot_gemm.h: AVX-512 BF16; amx_gemm.h: AMX tiles) on the ISAs listed; thin, wide experts on
# at::mm (oneDNN), faster there, and larger ones too (docs/PERFORMANCE.md)
DOT_GEMM_WEIGHTS = 1 << 21
AMX_GEMM_WEIGHTS = 1 << 20
DOT_GEMM_MIN_IN = 64
DOT_GEMM_MAX_RATIO = 4
DOT_GEMM_ISAS = ("avx512_bf16", "amx")
GEMM_ATEN, GEMM_DOT, GEMM_AMX = 0, 1, 2  # the C++ loop's `gemm` argument
MAX_TOPK = 8  # topk_rows keeps the k + 1 best scores of every vector lane; larger k: torch.topk
log = logging.getLogger(__name__)


_DISABLED: ContextVar[bool] = ContextVar("mhmoe_native_disabled", default=False)


def enabled() -> bool:
    """False when ``MHMOE_NATIVE=0`` (the Python loop only) or inside :func:`disabled`."""
    return os.environ.get("MHMOE_NATIVE", "1") != "0" and not _DISABLED.get()


@contextmanager
def disabled() -> Iterator[None]:
    """Within the block (this thread / task), the Python loop and ``torch.topk`` only: the library's side of a
    comparison with code that has no C++ ops (the exported model's), bit for bit on any thread count."""
    token = _DISABLED.set(True)
    try:
        yield
    finally:
        _DISABLED.reset(token)


@functools.cache
def _ops() -> Any | None:
    """torch.ops.mhmoe_cpu after building / loading the extension once per process; None where it can't (one
    warning), and quietly where the sources are absent (the exported model code carries this module, not the C++)."""
    if not all(p.is_file() for p in SOURCES + HEADERS):
        return None
    try:
        build()
    except Exception as exc:  # no compiler, no ninja, no headers: the Python loop runs
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        log.warning("mhmoe: the C++ CPU expert loop is not available (%s); the Python loop runs", first[:200])
        return None
    return torch.ops.mhmoe_cpu


@torch.compiler.disable  # a build and a library load: never traced (the fused path breaks the graph anyway)
def expert_ops(dtype: torch.dtype) -> Any | None:
    """The compiled ops for rows of ``dtype`` (float32 / bfloat16), building them on first use; None when
    turned off (``MHMOE_NATIVE=0``), for other dtypes, or where they cannot be built."""
    if not enabled() or dtype not in DTYPES:
        return None
    return _ops()


def expert_gemm(dtype: torch.dtype, d_in: int, d_hidden: int) -> int:
    """Where the C++ loop runs an expert's GEMMs: on its own bf16 kernel for this CPU (:func:`own_gemm`; the right
    operand packed per call in L2-sized column panels, fp32 sums in K order) or ``GEMM_ATEN`` (``at::mm``). Its own
    kernel for bf16 experts, not thin and wide (``d_in >= DOT_GEMM_MIN_IN`` and ``d_hidden <= DOT_GEMM_MAX_RATIO *
    d_in``: the parameter-parity layers' 96 x 1488 to 16 x 8928 experts ran 0.87-0.96x as fast on the dot-product
    kernel), with an AVX-512 build, on the ISAs of ``DOT_GEMM_ISAS`` and weight matrices of at most:

    * ``DOT_GEMM_WEIGHTS`` elements on ``avx512_bf16`` (the dot-product kernel, ``dot_gemm.h``; the largest
      measured: SMoE's 768 x 2048; every tiny preset's experts and the d=768 layers' ran 1.02-1.32x as fast fwd+bwd
      as on at::mm);
    * ``AMX_GEMM_WEIGHTS`` on ``amx`` (AMX tiles, ``amx_gemm.h``: the tiny layers' experts ran 1.02-1.44x as fast
      fwd+bwd as on oneDNN's AMX kernels, the d=768 h=3, h=2 and fine-grained layers' 1.10-1.21x; SMoE's 768 x 2048
      0.98-1.07x, so it stays on oneDNN: docs/PERFORMANCE.md, "AMX tiles")."""
    isa = cpu_isa()
    limit = AMX_GEMM_WEIGHTS if isa == "amx" else DOT_GEMM_WEIGHTS
    own = (dtype == torch.bfloat16 and d_in * d_hidden <= limit and d_in >= DOT_GEMM_MIN_IN
           and d_hidden <= DOT_GEMM_MAX_RATIO * d_in and capability() == "AVX512" and isa in DOT_GEMM_ISAS)
    return own_gemm() if own else GEMM_ATEN


def own_gemm() -> int:
    """The loop's own bf16 GEMM kernel on this CPU: ``GEMM_AMX`` (AMX tiles, ``amx_gemm.h``) on a CPU with AMX, else
    ``GEMM_DOT`` (the AVX-512 BF16 dot product, ``dot_gemm.h``)."""
    return GEMM_AMX if cpu_isa() == "amx" else GEMM_DOT


def topk_indices(scores: Tensor, k: int) -> Tensor:
    """``torch.topk(scores, k, dim=-1).indices`` (best first), from the C++ op on a CPU. scores: [S, E] -> [S, k]
    int64. The op flags rows with equal scores among the k + 1 largest or a NaN; those rows are ``torch.topk``'s
    own (it decides ties by its algorithm), so the result is the same with the extension or without. ``torch.topk``
    itself: off a CPU, for other dtypes or k (1 <= k < E, k <= MAX_TOPK), under ``torch.compile`` or a dispatch mode,
    with ``MHMOE_NATIVE=0`` or where the extension cannot be built."""
    ops = None
    if (not torch.compiler.is_compiling()  # first: dynamo does not trace enabled()'s ContextVar (a graph break)
            and scores.device.type == "cpu" and scores.dtype == torch.float32 and scores.dim() == 2
            and 1 <= k <= MAX_TOPK and k < scores.shape[1] and enabled() and not is_in_torch_dispatch_mode()):
        ops = _ops()
    if ops is None:
        return torch.topk(scores, k, dim=-1).indices
    scores = scores.detach().contiguous()
    ids, tied = ops.topk_rows(scores, k)
    rows = tied.nonzero().squeeze(1)  # a CPU tensor: reading it is no device sync
    if rows.numel():
        ids.index_copy_(0, rows, torch.topk(scores.index_select(0, rows), k, dim=-1).indices)
    return ids


def slot_grads(dout: Tensor, ys: Tensor, weights: Tensor, tok: Tensor, slot: Tensor,
               inv: Tensor) -> tuple[Tensor, Tensor] | None:
    """The head of the fused path's backward in one C++ pass over the rows (``slot_grads.cpp``): from the layer's
    output gradient dout [S, D], the rows' expert outputs ys [>= R, D], the combine weights [S, K] and the row
    layout's tok, slot [R] and inv [S * K] (:class:`~mhmoe.moe.dispatch.layout.RowLayout`), ``(g, dweights)``: g
    [R, D] the rows' output gradients ``dout[tok] * weights[slot]`` (rounded once; zero on padding rows) and
    dweights [S, K] ``<ys[row], dout[s]>`` (exact products summed in fp32, rounded once; zero on invalid slots).
    None where the op does not run (off a CPU, mixed or other dtypes, under ``torch.compile`` or a dispatch mode,
    ``MHMOE_NATIVE=0``, no extension): the caller computes the same with torch ops."""
    if (torch.compiler.is_compiling() or dout.device.type != "cpu" or dout.dtype not in DTYPES
            or ys.dtype != dout.dtype or weights.dtype != dout.dtype or not enabled() or is_in_torch_dispatch_mode()):
        return None
    ops = _ops()
    if ops is None:
        return None
    g, dweights = ops.slot_grads(dout.contiguous(), ys.contiguous(), weights, tok, slot, inv)
    return g, dweights


def group_rows(key: Tensor, n_bins: int) -> tuple[Tensor, Tensor] | None:
    """``(torch.argsort(key, stable=True), counts)`` from the C++ op (``group_rows.cpp``): key [N] int64 in
    [0, n_bins) -> the positions of ``key`` grouped by value, in order within a value, and [n_bins] int64 counts.
    None where the op does not run (off a CPU, other dtypes, under ``torch.compile`` or a dispatch mode,
    ``MHMOE_NATIVE=0``, no extension): the caller sorts with torch."""
    if (torch.compiler.is_compiling() or key.device.type != "cpu" or key.dtype != torch.long or key.dim() != 1
            or not enabled() or is_in_torch_dispatch_mode()):
        return None
    ops = _ops()
    return None if ops is None else ops.group_rows(key, n_bins)


def token_xent_(logits: Tensor, targets: Tensor, grad: bool) -> Tensor | None:
    """The LM loss's per-row work in one C++ pass per row (``token_xent.cpp``): returns the rows' cross-entropies
    [C] fp32 (0 where the target is -100) and, with ``grad``, overwrites ``logits`` [C, V] (float32 or bfloat16,
    contiguous) with softmax - onehot (zero rows where the target is -100). None where the op does not run (off
    a CPU, other dtypes, under ``torch.compile`` or a dispatch mode, ``MHMOE_NATIVE=0``, no extension): the
    caller computes the same with torch ops."""
    if (torch.compiler.is_compiling() or logits.device.type != "cpu" or logits.dtype not in DTYPES
            or not logits.is_contiguous() or not enabled() or is_in_torch_dispatch_mode()):
        return None
    ops = _ops()
    return None if ops is None else ops.token_xent_(logits, targets, grad)


def gathered_ffn(x: Tensor, ids: Tensor, w1: Tensor, w2: Tensor, w3: Tensor | None) -> Tensor | None:
    """Generation's pairs in C++ (``gathered_ffn.cpp``): row n of x [N, D] through expert ``ids[n]``'s FFN read in
    place (w1, w3 [E, D, F], w2 [E, F, D]; no biases, not quantized) -> [N, D]. None where the op does not run
    (off a CPU, other dtypes or mixed ones, under autocast, ``torch.compile``, a dispatch mode or a gradient,
    ``MHMOE_NATIVE=0``, no extension): the caller gathers the weights and runs batched GEMMs."""
    ws = [w for w in (w1, w2, w3) if w is not None]
    if (torch.compiler.is_compiling() or x.device.type != "cpu" or x.dtype not in DTYPES or torch.is_grad_enabled()
            or torch.is_autocast_enabled("cpu") or any(w.dtype != x.dtype or not w.is_contiguous() for w in ws)
            or not enabled() or is_in_torch_dispatch_mode()):
        return None
    ops = _ops()
    return None if ops is None else ops.gathered_ffn(x.contiguous(), ids, w1, w2, w3)


def main() -> int:
    """``python -m mhmoe.moe.dispatch.native``: build the extension now (prints the compiler's output)."""
    try:
        build(verbose="-v" in sys.argv)
    except Exception as exc:
        print(f"mhmoe: the C++ CPU expert loop could not be built: {str(exc).strip()[:300]}", file=sys.stderr)
        return 1
    print(f"mhmoe: C++ CPU expert loop ready ({capability()})")
    return 0
