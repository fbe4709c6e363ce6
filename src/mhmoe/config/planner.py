"""FLOPs- and parameter-parity planner (Huang et al. 2024, §2.2-2.3, generalised).

Given a baseline sparse MoE layer (d, F_b, E_b, k_b, FFN type, optional shared experts) and a number
of heads h, find the MH-MoE expert width F_h and expert count E_h whose FLOPs **and** parameters
match the baseline. Counts are per token and per MoE layer, in the papers' convention:

- an (m x n)(n x p) matrix product costs m*p*(2n - 1) FLOPs (Huang Eq.6-7 count
  multiplications + additions exactly); biases, element-wise ops (activation, gating product,
  weighted combine) and the router are excluded unless ``include_router``;
- per expert and (sub-)token of width a = d/h: ReLU FFN ``F(2a-1) + a(2F-1)`` (Eq.5),
  SwiGLU ``2F(2a-1) + a(2F-1)``; each token sends h sub-tokens to k experts each;
- head and merge layers are d x d each (``mlp_layers`` of them each): ``d(2d-1)`` FLOPs and d^2
  parameters per matrix; expert parameters ``2aF`` (ReLU) or ``3aF`` (SwiGLU) (Eq.9).

Leading-term parity (the paper's Eq.8), generalised: with c = 4 (ReLU) or 6 (SwiGLU),
``c d F_h k_h + 4 n d^2 = c d F_b k_b``  ->  ``F_h = (F_b k_b - 4 n d / c) / k_h``.
Parameter parity (Eq.9): ``E_b P(d, F_b) = 2 n d^2 + E_h P(d/h, F_h)``.
``match="exact"`` solves the exact counts (linear in F) instead of the leading terms.
``parity="params"`` is the ICML paper's setting: E_h = E_b and F_h = beta * h * F_b with beta chosen
to match parameters only -- its FLOPs blow up (67 d^2 vs 16 d^2 for h=4, F_b=4d, E=16, ReLU).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from mhmoe.errors import ConfigError

PARITIES = ("flops", "params")
MATCHES = ("leading", "exact")


def matmul_flops(m: float, n: float, p: float) -> float:
    """FLOPs of an (m x n) @ (n x p) product: m*p*(2n - 1)."""
    return m * p * (2 * n - 1)


def ffn_flops(d_in: float, d_hidden: float, ffn: str) -> float:
    """Exact FLOPs of one FFN on one row of width d_in (bias-free)."""
    n_in = 2 if ffn == "swiglu" else 1
    return n_in * matmul_flops(1, d_in, d_hidden) + matmul_flops(1, d_hidden, d_in)


def ffn_params(d_in: float, d_hidden: float, ffn: str) -> float:
    return (3 if ffn == "swiglu" else 2) * d_in * d_hidden


def _c(ffn: str) -> int:
    """Leading FLOPs coefficient of an FFN: c*d*F per token."""
    return 6 if ffn == "swiglu" else 4


@dataclass
class LayerCount:
    """FLOPs per token and parameters of one MoE layer, itemised."""

    d_ff: float
    experts: float
    top_k: int
    heads: int
    flops_per_token: float
    leading_flops: float
    expert_flops: float
    head_merge_flops: float
    router_flops: float
    shared_flops: float
    params: float
    expert_params: float
    head_merge_params: float
    router_params: float
    shared_params: float


def count_layer(d: int, d_ff: float, experts: float, top_k: int, ffn: str, heads: int = 1,
                head_merge_mats: int = 0, include_router: bool = False, shared: int = 0,
                d_shared: int = 0) -> LayerCount:
    """Count one (MH-)MoE layer. ``head_merge_mats`` = number of d x d projection matrices."""
    a = d / heads
    e_flops = heads * top_k * ffn_flops(a, d_ff, ffn)
    hm_flops = head_merge_mats * matmul_flops(1, d, d)
    r_flops = heads * matmul_flops(1, a, experts) if include_router else 0.0
    s_flops = ffn_flops(d, shared * d_shared, ffn) if shared else 0.0
    e_params = experts * ffn_params(a, d_ff, ffn)
    hm_params = head_merge_mats * d * d
    r_params = a * experts if include_router else 0.0
    s_params = ffn_params(d, shared * d_shared, ffn) if shared else 0.0
    leading = _c(ffn) * d * d_ff * top_k + 2 * head_merge_mats * d * d + (_c(ffn) * d * shared * d_shared)
    return LayerCount(
        d_ff=d_ff, experts=experts, top_k=top_k, heads=heads,
        flops_per_token=e_flops + hm_flops + r_flops + s_flops, leading_flops=leading,
        expert_flops=e_flops, head_merge_flops=hm_flops, router_flops=r_flops, shared_flops=s_flops,
        params=e_params + hm_params + r_params + s_params, expert_params=e_params,
        head_merge_params=hm_params, router_params=r_params, shared_params=s_params,
    )


@dataclass
class Plan:
    """Result of :func:`plan`. ``mhmoe.d_ff``/``experts`` are the chosen integers; the ``*_exact``
    fields the fractional solutions; ratios are MH-MoE / baseline."""

    d_model: int
    ffn: str
    parity: str
    match: str
    include_router: bool
    baseline: LayerCount
    mhmoe: LayerCount
    d_ff_exact: float
    experts_exact: float
    beta: float
    flops_ratio: float
    params_ratio: float
    # the same two layers counted with and without the router's own matmul and weights (d/h x E per
    # sub-token); one pair equals flops_ratio / params_ratio, depending on include_router
    flops_ratio_with_router: float = 1.0
    params_ratio_with_router: float = 1.0
    flops_ratio_without_router: float = 1.0
    params_ratio_without_router: float = 1.0

    def to_dict(self) -> dict:
        out = asdict(self)
        out["mhmoe"]["d_ff_exact"] = self.d_ff_exact
        out["mhmoe"]["experts_exact"] = self.experts_exact
        out["baseline"]["leading_d2"] = self.baseline.leading_flops / self.d_model ** 2
        out["mhmoe"]["leading_d2"] = self.mhmoe.leading_flops / self.d_model ** 2
        for side in ("baseline", "mhmoe"):
            for k in ("d_ff", "experts"):
                v = out[side][k]
                out[side][k] = int(v) if float(v).is_integer() else v
        return out


def _positive_int(name: str, v: int | None, allow_none: bool = False) -> None:
    if v is None and allow_none:
        return
    if not isinstance(v, int) or v < 1:
        raise ConfigError(name, v, "an integer >= 1")


def plan(d_model: int, d_ff: int, experts: int, top_k: int = 1, ffn: str = "swiglu", heads: int = 2,
         mh_top_k: int | None = None, parity: str = "flops", match: str = "leading",
         head_layer: bool = True, merge_layer: bool = True, mlp_layers: int = 1,
         mh_experts: int | None = None, mh_d_ff: int | None = None, include_router: bool = False,
         shared: int = 0, d_shared: int = 0) -> Plan:
    """Size an MH-MoE layer at parity with a baseline SMoE layer (see the module docstring).

    ``mh_top_k`` defaults to ``heads`` in FLOPs parity (the v2 paper: h=2 -> top-2, h=3 -> top-3)
    and to ``top_k`` in parameter parity (the ICML paper keeps the baseline's top-k).
    ``mh_experts`` / ``mh_d_ff`` fix E_h / F_h (the other is still solved unless fixed too).
    """
    for name, v in (("d_model", d_model), ("d_ff", d_ff), ("experts", experts), ("top_k", top_k),
                    ("heads", heads)):
        _positive_int(name, v)
    _positive_int("mh_top_k", mh_top_k, allow_none=True)
    _positive_int("mh_experts", mh_experts, allow_none=True)
    _positive_int("mh_d_ff", mh_d_ff, allow_none=True)
    if ffn not in ("relu", "swiglu"):
        raise ConfigError("ffn", ffn, "relu | swiglu")
    if parity not in PARITIES:
        raise ConfigError("parity", parity, " | ".join(PARITIES))
    if match not in MATCHES:
        raise ConfigError("match", match, " | ".join(MATCHES))
    if top_k > experts:
        raise ConfigError("top_k", top_k, f"1..{experts} (<= experts)")
    if d_model % heads:
        raise ConfigError("heads", heads, f"a divisor of d_model={d_model}")
    if not 0 <= mlp_layers <= 3:
        raise ConfigError("mlp_layers", mlp_layers, "0..3")
    if shared < 0 or (shared and d_shared < 1):
        raise ConfigError("shared", shared, "0, or >= 1 with d_shared >= 1")
    k_h = mh_top_k or (heads if parity == "flops" else top_k)
    mats = mlp_layers * (int(head_layer) + int(merge_layer))
    common: dict[str, Any] = dict(ffn=ffn, include_router=include_router, shared=shared, d_shared=d_shared)
    base = count_layer(d_model, d_ff, experts, top_k, heads=1, **common)

    def count(f: float, e: float) -> LayerCount:
        return count_layer(d_model, f, e, k_h, heads=heads, head_merge_mats=mats, **common)

    def solve_f(e: float) -> float:  # FLOPs parity, linear in F: f(F) = f(0) + slope * F
        if match == "leading":
            return (d_ff * top_k - 2 * mats * d_model / _c(ffn)) / k_h
        f0, f1 = count(0.0, e).flops_per_token, count(1.0, e).flops_per_token
        return (base.flops_per_token - f0) / (f1 - f0)

    def solve_e(f: float) -> float:  # parameter parity, linear in E
        p0, p1 = count(f, 0.0).params, count(f, 1.0).params
        return (base.params - p0) / (p1 - p0) if p1 > p0 else math.inf

    def solve_f_params(e: float) -> float:  # ICML setting: F from parameters at fixed E
        p0, p1 = count(0.0, e).params, count(1.0, e).params
        return (base.params - p0) / (p1 - p0)

    e_exact, f_exact = float(mh_experts or experts), float(mh_d_ff or d_ff)
    for _ in range(60):  # fixed point; exact after one pass unless the router couples F and E
        if parity == "flops":
            f_exact = float(mh_d_ff) if mh_d_ff else solve_f(e_exact)
            e_exact = float(mh_experts) if mh_experts else solve_e(f_exact)
        else:
            f_exact = float(mh_d_ff) if mh_d_ff else solve_f_params(e_exact)
    if not (f_exact >= 0.5 and math.isfinite(e_exact) and e_exact >= 0.5):
        raise ConfigError("heads", heads, "a configuration whose parity solution has d_ff >= 1 and experts >= 1 "
                          f"(got d_ff={f_exact:.2f}, experts={e_exact:.2f}; lower the head/merge cost or raise top-k)")
    f_int = mh_d_ff or max(1, round(f_exact))
    if parity == "flops":
        e_exact = solve_e(f_int)  # parameter parity at the integer width actually used
    e_int = int(mh_experts or max(1, round(e_exact)))
    # report the parity solutions even for fixed values: how far a given configuration is from them
    f_exact = solve_f(e_int) if parity == "flops" else solve_f_params(e_int)
    mh = count(f_int, e_int)
    ratios = {}
    for with_router in (True, False):
        kw = dict(common, include_router=with_router)
        b_r = count_layer(d_model, d_ff, experts, top_k, heads=1, **kw)
        m_r = count_layer(d_model, f_int, e_int, k_h, heads=heads, head_merge_mats=mats, **kw)
        tag = "with" if with_router else "without"
        ratios[f"flops_ratio_{tag}_router"] = m_r.flops_per_token / b_r.flops_per_token
        ratios[f"params_ratio_{tag}_router"] = m_r.params / b_r.params
    return Plan(
        d_model=d_model, ffn=ffn, parity=parity, match=match, include_router=include_router,
        baseline=base, mhmoe=mh, d_ff_exact=f_exact, experts_exact=e_exact,
        beta=f_int / (heads * d_ff), flops_ratio=mh.flops_per_token / base.flops_per_token,
        params_ratio=mh.params / base.params, **ratios,
    )


def _fmt(x: float) -> str:
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.3f}"


def format_plan(p: Plan) -> str:
    """Human-readable table of a plan."""
    d = p.d_model
    b, m = p.baseline, p.mhmoe
    rows = [
        ("experts E", _fmt(b.experts), f"{_fmt(m.experts)}  (exact {p.experts_exact:.3f})"),
        ("expert width F", _fmt(b.d_ff), f"{_fmt(m.d_ff)}  (exact {p.d_ff_exact:.3f})"),
        ("top-k", str(b.top_k), str(m.top_k)),
        ("heads h / sub-token width", f"1 / {d}", f"{m.heads} / {d // m.heads}"),
        ("FLOPs/token (exact)", _fmt(b.flops_per_token), _fmt(m.flops_per_token)),
        ("  leading term", f"{_fmt(b.leading_flops)} = {b.leading_flops / d**2:.4g} d^2",
         f"{_fmt(m.leading_flops)} = {m.leading_flops / d**2:.4g} d^2"),
        ("  experts / head+merge", f"{_fmt(b.expert_flops)} / 0",
         f"{_fmt(m.expert_flops)} / {_fmt(m.head_merge_flops)}"),
        ("parameters", _fmt(b.params), _fmt(m.params)),
        ("  experts / head+merge", f"{_fmt(b.expert_params)} / 0",
         f"{_fmt(m.expert_params)} / {_fmt(m.head_merge_params)}"),
    ]
    if p.include_router:
        rows.append(("  router FLOPs / params", f"{_fmt(b.router_flops)} / {_fmt(b.router_params)}",
                     f"{_fmt(m.router_flops)} / {_fmt(m.router_params)}"))
    if b.shared_params:
        rows.append(("  shared expert FLOPs / params", f"{_fmt(b.shared_flops)} / {_fmt(b.shared_params)}",
                     f"{_fmt(m.shared_flops)} / {_fmt(m.shared_params)}"))
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows + [("", "baseline SMoE", "")])
    title = (f"MH-MoE parity plan: d={d}, ffn={p.ffn}, parity={p.parity}"
             + (f", match={p.match}" if p.parity == "flops" else "")
             + (", router included" if p.include_router else ""))
    lines = [title, f"{'':<{w0}}  {'baseline SMoE':>{w1}}  MH-MoE"]
    lines += [f"{a:<{w0}}  {bb:>{w1}}  {c}" for a, bb, c in rows]
    lines.append(f"FLOPs ratio {p.flops_ratio:.5f}   params ratio {p.params_ratio:.5f}"
                 + (f"   beta {p.beta:.5f}" if p.parity == "params" else ""))
    lines.append(f"  router {'left out' if p.include_router else 'included'}: FLOPs ratio "
                 f"{p.flops_ratio_without_router if p.include_router else p.flops_ratio_with_router:.5f}   "
                 f"params ratio {p.params_ratio_without_router if p.include_router else p.params_ratio_with_router:.5f}"
                 f"  (the router: d/h x E per sub-token)")
    return "\n".join(lines)
