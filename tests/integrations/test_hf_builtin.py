"""`mhmoe export --hf --hf-arch builtin`: dense models as Llama, sparse MoE as Qwen2-MoE, loaded by transformers'
own classes (no remote code) with our logits and greedy tokens; what no built-in class represents is refused."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

import transformers  # noqa: E402
from ecosystem_helpers import tiny_checkpoint, tiny_config  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import mhmoe.integrations.hf.builtin as builtin  # noqa: E402
from mhmoe.cli import main  # noqa: E402
from mhmoe.config.moe import MoEConfig  # noqa: E402
from mhmoe.errors import ConfigError  # noqa: E402
from mhmoe.loading.checkpoint import load_checkpoint  # noqa: E402

# the options a built-in class represents, each where it changes the mapping
VARIANTS = {
    "dense": ("dense", {}, "LlamaForCausalLM"),
    "dense-untied-theta": ("dense", {"tie_embeddings": False, "rope_theta": 500.0}, "LlamaForCausalLM"),
    "dense-gqa": ("dense", {"n_kv_heads": 1}, "LlamaForCausalLM"),
    "dense-qk-norm": ("dense", {"qk_norm": True}, "Qwen3ForCausalLM"),
    "top1-raw-gate": ("smoe", {}, "Qwen2MoeForCausalLM"),  # Switch: the top-1 weight is the softmax probability
    "top1-gqa": ("smoe", {"n_kv_heads": 1}, "Qwen2MoeForCausalLM"),
    "top2-qk-norm-every-2nd": (MoEConfig(n_experts=4, top_k=2, d_expert=16), {"qk_norm": True, "moe_every": 2,
                                                                              "n_layers": 3}, "Qwen3MoeForCausalLM"),
    "top2-renormalised-every-2nd": (MoEConfig(n_experts=4, top_k=2, d_expert=16), {"moe_every": 2, "n_layers": 3},
                                    "Qwen2MoeForCausalLM"),
    "top2-raw-shared": (MoEConfig(n_experts=4, top_k=2, d_expert=16, renormalize=False, n_shared=2, d_shared=8),
                        {"tie_embeddings": False}, "Qwen2MoeForCausalLM"),
}


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
def test_builtin_export_loads_without_remote_code_and_reproduces_the_model(name, tmp_path, capsys):
    kind, over, cls = VARIANTS[name]
    if cls.startswith("Qwen3") and not hasattr(transformers, cls):
        pytest.skip(f"transformers {transformers.__version__} has no {cls} (4.51 or newer has)")
    ck = tiny_checkpoint(tmp_path / "run", kind, **over)
    out = tmp_path / "hf"
    assert main(["export", "--hf", "--hf-arch", "builtin", str(tmp_path / "run"), str(out), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["generate_matches"] and rep["max_abs_logit_diff"] < 1e-5
    config = json.loads((out / "config.json").read_text())
    assert "auto_map" not in config and config["architectures"] == [cls] and not list(out.glob("*.py"))
    with safe_open(str(out / "model.safetensors"), "pt") as f:  # the hub's layout: one tensor per expert
        keys = set(f.keys())
    assert ("lm_head.weight" in keys) == (not over.get("tie_embeddings", True))
    if cls.startswith("Qwen2"):
        assert "model.layers.0.mlp.experts.0.gate_proj.weight" in keys or over.get("moe_every") == 2
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model).__name__ == cls
    lm = load_checkpoint(ck).model.eval()
    x = torch.randint(0, 257, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, lm(x).logits, rtol=1e-5, atol=1e-5)


def test_the_hub_layout_of_shared_experts_and_dense_blocks():
    """The state dict itself (the exports above check what transformers computes from it): the shared expert's
    gate is zero and its down projection doubled; a dense block between MoE blocks is a plain MLP of width d_ff."""
    from mhmoe.model.lm import LM

    cfg = tiny_config(MoEConfig(n_experts=4, top_k=2, d_expert=16, n_shared=1, d_shared=24), moe_every=2)
    lm = LM(cfg).eval()
    sd = builtin.builtin_state_dict(lm)
    assert sd["model.layers.1.mlp.shared_expert_gate.weight"].abs().sum() == 0
    assert torch.equal(sd["model.layers.1.mlp.shared_expert.down_proj.weight"],
                       2 * lm.blocks[1].ffn.shared.ffn.experts.w2[0].t())
    assert sd["model.layers.0.mlp.down_proj.weight"].shape == (cfg.d_model, cfg.d_ff)
    assert not any(k.startswith("model.layers.0.mlp.experts") for k in sd)
    assert sd["model.layers.1.mlp.experts.3.up_proj.weight"].shape == (16, cfg.d_model)


@pytest.mark.parametrize("field,value", [
    ("heads", 2), ("router", "xmoe"), ("router", "sigmoid"), ("router", "noisy"), ("ffn", "relu"),
    ("expert_bias", True), ("eval_capacity_factor", 1.0), ("aux_free_bias", True), ("merge_layer", True),
])
def test_what_no_builtin_class_represents_is_refused_naming_the_field(field, value):
    cfg = tiny_config(MoEConfig(**{"n_experts": 4, "top_k": 2, "d_expert": 16, field: value}))
    with pytest.raises(ConfigError, match=f"model.moe.{field}="):
        builtin.builtin_arch(cfg)


def test_qk_norm_without_qwen3_in_transformers_is_refused_naming_the_field(monkeypatch):
    known = transformers.AutoConfig.for_model

    def before_qwen3(model_type, *args, **kwargs):  # what transformers < 4.51 says
        if model_type.startswith("qwen3"):
            raise ValueError(f"Unrecognized model identifier: {model_type}")
        return known(model_type, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoConfig, "for_model", before_qwen3)
    with pytest.raises(ConfigError, match="model.qk_norm=True"):
        builtin.builtin_config(tiny_config("dense", qk_norm=True), 256)


def test_qwen3_moe_has_no_shared_experts():
    cfg = tiny_config(MoEConfig(n_experts=4, top_k=2, d_expert=16, n_shared=1), qk_norm=True)
    with pytest.raises(ConfigError, match="model.moe.n_shared=1"):
        builtin.builtin_arch(cfg)


def test_cli_refuses_an_mh_moe_model_in_one_line_and_writes_nothing(tmp_path, capsys):
    tiny_checkpoint(tmp_path / "run", "mhmoe")
    assert main(["export", "--hf", "--hf-arch", "builtin", str(tmp_path / "run"), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.moe.heads=2" in err and "--hf-arch mhmoe" in err
    assert not (tmp_path / "hf").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert main(["export", "--bitnet", "--hf-arch", "builtin", str(tmp_path / "run"), str(tmp_path / "b")]) == 2
    assert "--hf-arch" in capsys.readouterr().err
