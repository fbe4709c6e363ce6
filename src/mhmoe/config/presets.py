"""Named run presets. Every MoE preset is sized by the parity planner (:mod:`mhmoe.config.planner`), so
its FLOPs and parameters match the SMoE baseline of its family within 1%.

Families (``paper-*`` = the v2 paper's 12-layer d=768 architecture; ``tiny-*`` = the same family
scaled down for a 2-core CPU, d=192, 4 layers):

- ``dense``: SwiGLU FFN of width d_ff everywhere.
- ``smoe``: 8 experts of width d_ff, top-1, in every 2nd block.
- ``fgmoe``: fine-grained SMoE, 16 experts of width d_ff/2, top-2.
- ``mh2`` / ``mh3``: MH-MoE h=2 (top-2) / h=3 (top-3), width and count from the planner.
- ``*-shared``: the MoE models plus one shared expert of width d_ff.
- ``icml-xmoe-E`` / ``icml-mh4-E`` (E = 8, 32): the ICML paper's setting -- X-MoE router, ReLU
  experts of width 4d, top-2; MH-MoE with h=4 at *parameter* parity (expert width beta*h*4d). The
  X-MoE routing space is 16-dim, MH-MoE's 16/h (ICML Table 9; :func:`icml_router_dim`).
  ``icml-xmoe-E-code`` / ``icml-mh4-E-code``: the same under the authors' code reading of X-MoE
  (``xmoe_reading=code``: routing dimension 16 for every h, expert biases; docs/PAPERS.md).
- ``*-bitnet`` (dense, smoe, fgmoe, mh2, mh3): the same models trained with BitNet b1.58
  quantization (``model.quant=bitnet158``, v2 paper Table 3) and the BitNet schedule defaults:
  peak lr 2x the full-precision one, lr halved at the halfway point (``lr_stage2_ratio=0.5``),
  weight decay 0.1 -> 0 at the halfway point, no head/merge biases (see docs/BITNET.md).

Top-k combine weights are renormalised for top_k > 1 (``MoEConfig.renormalize`` auto, as GShard /
X-MoE); ``--set model.moe.renormalize=false`` gives the raw gate values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from mhmoe.config.data import DataConfig
from mhmoe.config.model import ModelConfig
from mhmoe.config.moe import MoEConfig
from mhmoe.config.planner import Plan, plan
from mhmoe.config.run import RunConfig
from mhmoe.config.train import TrainConfig
from mhmoe.errors import ConfigError, did_you_mean

SCALES: dict[str, dict[str, Any]] = {
    # d_model, n_layers, n_heads, d_ff (= 8/3 d, the v2 paper's 2048/768)
    "paper": dict(d_model=768, n_layers=12, n_heads=12, d_ff=2048, max_seq_len=1024),
    "tiny": dict(d_model=192, n_layers=4, n_heads=6, d_ff=512, max_seq_len=512),
}
TRAIN = {
    # v2 paper: 0.5M tokens per step, 100k steps; ICML Table 10: lr 5e-4, 10k warm-up, linear decay
    "paper": TrainConfig(max_steps=100_000, batch_size=16, seq_len=1024, grad_accum=32, lr=5e-4,
                         warmup_steps=10_000, dtype="bfloat16", eval_every=5000, ckpt_every=5000, eval_batches=50),
    # 2-core CPU: fp32 (bf16 autocast is slower for the many small expert GEMMs of MH-MoE on CPU),
    # 200 steps x 4096 tokens ~ one epoch of the KJV training split
    "tiny": TrainConfig(max_steps=200, batch_size=16, seq_len=256, grad_accum=1, lr=2e-3, warmup_steps=20,
                        min_lr_ratio=0.1, dtype="float32", log_every=10, eval_every=0, ckpt_every=100,
                        eval_batches=16),
}
VARIANTS = ("dense", "smoe", "fgmoe", "mh2", "mh3")
# BitNet b1.58 schedule defaults (docs/BITNET.md): the b1.58 paper and its training notes use a
# higher peak lr than full precision, a two-stage lr (drop at the halfway point) and weight decay
# 0.1 -> 0 at the halfway point. Peak lr: 2x the scale's full-precision lr; the drop: x0.5.
BITNET_LR_FACTOR = 2.0
BITNET_TRAIN: dict[str, Any] = dict(lr_stage2_ratio=0.5, weight_decay=0.1, wd_stage2=0.0)


def variant_plan(d: int, d_ff: int, variant: str) -> Plan | None:
    """The planner call that sizes ``variant`` against the 8-expert top-1 SwiGLU SMoE baseline."""
    if variant in ("dense", "smoe"):
        return None
    if variant == "fgmoe":
        return plan(d, d_ff, 8, 1, "swiglu", heads=1, head_layer=False, merge_layer=False, mh_top_k=2)
    heads = {"mh2": 2, "mh3": 3}[variant]
    return plan(d, d_ff, 8, 1, "swiglu", heads=heads)


def moe_config(scale: str, variant: str, shared: bool = False) -> MoEConfig:
    d, d_ff = SCALES[scale]["d_model"], SCALES[scale]["d_ff"]
    extra: dict[str, Any] = dict(n_shared=1, d_shared=d_ff) if shared else {}
    if variant == "dense":
        return MoEConfig(kind="dense", d_expert=d_ff)
    if variant == "smoe":
        return MoEConfig(n_experts=8, top_k=1, d_expert=d_ff, **extra)
    p = variant_plan(d, d_ff, variant)
    assert p is not None
    heads = p.mhmoe.heads
    return MoEConfig(n_experts=int(p.mhmoe.experts), top_k=p.mhmoe.top_k, d_expert=int(p.mhmoe.d_ff), heads=heads,
                     head_layer=heads > 1, merge_layer=heads > 1, **extra)


def icml_router_dim(heads: int, token_split: bool = True) -> int:
    """X-MoE routing dimension of the ICML setting (Table 9): 16 for X-MoE, 16/h for MH-MoE, rounded to
    the nearest integer >= 1 (h=6 -> 3, h=12 -> 1). Without token splitting whole tokens are routed: 16."""
    return max(1, round(16 / heads)) if token_split else 16


def icml_moe_config(scale: str, heads: int, experts: int, reading: str = "paper") -> MoEConfig:
    """The ICML setting's FFN: X-MoE (``heads=1``) or MH-MoE (head/merge layers, parameter parity).

    ``reading="paper"``: the papers' text (routing dimension 16/h, temperature, bias-free experts).
    ``reading="code"``: the authors' code (``MoEConfig.xmoe_reading="code"``; docs/PAPERS.md): routing
    dimension 16 for every h (the MH-MoE code builds the gate with ``Linear(d/h, 16)``) and experts with
    biases (torchscale's ``FeedForwardNetwork`` uses ``nn.Linear``)."""
    if reading not in ("paper", "code"):
        raise ConfigError("reading", reading, "paper | code")
    d = SCALES[scale]["d_model"]
    common: dict[str, Any] = dict(router="xmoe", ffn="relu", top_k=2, n_experts=experts,
                                  router_dim=icml_router_dim(heads))
    if reading == "code":
        common.update(router_dim=16, xmoe_reading="code", expert_bias=True)
    if heads == 1:
        return MoEConfig(d_expert=4 * d, **common)
    p = plan(d, 4 * d, experts, 2, "relu", heads=heads, parity="params")
    return MoEConfig(d_expert=int(p.mhmoe.d_ff), heads=heads, head_layer=True, merge_layer=True, **common)


def _run(name: str, scale: str, moe: MoEConfig) -> RunConfig:
    return RunConfig(name=name, model=ModelConfig(vocab_size=8192, moe=moe, **SCALES[scale]),
                     train=TrainConfig(**TRAIN[scale].__dict__), data=DataConfig())


def bitnet_run(run: RunConfig, name: str | None = None) -> RunConfig:
    """``run`` quantized with BitNet b1.58 and the BitNet schedule defaults (see BITNET_TRAIN)."""
    moe = replace(run.model.moe, proj_bias=False, quant="bitnet158")  # the recipe: no biases
    model = replace(run.model, moe=moe, quant="bitnet158")
    train = replace(run.train, lr=run.train.lr * BITNET_LR_FACTOR, **BITNET_TRAIN)
    return RunConfig(name=name or f"{run.name}-bitnet", model=model, train=train, data=run.data)


# ---- ICML Table 1's multilingual and masked multi-modal settings (docs/ICML-SETTINGS.md) ---------------
# Dense / X-MoE / MH-MoE (h=4) as in the English setting (icml_moe_config), on other data:
# ``ml``: the causal decoder on Debian's translated man pages (13 languages), validated per language;
# ``mm``: the bidirectional encoder (model.arch=encoder) trained by masked-data modelling on emoji
# images (64 patches -> k-means codes), their Unicode names as captions, and KJV text.
MANPAGES_VAL_SETS = tuple(f"man-{c}" for c in ("en", "de", "fr", "es", "it", "pt-br", "nl", "pl", "cs", "ru", "uk",
                                                "ja", "zh"))  # = mhmoe.data.manpages.MANPAGES_VAL_SETS
# the paper's GPT-4 vocabulary at paper scale; at tiny scale a byte-level BPE trained on the training split
# (cl100k's 100k-row embedding and LM head would be most of the tiny model's compute; docs/ICML-SETTINGS.md)
ML_TOKENIZER: dict[str, dict[str, Any]] = {"paper": dict(tokenizer="cl100k_base"),
                                           "tiny": dict(tokenizer="bpe", vocab_size=16384)}
ML_VOCAB = {"paper": 100277, "tiny": 16384}
MM_SEQ_LEN = 64 + 16 + 3  # emoji: 8x8 patches + text_len 16 + [CLS] [SEP] [SEP]
MM_VOCAB = 257 + 256 + 4  # bytes + EOS, 256 visual codes, [PAD] [MASK] [CLS] [SEP]
MM_TRAIN = {
    # ICML Table 10 (multi-modality): batch 512, AdamW, peak lr 2.8e-3, cosine decay, 10k warm-up, wd 0.05;
    # steps: Fig. 8 shows 250k
    "paper": TrainConfig(max_steps=250_000, batch_size=64, seq_len=MM_SEQ_LEN, grad_accum=8, lr=2.8e-3,
                         warmup_steps=10_000, schedule="cosine", weight_decay=0.05, dtype="bfloat16",
                         eval_every=5000, ckpt_every=5000, eval_batches=64),
    "tiny": TrainConfig(max_steps=200, batch_size=32, seq_len=MM_SEQ_LEN, lr=2e-3, warmup_steps=20, min_lr_ratio=0.1,
                        schedule="cosine", weight_decay=0.05, dtype="float32", log_every=10, eval_every=0,
                        ckpt_every=100, eval_batches=64),
}


def icml_setting_run(scale: str, setting: str, heads: int, experts: int) -> RunConfig:
    """ICML Table 1's ``ml`` (multilingual LM) or ``mm`` (masked multi-modal) setting: Dense
    (``experts=0``), X-MoE (``heads=1``) or MH-MoE (``heads=4``) at the English setting's sizes."""
    kind = "dense" if experts == 0 else f"xmoe-{experts}" if heads == 1 else f"mh{heads}-{experts}"
    if experts == 0:
        moe = moe_config(scale, "dense")
    else:  # X-MoE's renormalised top-2 combine weights; ICML Table 9's routing dimension: 16, 16/h for MH-MoE
        moe = replace(icml_moe_config(scale, heads, experts), renormalize=True, router_dim=max(1, round(16 / heads)))
    if setting == "ml":
        data = DataConfig(corpus="manpages", val_sets=MANPAGES_VAL_SETS, **ML_TOKENIZER[scale])
        model = ModelConfig(vocab_size=ML_VOCAB[scale], moe=moe, **SCALES[scale])
        return RunConfig(name=f"{scale}-icml-ml-{kind}", model=model,
                         train=TrainConfig(**TRAIN[scale].__dict__), data=data)
    dims = {**SCALES[scale], "max_seq_len": 128}
    data = DataConfig(task="masked_mm", corpus="kjv", tokenizer="byte", image_set="emoji", text_len=16, val_sets=())
    model = ModelConfig(arch="encoder", vocab_size=MM_VOCAB, moe=moe, **dims)
    return RunConfig(name=f"{scale}-icml-mm-{kind}", model=model,
                     train=TrainConfig(**MM_TRAIN[scale].__dict__), data=data)


def _registry() -> dict[str, Callable[[], RunConfig]]:
    reg: dict[str, Callable[..., RunConfig]] = {}  # lambdas with defaults: called without arguments
    for scale in SCALES:
        for v in VARIANTS:
            reg[f"{scale}-{v}"] = lambda s=scale, v=v: _run(f"{s}-{v}", s, moe_config(s, v))
            if v != "dense":
                reg[f"{scale}-{v}-shared"] = lambda s=scale, v=v: _run(f"{s}-{v}-shared", s, moe_config(s, v, True))
        for v in VARIANTS:
            reg[f"{scale}-{v}-bitnet"] = lambda s=scale, v=v: bitnet_run(_run(f"{s}-{v}", s, moe_config(s, v)))
        for e in (8, 32):
            reg[f"{scale}-icml-xmoe-{e}"] = lambda s=scale, e=e: _run(f"{s}-icml-xmoe-{e}", s, icml_moe_config(s, 1, e))
            reg[f"{scale}-icml-mh4-{e}"] = lambda s=scale, e=e: _run(f"{s}-icml-mh4-{e}", s, icml_moe_config(s, 4, e))
            for h, v in ((1, "xmoe"), (4, "mh4")):  # the authors' code reading (docs/PAPERS.md)
                reg[f"{scale}-icml-{v}-{e}-code"] = lambda s=scale, e=e, h=h, v=v: _run(
                    f"{s}-icml-{v}-{e}-code", s, icml_moe_config(s, h, e, "code"))
        for setting in ("ml", "mm"):
            reg[f"{scale}-icml-{setting}-dense"] = lambda s=scale, t=setting: icml_setting_run(s, t, 1, 0)
            for e in (8, 32):
                reg[f"{scale}-icml-{setting}-xmoe-{e}"] = lambda s=scale, t=setting, e=e: icml_setting_run(s, t, 1, e)
                reg[f"{scale}-icml-{setting}-mh4-{e}"] = lambda s=scale, t=setting, e=e: icml_setting_run(s, t, 4, e)
    # the short names for the paper scale
    for e in (8, 32):
        reg[f"icml-xmoe-{e}"] = reg[f"paper-icml-xmoe-{e}"]
        reg[f"icml-mh4-{e}"] = reg[f"paper-icml-mh4-{e}"]
    for name in [n for n in reg if n.startswith(("paper-icml-ml-", "paper-icml-mm-"))]:
        reg[name.removeprefix("paper-")] = reg[name]
    return reg


PRESETS = _registry()


def preset_names() -> list[str]:
    return list(PRESETS)


def get_preset(name: str) -> RunConfig:
    """The run configuration of preset ``name``; an unknown name raises ConfigError with the closest one."""
    if name not in PRESETS:
        raise ConfigError("preset", name, f"one of the {len(PRESETS)} presets (`mhmoe presets` lists them)",
                          did_you_mean(name, PRESETS))
    return PRESETS[name]()
