"""Transformer configuration: :class:`ModelConfig` (the FFN of every ``moe_every``-th block is the layer
``ModelConfig.moe`` describes)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal, get_args

from mhmoe.config.fields import check, check_types, coerce_fields
from mhmoe.config.moe import MoEConfig, Quant
from mhmoe.errors import ConfigError

# decoder: the causal LM (mhmoe.model.lm, data.task=lm); encoder: the bidirectional masked-data
# encoder (mhmoe.model.encoder, data.task=masked_mm)
Arch = Literal["decoder", "encoder"]
ARCHS: tuple[str, ...] = get_args(Arch)


@dataclass
class ModelConfig:
    """Transformer hyper-parameters; ``moe`` describes the FFN of every ``moe_every``-th block.

    ``arch="decoder"`` is a causal language model, so routing settings that let a token's output depend on
    later tokens (expert-choice routing, GShard capacity priority; :meth:`MoEConfig.noncausal_fields`) are
    refused with a one-line ``ConfigError`` naming the ``model.moe`` field; the bidirectional
    ``arch="encoder"`` accepts them.
    """

    arch: Arch = "decoder"  # decoder | encoder
    vocab_size: int = 8192  # overwritten from the tokenizer at training time when 0
    d_model: int = 768
    n_layers: int = 12
    n_heads: int = 12
    # key/value heads: 0 = n_heads (multi-head attention); fewer = grouped-query attention (Ainslie et al. 2023,
    # arXiv:2305.13245; 1 = multi-query): query head i reads key/value head i // (n_heads / n_kv_heads), and the
    # KV cache holds n_kv_heads heads. A divisor of n_heads
    n_kv_heads: int = 0
    # RMSNorm (weights of width HD, eps norm_eps) over every head's query and key before RoPE (Dehghani et al.
    # 2023; OLMoE and Qwen3 train their MoE models with it, against logit growth in attention)
    qk_norm: bool = False
    d_ff: int = 2048  # dense SwiGLU width of the non-MoE blocks
    moe_every: int = 2  # block i has the MoE FFN when (i + 1) % moe_every == 0 (v2 paper: 2)
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02
    # none | bitnet158 (BitNet b1.58 quantization-aware training, docs/BITNET.md): attention
    # projections, every FFN/expert matrix and the MH-MoE head/merge projections are ternary with
    # 8-bit activations; embeddings, LM head, norms and routers stay full precision. Applies to the
    # whole model: moe.quant and the dense FFNs are set from it.
    quant: Quant = "none"
    moe: MoEConfig = field(default_factory=MoEConfig)

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):
            self.moe = MoEConfig.from_dict(self.moe)
        check(isinstance(self.moe, MoEConfig), "model.moe", type(self.moe).__name__, "a MoEConfig")
        check_types(self, "")  # types, and the Literal options (arch, quant)
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "moe_every", "max_seq_len"):
            v = getattr(self, name)
            check(isinstance(v, int) and v >= (0 if name == "vocab_size" else 1), name, v, "a positive integer")
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ConfigError("n_heads", self.n_heads, f"a divisor of d_model={self.d_model} giving an even head dim")
        check(isinstance(self.n_kv_heads, int) and self.n_kv_heads >= 0 and
              (self.n_kv_heads == 0 or self.n_heads % self.n_kv_heads == 0), "n_kv_heads", self.n_kv_heads,
              f"0 (= n_heads) or a divisor of n_heads={self.n_heads}")
        check(self.rope_theta > 0, "rope_theta", self.rope_theta, "> 0")
        check(self.norm_eps > 0, "norm_eps", self.norm_eps, "a float > 0 (RMSNorm epsilon)")
        check(self.init_std > 0, "init_std", self.init_std, "a float > 0")
        for name in ("tie_embeddings", "qk_norm"):
            check(isinstance(getattr(self, name), bool), name, getattr(self, name), "true | false")
        if self.moe.quant != self.quant:  # model.quant is authoritative (a copy: MoEConfigs may be shared)
            self.moe = replace(self.moe, quant=self.quant)
        self.moe.check_d_model(self.d_model, "d_model")
        for name, value, allowed in self.moe.noncausal_fields() if self.arch == "decoder" else ():
            raise ConfigError(f"model.moe.{name}", value, allowed)

    @property
    def kv_heads(self) -> int:
        """Key/value heads (``n_kv_heads``, 0 = ``n_heads``)."""
        return self.n_kv_heads or self.n_heads

    def is_moe_block(self, i: int) -> bool:
        return self.moe.kind != "dense" and (i + 1) % self.moe_every == 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a dict (YAML / ``--set``); errors name the dotted field (``model.moe.top_k``)."""
        d = coerce_fields(cls, d, "model")
        if isinstance(d.get("moe"), dict):
            try:
                d["moe"] = MoEConfig.from_dict(d["moe"])
            except ConfigError as e:
                raise _dotted(e, "model.moe") from None
        try:
            return cls(**d)
        except ConfigError as e:  # check_d_model reports the MoE field "heads"
            raise _dotted(e, "model.moe" if e.field == "heads" else "model") from None


def _dotted(e: ConfigError, prefix: str) -> ConfigError:
    return e if "." in e.field else ConfigError(f"{prefix}.{e.field}", e.value, e.allowed, e.hint)
