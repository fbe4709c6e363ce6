"""BitNet b1.58 fake quantization (quantization-aware training), see docs/BITNET.md.

Pure functions plus one module:

- :func:`weight_quant`: absmean ternary weights. gamma = mean|W| over ``dims`` (clamped at 1e-5),
  W_q = clamp(round(W / gamma), -1, 1) * gamma, computed in fp32, returned in W's dtype.
- :func:`activation_quant`: per-token (per row over the last dim) 8-bit absmax activations:
  scale = 127 / max|x| (max clamped at 1e-5), x_q = clamp(round(x * scale), -128, 127) / scale.
- :class:`BitLinear`: ``nn.Linear`` whose forward is ``F.linear(activation_quant(x), weight_quant(W))``.

Both quantizers use the straight-through estimator: the forward value is exactly the quantized
tensor and the gradient w.r.t. the input is the identity; the scales (gamma, 127/max|x|) are
computed from detached values, so no gradient flows through them. We write the STE as
``q + (x - x.detach())`` rather than ``x + (q - x).detach()``: same gradient, but the forward value
is *bit-exactly* ``q`` (``x - x.detach()`` is exactly zero), so a model loaded from the packed
ternary export computes the same logits as the fake-quantized model (mhmoe.integrations.bitnet_packed).

Sharded training (a later issue): gamma must be the mean over the *full* matrix, not over a local
shard. Every quantizer takes ``reduce_gamma``: a callable that receives the local statistics
``stats`` [2, *gamma_shape] (``stats[0]`` = sum|W| over ``dims``, ``stats[1]`` = element count) and
returns them summed over the shards (e.g. ``lambda t: (dist.all_reduce(t), t)[1]``). gamma is then
``stats[0] / stats[1]``. :class:`BitLinear` and :class:`mhmoe.moe.experts.GroupedExperts` hold a
``reduce_gamma`` attribute (default None = unsharded) that a parallelism wrapper can set.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

QUANT_NONE = "none"
BITNET158 = "bitnet158"
GAMMA_EPS = 1e-5  # clamp of gamma = mean|W|
ACT_EPS = 1e-5  # clamp of max|x| in the activation scale
ACT_QMIN, ACT_QMAX = -128, 127
SUBNORM_EPS = 1e-5  # eps of the per-expert FFN sub-norms

ReduceGamma = Callable[[Tensor], Tensor]


def _ste(q: Tensor, x: Tensor) -> Tensor:
    """Forward value exactly ``q``; gradient w.r.t. ``x`` the identity."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return q
    return q + (x - x.detach())


def absmean_gamma(w: Tensor, dims: Sequence[int] | None = None, reduce_gamma: ReduceGamma | None = None) -> Tensor:
    """gamma = mean|W| over ``dims`` (None = all), fp32, keepdim, clamped at 1e-5 (no gradient)."""
    wf = w.detach().float()
    dims = tuple(range(w.dim())) if dims is None else tuple(d % w.dim() for d in dims)
    s = wf.abs().sum(dim=dims, keepdim=True)
    n = 1
    for d in dims:
        n *= w.shape[d]
    if reduce_gamma is None:
        return (s / n).clamp_min(GAMMA_EPS)
    stats = reduce_gamma(torch.stack([s, torch.full_like(s, float(n))]))
    return (stats[0] / stats[1]).clamp_min(GAMMA_EPS)


def ternary_codes(w: Tensor, dims: Sequence[int] | None = None,
                  reduce_gamma: ReduceGamma | None = None) -> tuple[Tensor, Tensor]:
    """(codes, gamma): codes = clamp(round(W / gamma), -1, 1) as fp32 values in {-1, 0, 1} with W's
    shape, gamma [keepdim] fp32 (one per matrix, or per expert for ``dims=(1, 2)``)."""
    gamma = absmean_gamma(w, dims, reduce_gamma)
    codes = (w.detach().float() / gamma).round().clamp(-1, 1)
    return codes, gamma


def weight_quant(w: Tensor, dims: Sequence[int] | None = None, reduce_gamma: ReduceGamma | None = None) -> Tensor:
    """Absmean ternary fake quantization with STE: clamp(round(W/gamma), -1, 1) * gamma in W's dtype.

    ``dims``: the dimensions gamma is taken over (None = the whole tensor; ``(1, 2)`` for stacked
    expert weights [E, D_in, F] gives one gamma per expert).
    """
    codes, gamma = ternary_codes(w, dims, reduce_gamma)
    return _ste((codes * gamma).to(w.dtype), w)


def activation_codes(x: Tensor) -> tuple[Tensor, Tensor]:
    """(codes, scale): per-row 8-bit absmax codes in [-128, 127] (fp32 integral values) and the
    per-row scale 127 / max|x| [..., 1] fp32; the dequantized activation is codes / scale."""
    xf = x.detach().float()
    scale = ACT_QMAX / xf.abs().amax(dim=-1, keepdim=True).clamp_min(ACT_EPS)
    return (xf * scale).round().clamp(ACT_QMIN, ACT_QMAX), scale


def activation_quant(x: Tensor) -> Tensor:
    """Per-token 8-bit absmax fake quantization over the last dim, with STE, in x's dtype."""
    codes, scale = activation_codes(x)
    return _ste((codes / scale).to(x.dtype), x)


class BitLinear(nn.Linear):
    """BitNet b1.58 linear layer: ``F.linear(activation_quant(x), weight_quant(W), bias)``.

    No bias by default (the BitNet recipe); a bias, when asked for, stays full precision and is
    added after the quantized product. ``prequantized=True`` (set by the packed loader,
    :func:`mhmoe.integrations.bitnet_packed.load_packed`) uses the weight as stored -- it already is ternary x
    gamma -- while activations are still quantized. ``reduce_gamma``: see the module docstring.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.prequantized = False
        self.reduce_gamma: ReduceGamma | None = None

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight if self.prequantized else weight_quant(self.weight, None, self.reduce_gamma)
        return F.linear(activation_quant(x), w, self.bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", quant=bitnet158" + (", prequantized" if self.prequantized else "")


class SubNorm(nn.Module):
    """RMSNorm placed in front of a quantized matmul whose input is not normalised (attention output,
    MH-MoE merge input, ...). Its weight is cast to the input's dtype, so under bf16 autocast (where
    that input is bf16) it keeps the fused kernel."""

    def __init__(self, d: int, eps: float = SUBNORM_EPS) -> None:
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(d))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def quantized_weights(model: nn.Module) -> dict[str, tuple[int, ...] | None]:
    """Every fake-quantized weight of ``model``: parameter name -> dims gamma is taken over
    (None = the whole matrix; (1, 2) = per expert). Everything else stays full precision."""
    out: dict[str, tuple[int, ...] | None] = {}
    for prefix, m in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        if isinstance(m, BitLinear):
            out[f"{dot}weight"] = None
        elif getattr(m, "quant", QUANT_NONE) != QUANT_NONE and hasattr(m, "w1") and hasattr(m, "effective_weights"):
            for name in ("w1", "w2", "w3"):
                if getattr(m, name) is not None:
                    out[f"{dot}{name}"] = (1, 2)
    return out


def set_prequantized(model: nn.Module, value: bool = True) -> None:
    """Mark every quantized module's weights as already ternary x gamma (no re-quantization)."""
    for m in model.modules():
        if hasattr(m, "prequantized"):  # BitLinear and the stacked experts (mhmoe.moe.experts)
            cast(Any, m).prequantized = value
