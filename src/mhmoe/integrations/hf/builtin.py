"""Export a checkpoint as a model class built into ``transformers`` (``mhmoe export --hf --hf-arch builtin``).

The dense and sparse-MoE baselines are architectures that transformers (and the serving and conversion tools
that read its checkpoints) already know, so they can be exported without any model code of ours:

- every FFN dense -> **Llama** (``LlamaForCausalLM``): RMSNorm, rotate-half RoPE, SwiGLU, no biases, as ours;
  with ``qk_norm`` -> **Qwen3** (``Qwen3ForCausalLM``: Llama's blocks with a query and a key RMSNorm per head);
- softmax-routed sparse MoE without MH-MoE heads -> **Qwen2-MoE** (``Qwen2MoeForCausalLM``; with ``qk_norm``,
  **Qwen3-MoE**, which has no shared experts and no q/k/v biases), whose options
  cover ours: the MoE blocks (``decoder_sparse_step`` = ``moe_every``, the same rule), the top-k weights
  renormalised or raw (``norm_topk_prob``), dense blocks of width ``d_ff`` between MoE blocks, DeepSeekMoE
  shared experts. Three identities make the mapping exact: q/k/v carry zero biases (Qwen2-MoE before
  transformers 5 always has them); the n shared experts are one SwiGLU of width n x F_s (as
  :class:`~mhmoe.moe.experts.SharedExperts` computes them); Qwen2-MoE gates its shared expert with
  ``sigmoid(w x)``, so ``w = 0`` (a gate of exactly 0.5) and the down projection doubled give the ungated
  sum (both scalings are powers of two: exact). Without shared experts the shared expert is zero wide.

The weights are written in the hub's layout (one tensor per expert: ``mlp.experts.E.gate_proj.weight``, ...),
which every transformers version since Qwen2-MoE's first reads (transformers 5 fuses them while loading).
What is not representable -- MH-MoE heads or head/merge projections, the X-MoE, noisy, sigmoid and
expert-choice routers, ReLU experts, expert biases, an evaluation capacity, the aux-loss-free selection bias,
BitNet -- is refused with the field that rules it out (``--hf-arch mhmoe`` exports every model).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mhmoe.config.model import ModelConfig
from mhmoe.errors import ConfigError
from mhmoe.model.lm import LM

MHMOE_ONLY = "the default --hf-arch mhmoe, which exports every model"


def builtin_arch(cfg: ModelConfig) -> str:
    """``"llama"`` (every FFN dense), ``"qwen2_moe"`` (softmax-routed sparse MoE), or with ``qk_norm`` ``"qwen3"`` /
    ``"qwen3_moe"``; a one-line ConfigError naming the first field that no built-in architecture represents."""
    if cfg.arch != "decoder":
        raise ConfigError("model.arch", cfg.arch, f"decoder for --hf-arch builtin ({MHMOE_ONLY} but encoders)")
    if cfg.quant != "none":
        raise ConfigError("model.quant", cfg.quant, f"none for --hf-arch builtin (BitNet: {MHMOE_ONLY})")
    moe = cfg.moe
    if moe.kind == "dense":
        return "qwen3" if cfg.qk_norm else "llama"
    refusals = [
        ("heads", moe.heads, moe.heads == 1, "1"),
        ("head_layer", moe.head_layer, not moe.head_layer, "false"),
        ("merge_layer", moe.merge_layer, not moe.merge_layer, "false"),
        ("token_split", moe.token_split, moe.token_split, "true"),
        ("residual", moe.residual, moe.residual == "block", "block"),
        ("router", moe.router, moe.router == "softmax", "softmax"),
        ("aux_free_bias", moe.aux_free_bias, not moe.aux_free_bias, "false"),
        ("ffn", moe.ffn, moe.ffn == "swiglu", "swiglu"),
        ("expert_bias", moe.expert_bias, not moe.expert_bias, "false"),
        ("eval_capacity_factor", moe.eval_capacity_factor, moe.eval_capacity_factor is None,
         "null (dropless; Qwen2-MoE drops no token)"),
    ]
    for field, value, ok, allowed in refusals:
        if not ok:
            raise ConfigError(f"model.moe.{field}", value, f"{allowed} for --hf-arch builtin (else {MHMOE_ONLY})")
    if cfg.qk_norm and moe.n_shared:
        raise ConfigError("model.moe.n_shared", moe.n_shared, f"0 with model.qk_norm for --hf-arch builtin (Qwen3-MoE "
                          f"has no shared experts; else {MHMOE_ONLY})")
    return "qwen3_moe" if cfg.qk_norm else "qwen2_moe"


def builtin_config(cfg: ModelConfig, eos_token_id: int) -> Any:
    """The transformers config (``LlamaConfig``, ``Qwen3Config``, ``Qwen2MoeConfig``, ``Qwen3MoeConfig``) of a model
    :func:`builtin_arch` accepts."""
    import transformers
    from transformers import AutoConfig

    arch = builtin_arch(cfg)
    try:
        AutoConfig.for_model(arch)
    except (KeyError, ValueError):  # Qwen3 came with transformers 4.51
        raise ConfigError("model.qk_norm", cfg.qk_norm, f"false for --hf-arch builtin with transformers "
                          f"{transformers.__version__}, which has no {arch} (4.51 or newer has)") from None
    common: dict[str, Any] = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads,
        hidden_act="silu", max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings, attention_dropout=0.0,
        bos_token_id=eos_token_id, eos_token_id=eos_token_id, pad_token_id=eos_token_id, torch_dtype="float32")
    if arch == "llama":
        return AutoConfig.for_model("llama", **common, attention_bias=False, mlp_bias=False)
    if arch == "qwen3":
        return AutoConfig.for_model("qwen3", **common, head_dim=cfg.d_model // cfg.n_heads, attention_bias=False,
                                    use_sliding_window=False)
    moe = cfg.moe
    sparse = dict(decoder_sparse_step=cfg.moe_every, mlp_only_layers=[], num_experts=moe.n_experts,
                  num_experts_per_tok=moe.top_k, moe_intermediate_size=moe.d_expert,
                  norm_topk_prob=moe.renormalize_weights, use_sliding_window=False, output_router_logits=False)
    if arch == "qwen3_moe":
        return AutoConfig.for_model("qwen3_moe", **common, **sparse, head_dim=cfg.d_model // cfg.n_heads,
                                    attention_bias=False)
    return AutoConfig.for_model("qwen2_moe", **common, **sparse, qkv_bias=True,
                                shared_expert_intermediate_size=moe.n_shared * moe.shared_width)


def _swiglu(w1: Tensor, w2: Tensor, w3: Tensor, prefix: str, down_scale: float = 1.0) -> dict[str, Tensor]:
    """One SwiGLU FFN in the hub's layout: ours computes ``(silu(x w1) * (x w3)) w2`` with w1, w3 [D, F] and
    w2 [F, D]; a transformers ``nn.Linear`` stores the transposes."""
    return {f"{prefix}.gate_proj.weight": w1.t().contiguous(), f"{prefix}.up_proj.weight": w3.t().contiguous(),
            f"{prefix}.down_proj.weight": (w2.t() * down_scale).contiguous()}


def _ffn_weights(block: Any, prefix: str, qwen3: bool = False) -> dict[str, Tensor]:
    """The FFN of one block: a dense SwiGLU (every architecture's ``mlp``) or a Qwen2-MoE / Qwen3-MoE sparse
    block."""
    ffn = block.ffn
    if not block.is_moe:  # DenseLayer: a one-expert GroupedExperts
        e = ffn.ffn.experts
        return _swiglu(e.w1[0], e.w2[0], e.w3[0], prefix)
    e, d = ffn.experts, ffn.d_in
    out = {f"{prefix}.gate.weight": ffn.router.weight.detach().clone()}
    for i in range(e.w1.shape[0]):
        out.update(_swiglu(e.w1[i], e.w2[i], e.w3[i], f"{prefix}.experts.{i}"))
    if qwen3:  # Qwen3-MoE: no shared expert
        return out
    if ffn.shared is None:  # a zero-wide shared expert adds nothing
        empty = e.w1.new_zeros(d, 0)
        out.update(_swiglu(empty, empty.t(), empty, f"{prefix}.shared_expert"))
    else:  # sigmoid(0) = 0.5 exactly, so twice the down projection gives the ungated sum
        s = ffn.shared.ffn.experts
        out.update(_swiglu(s.w1[0], s.w2[0], s.w3[0], f"{prefix}.shared_expert", down_scale=2.0))
    out[f"{prefix}.shared_expert_gate.weight"] = e.w1.new_zeros(1, d)
    return out


@torch.no_grad()
def builtin_state_dict(lm: LM) -> dict[str, Tensor]:
    """``lm``'s weights under the hub names of :func:`builtin_arch`'s architecture (fp32, contiguous, no
    shared storage; the LM head left out when it is tied to the embedding, as transformers saves it)."""
    cfg, arch = lm.cfg, builtin_arch(lm.cfg)
    D, KVD = cfg.d_model, cfg.kv_heads * (cfg.d_model // cfg.n_heads)
    sd: dict[str, Tensor] = {"model.embed_tokens.weight": lm.embed.weight.clone(),
                             "model.norm.weight": lm.norm.weight.clone()}
    if not cfg.tie_embeddings:
        sd["lm_head.weight"] = lm.lm_head.weight.clone()
    for i, block in enumerate(lm.blocks):
        p = f"model.layers.{i}"
        q, k, v = block.attn.qkv.weight.split([D, KVD, KVD])  # rows q | k | v, heads in order within each
        sd.update({f"{p}.input_layernorm.weight": block.attn_norm.weight.clone(),
                   f"{p}.post_attention_layernorm.weight": block.ffn_norm.weight.clone(),
                   f"{p}.self_attn.q_proj.weight": q.clone(), f"{p}.self_attn.k_proj.weight": k.clone(),
                   f"{p}.self_attn.v_proj.weight": v.clone(),
                   f"{p}.self_attn.o_proj.weight": block.attn.proj.weight.clone()})
        if arch == "qwen2_moe":
            widths = {"q": D, "k": KVD, "v": KVD}
            sd.update({f"{p}.self_attn.{n}_proj.bias": q.new_zeros(w) for n, w in widths.items()})
        if block.attn.q_norm is not None:
            sd.update({f"{p}.self_attn.q_norm.weight": block.attn.q_norm.weight.clone(),
                       f"{p}.self_attn.k_norm.weight": block.attn.k_norm.weight.clone()})
        sd.update(_ffn_weights(block, f"{p}.mlp", qwen3=arch == "qwen3_moe"))
    return {k: v.detach().float().contiguous() for k, v in sd.items()}
