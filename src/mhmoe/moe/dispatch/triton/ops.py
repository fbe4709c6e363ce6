"""Dropless grouped MoE in Triton: :func:`triton_moe` (x [S, D] -> [S, D], the contract of ``sorted_moe``).

Shape legend: S routed (sub-)tokens (B*T*H for MH-MoE), K slots per token, SK = S*K, E experts,
D expert in/out width (d_model / H), F expert hidden width, N <= SK valid (token, slot) pairs,
BM rows per tile of a row-tiled kernel, G = SK // BM + min(E, SK) tiles (upper bound).

Routing glue (torch, :func:`~mhmoe.moe.dispatch.triton.launch.route_plan`, on the device, no host sync):
key = where(valid, expert, E); a stable sort by key gives ``order`` (the slot of every sorted row; invalid
slots last); ``searchsorted`` on the sorted keys gives each expert's row range [starts[e], ends[e]);
a tile table (expert, first row) of every BM-row tile (one per row-tile size in use) is sized by the
bound G, so no shape depends on the routing -- surplus programs read expert E and return at once.

Kernels (:mod:`mhmoe.moe.dispatch.triton.kernels`; sorted row r belongs to slot order[r] = token order[r] // K):

forward
  1. ``_up_fwd_kernel`` [G x F/BN]: x rows gathered by token inside the kernel (no gathered copy of
     x) @ W1[e] (and W3[e]); the epilogue stores the pre-activations h1, h3 [SK, F] (training) or,
     without autograd, the activation silu(h1)*h3 | relu(h1) only.
  2. ``_down_fwd_kernel`` [G x D/BN]: the activation is recomputed from h1, h3 on load (never stored)
     @ W2[e]; the epilogue multiplies by the routing weight and scatters each row to its slot.
  3. ``_ksum_kernel``: out[s] = sum of the valid slots of token s in k order (fp32). For K = 1 the
     slot is the token: kernel 2 writes the output directly and this pass is skipped.
backward
  4. ``_act_bwd_kernel`` [G x F/BN]: dout rows gathered by token @ W2[e]^T = G; epilogue: w * G ->
     SwiGLU / ReLU backward -> dh1, dh3 [SK, F]; plus sum_f act * G over its hidden tile, the partial
     of d w[s,k] = <y_slot, dout[s]> = <act, dout W2^T> (so y is never stored; the partials, one
     per 32/64 hidden units, are summed in torch).
  5. ``_wgrad_down_kernel`` [E x F/BM x D/BN]: dW2[e] = act^T (w * dout[tok]), act recomputed and the
     weighted dout gathered on load, reduced over expert e's rows.
  6. ``_wgrad_up_kernel`` [E x D/BM x F/BN]: dW1[e] = x[tok]^T dh1, dW3[e] = x[tok]^T dh3 (x gathered).
  7. ``_dx_kernel`` [G x D/BN]: dh1 W1[e]^T + dh3 W3[e]^T scattered to slots, then ``_ksum_kernel``
     (K = 1: written directly into dx).
  4+7 fused (the default in bf16 for D <= 256; ``MHMOE_TRITON_FUSE_DX=0``: off): ``_act_dx_kernel`` [G]: per
     row tile, one pass over the hidden units computes dh1, dh3 and accumulates dx in registers, so the hidden
     gradients are never read back for dx (64-row tiles: see docs/PERFORMANCE.md for the trade-off).
An expert without rows runs no reduction step in 5/6 and stores zeros. Invalid slots are in no
tile: they contribute nothing, and their gradients stay zero (the partial buffer starts at zero).

Memory kept for the backward: x itself (a view, no copy), h1 and h3 [SK, F] in the compute dtype,
the tables. A ``torch._grouped_mm`` composition keeps the gathered x [SK, D] and about four [SK, F]
tensors (h1, h3, silu(h1), the activation); the forward here peaks at h1, h3 and one [SK, D]
buffer, the backward adds dh1, dh3. Without autograd only the activation [SK, F] is written.

No atomics: every output element has exactly one writer. Row tiles write disjoint rows (the sort is
a permutation); per-expert weight gradients are one program per output tile looping over the
expert's rows in order; the K-sum and the routing-weight partials are fixed-order sums. Results are
bitwise reproducible run to run (for a given autotuned config).

Tiles (:mod:`mhmoe.moe.dispatch.triton.tiles`): bf16 row tiles of 128 rows (half the weight-panel
reloads of 64-row tiles, about 4% padding at the paper shapes), BN / BK / warps / stages autotuned per
(D, F) from short lists that all compile for an H100 without spills (tests/moe/test_triton_aot.py);
fp32 kernels run one fixed config. fp32 accumulation; fp32 inputs use TF32 only where PyTorch's matmuls
would (:func:`~mhmoe.moe.dispatch.precision.cuda_matmul_tf32`, either TF32 API). D and F are zero-padded
to multiples of 16 when they are not (aligned strides: pipelined loads). Under the Triton interpreter
(CPU, ``TRITON_INTERPRET=1`` before the kernels are imported) one small config runs (BM 16, BN 32:
several tiles per expert and masked edges at test sizes), with two interpreter-only helpers standing in
for ``tl.dot`` and the fp32 -> bf16 cast, which the interpreter gets wrong for bf16 (see kernels.py).
Under ``torch.autocast`` everything runs in the autocast dtype (fp32 and bf16 are supported and tested).

Under ``torch.compile`` the op is a set of opaque custom operators (:mod:`~mhmoe.moe.dispatch.triton.custom_ops`):
no graph break, and no host synchronisation, so a compiled step can be captured as a CUDA graph.

Not supported (:func:`triton_supported` is False, the dispatcher falls back): biased experts,
quantized (BitNet) experts, CPU tensors unless the kernels were imported under the interpreter.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as nnf
from torch import Tensor

from mhmoe.errors import ConfigError
from mhmoe.moe.dispatch.precision import compute_dtype
from mhmoe.moe.dispatch.triton.tiles import padded
from mhmoe.moe.experts import GroupedExperts
from mhmoe.moe.routers import RouterOutput

_DTYPES = (torch.float32, torch.bfloat16)


@torch.compiler.assume_constant_result  # a fact of the installation: torch.compile must not trace the import
def triton_available() -> bool:
    """Whether the ``triton`` package can be imported."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@torch.compiler.assume_constant_result  # fixed for the process once the kernels are imported
def _interpreted() -> bool:
    """Whether the kernels run (or, once imported, will run) under the Triton interpreter."""
    mod = sys.modules.get(f"{__package__}.kernels")
    if mod is not None:
        return mod.INTERPRETED
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _unsupported(x: Tensor, experts: GroupedExperts) -> str | None:
    if experts.quantized:
        return "quantized (bitnet158) experts"
    if any(b is not None for b in (experts.b1, experts.b2, experts.b3)):
        return "experts with biases"
    if compute_dtype(x) not in _DTYPES:
        return f"compute dtype {compute_dtype(x)}"
    if x.device.type == "cpu" and not _interpreted():
        return "CPU tensors outside the Triton interpreter (TRITON_INTERPRET=1)"
    if x.device.type not in ("cpu", "cuda"):
        return f"device {x.device.type}"
    return None


def triton_supported(x: Tensor, experts: GroupedExperts) -> bool:
    """Whether :func:`triton_moe` can run these experts on x (else fall back to another path):
    triton importable, bias-free unquantized experts, fp32/bf16 compute, a CUDA tensor (or a CPU
    tensor with the kernels under the interpreter)."""
    return triton_available() and _unsupported(x, experts) is None


def _pad_widths(x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """x [S, D] and the weights with D and F zero-padded to multiples of ALIGN (differentiable): every
    row stride is then 16-element aligned, which the kernels' pipelined (cp.async) loads need. Zero
    columns give zero hidden units (silu(0) * 0 = relu(0) = 0) that meet zero rows of W2: exact."""
    D, F = w1.shape[1], w1.shape[2]
    pd, pf = padded(D) - D, padded(F) - F
    if not (pd or pf):
        return x, w1, w2, w3
    pad_in = (0, pf, 0, pd)  # [E, D, F]
    return (nnf.pad(x, (0, pd)), nnf.pad(w1, pad_in), nnf.pad(w2, (0, pd, 0, pf)),
            None if w3 is None else nnf.pad(w3, pad_in))


def triton_moe(x: Tensor, route: RouterOutput, experts: GroupedExperts) -> Tensor:
    """Dropless grouped MoE with Triton kernels. x: [S, D] (any strides) -> [S, D] =
    sum over valid slots k of w[s,k] * Expert_{e[s,k]}(x[s]). No host synchronisation.

    Raises ConfigError (a one-line ValueError) without triton or for what :func:`triton_supported` rejects.
    """
    if not triton_available():
        raise ConfigError("model.moe.impl", "triton", "an installed triton package (pip install 'mhmoe[triton]')")
    why = _unsupported(x, experts)
    if why is not None:
        raise ConfigError("model.moe.impl", "triton", f"grouped_mm | sorted for {why}")
    dt = compute_dtype(x)
    S, K = route.experts.shape
    if x.numel() == 0 or S == 0:
        return x.new_zeros(x.shape, dtype=dt)
    from . import custom_ops

    D = x.shape[1]
    w1, w2 = experts.w1.to(dt), experts.w2.to(dt)
    w3 = None if experts.w3 is None else experts.w3.to(dt)
    if w3 is not None and w3.stride() != w1.stride():
        w3 = w3.contiguous()
        w1 = w1.contiguous()
    xp, w1, w2, w3 = _pad_widths(x.to(dt), w1, w2, w3)
    args = (xp, route.weights, w1, w2, w3, route.experts, route.valid, experts.n_experts)
    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                            for t in (xp, route.weights, w1, w2, w3))
    out = custom_ops.triton_moe_train(*args)[0] if grads else custom_ops.triton_moe_infer(*args)
    return out if out.shape[1] == D else out[:, :D]
