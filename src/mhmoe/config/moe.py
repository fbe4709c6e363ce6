"""Configuration of the MoE / MH-MoE feed-forward layer.

One dataclass, :class:`MoEConfig`, describes every FFN variant in the library: the dense baseline
(``kind="dense"``), sparse MoE (``heads=1``, head/merge layers off), fine-grained MoE (more, smaller
experts, larger ``top_k``) and MH-MoE (``heads=h`` with head/merge projections). It is validated on
construction: a bad value raises :class:`mhmoe.errors.ConfigError` naming the field and what is
allowed. YAML/dict round-trips go through :func:`dataclasses.asdict` and ``MoEConfig(**d)``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal, get_args

from mhmoe.config.fields import check, check_types, coerce_fields
from mhmoe.errors import ConfigError

# the options of the string fields; check_types accepts exactly a Literal's values
FFNType = Literal["swiglu", "relu"]
Router = Literal["softmax", "xmoe", "noisy", "sigmoid", "expert_choice"]
RouterDtype = Literal["float32", "model"]
XMoEGate = Literal["softmax", "sigmoid"]
XMoEReading = Literal["paper", "code"]
Residual = Literal["block", "subtoken"]
Kind = Literal["dense", "moe"]
Impl = Literal["auto", "padded", "fused", "chunked", "sorted", "grouped_mm", "triton", "loop"]
CapacityPriority = Literal["causal", "gshard"]
BiasInit = Literal["torch", "zero"]
EntropyMode = Literal["token", "batch"]
Quant = Literal["none", "bitnet158"]
FFN_TYPES, ROUTERS, XMOE_GATES, RESIDUALS, KINDS = (get_args(t) for t in (FFNType, Router, XMoEGate, Residual, Kind))
XMOE_READINGS = get_args(XMoEReading)
IMPLS, CAPACITY_PRIORITIES, BIAS_INITS, ENTROPY_MODES, QUANTS = (
    get_args(t) for t in (Impl, CapacityPriority, BiasInit, EntropyMode, Quant))


@dataclass
class MoEConfig:
    """Hyper-parameters of one FFN layer (dense, SMoE, fine-grained SMoE or MH-MoE).

    Sizes: ``d_expert`` is the hidden width F of each routed expert; experts read and write vectors
    of width ``d_model / heads`` when ``token_split`` is on (else ``d_model``).
    """

    kind: Kind = "moe"  # "dense": one SwiGLU/ReLU FFN of width d_expert; "moe": routed experts
    n_experts: int = 8  # E
    top_k: int = 1  # K (expert-choice: average experts per token, sets the per-expert capacity)
    d_expert: int = 2048  # F, hidden width of every routed expert (and of the dense FFN)
    ffn: FFNType = "swiglu"  # swiglu (3 matrices) | relu (2 matrices, Huang et al. Eq.5)
    expert_bias: bool = False
    n_shared: int = 0  # always-on shared experts (DeepSeekMoE), each of width d_shared
    d_shared: int = 0  # 0 -> d_expert
    # ---- router -------------------------------------------------------------------------------
    router: Router = "softmax"  # softmax | xmoe | noisy | sigmoid | expert_choice
    # the router's score GEMM (x W^T): float32 = on fp32 copies of its input and weight, whatever the model's
    # dtype (Switch Transformer's selective precision); model = in the dtype the model's other linear layers
    # compute in (bf16 under bf16 autocast or with bf16 weights; scores rounded to it, as a bf16 linear layer's
    # output is), as Mixtral's and DeepSeek-V3's code and Megatron-LM's default. Softmax / sigmoid, top-k,
    # combine weights and losses run in fp32 either way. No difference in an fp32 model.
    router_dtype: RouterDtype = "float32"
    # combine weights of a token's top-k slots: None (auto) renormalises them to sum to one when
    # top_k > 1 (GShard / X-MoE top-2 gating; DeepSeek-V3 for the sigmoid gate) and keeps the raw
    # gate value for top-1 (Switch); true / false force one reading (false: raw gate values)
    renormalize: bool | None = None
    router_dim: int = 16  # X-MoE low-dimensional routing space
    xmoe_gate: XMoEGate = "softmax"  # X-MoE gate: softmax (tau0=0.3) | sigmoid (tau0=0.07)
    router_temperature: float = 0.0  # 0 -> 0.3 for softmax gating, 0.07 for sigmoid gating
    # which X-MoE (router="xmoe"): "paper" = the papers' text (token and expert embeddings L2-normalised,
    # learnable temperature, top_k slots, capacity_factor, balance loss over every chosen slot);
    # "code" = the authors' code (torchscale xmoe/routing.py Top2Gate with use_xmoe, docs/PAPERS.md):
    # only the expert embeddings are normalised (kept at norm 1.5), no temperature; top-2 with the
    # gates normalised over the two before any drop, the second expert kept with probability 2*g2
    # in training (eval: its weight times 2*g2, the expectation; deterministic); training capacity
    # top_k*ceil(S/E) with drops in capacity_priority order; balance loss on first choices only.
    # Needs top_k=2, xmoe_gate=softmax, capacity_factor=None, renormalize=None.
    xmoe_reading: XMoEReading = "paper"
    noise_std: float = 1.0  # noisy top-k: scale of the learned softplus noise
    aux_free_bias: bool = False  # DeepSeek-V3 aux-loss-free balancing bias (choice only)
    bias_update_rate: float = 1e-3
    # ---- capacity (None = dropless) -------------------------------------------------------------
    capacity_factor: float | None = None  # training
    eval_capacity_factor: float | None = None  # evaluation (model.eval())
    # which overflow slots are dropped first: causal = position-major (every slot at position t goes
    # before any slot at t+1), so no token's output depends on later tokens (required in the decoder
    # LM); gshard = every token's first choice before any second choice, then token order (reads the
    # future within a sequence: for bidirectional encoders and standalone layers only)
    capacity_priority: CapacityPriority = "causal"
    # ---- auxiliary losses ----------------------------------------------------------------------
    balance_loss_weight: float = 1e-2  # Switch / ICML Eq.10 (alpha)
    z_loss_weight: float = 0.0  # ST-MoE router z-loss
    entropy_loss_weight: float = 0.0  # survey Eq.3
    entropy_mode: EntropyMode = "token"  # token: mean per-token gate entropy | batch: log E - H(mean gate)
    # ---- multi-head (MH-MoE) ---------------------------------------------------------------------
    heads: int = 1  # h; sub-tokens of width d_model / h
    head_layer: bool = False  # W_head (d x d) before the split
    merge_layer: bool = False  # W_merge (d x d) after the merge
    mlp_layers: int = 1  # depth n of the head and merge MLPs (ICML Table 7), ReLU between layers
    token_split: bool = True  # token splitting-merging (ICML Table 6); off -> route whole tokens
    residual: Residual = "block"  # block (official code) | subtoken (ICML Eq.6)
    proj_bias: bool = True  # biases of the head/merge projections (official code: nn.Linear)
    # head-projection bias init: torch = nn.Linear's default U(-1/sqrt(d), 1/sqrt(d)) (the official
    # code, ICML App. E, only zeroes the merge bias) | zero. The merge bias always starts at zero.
    head_bias_init: BiasInit = "torch"
    # ---- execution -------------------------------------------------------------------------------
    impl: Impl = "auto"  # auto | padded | fused | chunked | sorted | grouped_mm | triton | loop (loop = the oracle)
    init_std: float = 0.02
    # ---- quantization (docs/BITNET.md) ---------------------------------------------------------------
    # none | bitnet158: ternary experts (gamma per expert), 8-bit activations, per-expert sub-norms,
    # BitLinear head/merge projections; the router stays fp32. Inside a model it is set from model.quant.
    quant: Quant = "none"

    def __post_init__(self) -> None:
        check_types(self, "")  # types, and the Literal options (kind, ffn, router, impl, ...)
        check(self.d_expert >= 1, "d_expert", self.d_expert, "an integer >= 1")
        check(self.n_shared >= 0, "n_shared", self.n_shared, "an integer >= 0")
        check(self.d_shared >= 0, "d_shared", self.d_shared, "an integer >= 0 (0 = d_expert)")
        check(self.init_std > 0, "init_std", self.init_std, "a float > 0")
        check(self.renormalize is None or isinstance(self.renormalize, bool), "renormalize", self.renormalize,
              "null (auto: true when top_k > 1) | true | false")
        if self.kind == "dense":
            return
        check(self.n_experts >= 1, "n_experts", self.n_experts, "an integer >= 1")
        check(
            1 <= self.top_k <= self.n_experts, "top_k", self.top_k, f"1..{self.n_experts} (<= n_experts)"
        )
        check(self.router_dim >= 1, "router_dim", self.router_dim, "an integer >= 1")
        check(self.router_temperature >= 0, "router_temperature", self.router_temperature, ">= 0")
        check(self.noise_std >= 0, "noise_std", self.noise_std, ">= 0")
        check(self.bias_update_rate >= 0, "bias_update_rate", self.bias_update_rate, ">= 0")
        for name in ("capacity_factor", "eval_capacity_factor"):
            cf = getattr(self, name)
            check(cf is None or cf > 0, name, cf, "None (dropless) or a float > 0")
        for name in ("balance_loss_weight", "z_loss_weight", "entropy_loss_weight"):
            check(getattr(self, name) >= 0, name, getattr(self, name), "a float >= 0")
        check(self.heads >= 1, "heads", self.heads, "an integer >= 1")
        check(0 <= self.mlp_layers <= 3, "mlp_layers", self.mlp_layers, "0..3")
        if self.xmoe_reading == "code":
            check(self.router == "xmoe", "xmoe_reading", "code", "paper unless router=xmoe")
            check(self.top_k == 2, "top_k", self.top_k, "2 with xmoe_reading=code (the authors' top-2 gate)")
            check(self.xmoe_gate == "softmax", "xmoe_gate", self.xmoe_gate, "softmax with xmoe_reading=code")
            check(self.capacity_factor is None, "capacity_factor", self.capacity_factor,
                  "None with xmoe_reading=code (training capacity is top_k*ceil(S/E))")
            check(self.renormalize is None, "renormalize", self.renormalize,
                  "null with xmoe_reading=code (gates are normalised before the drops)")
        if self.router == "expert_choice":
            check(not self.aux_free_bias, "aux_free_bias", True, "False with router=expert_choice")

    # ------------------------------------------------------------------------------------------
    @property
    def shared_width(self) -> int:
        return self.d_shared or self.d_expert

    @property
    def renormalize_weights(self) -> bool:
        """Whether the top-k combine weights are renormalised (``renormalize``; auto: ``top_k > 1``)."""
        return self.top_k > 1 if self.renormalize is None else self.renormalize

    def noncausal_fields(self) -> list[tuple[str, object, str]]:
        """(field, value, allowed) for every setting that lets a token's output depend on later tokens
        of its sequence; a causal decoder refuses them (:class:`~mhmoe.config.model.ModelConfig`)."""
        if self.kind == "dense":
            return []
        bad: list[tuple[str, object, str]] = []
        if self.router == "expert_choice":  # experts pick tokens over the whole batch
            routers = " | ".join(r for r in ROUTERS if r != "expert_choice")
            bad.append(("router", self.router, f"{routers} (expert choice reads later tokens)"))
        has_capacity = (self.capacity_factor is not None or self.eval_capacity_factor is not None
                        or self.xmoe_code)
        if has_capacity and self.capacity_priority != "causal":
            bad.append(("capacity_priority", self.capacity_priority, "causal (gshard priority reads later tokens)"))
        return bad

    @property
    def xmoe_code(self) -> bool:
        """True for the X-MoE router in the authors' code reading (``xmoe_reading="code"``)."""
        return self.kind == "moe" and self.router == "xmoe" and self.xmoe_reading == "code"

    @property
    def temperature_init(self) -> float:
        if self.router_temperature > 0:
            return self.router_temperature
        return 0.3 if self.xmoe_gate == "softmax" else 0.07

    @property
    def is_multihead(self) -> bool:
        """True when the layer needs the MH-MoE wrapper (heads, head/merge projections)."""
        return self.heads > 1 or self.head_layer or self.merge_layer or self.residual == "subtoken"

    def check_d_model(self, d_model: int, field: str = "d_model") -> None:
        """Validate against the model width (``heads`` must divide ``d_model`` when splitting)."""
        check(d_model >= 1, field, d_model, "an integer >= 1")
        if self.token_split and d_model % self.heads != 0:
            divisors = [h for h in range(1, min(d_model, 64) + 1) if d_model % h == 0]
            raise ConfigError("heads", self.heads, f"a divisor of d_model={d_model}: {divisors}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], prefix: str = "model.moe") -> MoEConfig:
        return cls(**coerce_fields(cls, d, prefix))
