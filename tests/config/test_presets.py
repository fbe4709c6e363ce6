"""Run configs and presets: validation errors name the dotted field, YAML round trips, ``--set``
parsing, and every MoE preset at FLOPs/parameter parity (within 1%) with its SMoE baseline, measured
on the built layers (parameters; FlopCounterMode at tiny scale) and with the planner's counts."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mhmoe.cli import main
from mhmoe.config.data import DataConfig
from mhmoe.config.model import ModelConfig
from mhmoe.config.moe import MoEConfig
from mhmoe.config.planner import count_layer
from mhmoe.config.presets import get_preset, preset_names
from mhmoe.config.run import RunConfig
from mhmoe.config.train import TrainConfig
from mhmoe.errors import ConfigError
from mhmoe.model.lm import LM
from mhmoe.moe.layers import build_ffn_layer
from mhmoe.train.evaluate import forward_flops_per_token

MHMOE = MoEConfig(n_experts=6, top_k=3, d_expert=16, heads=3, head_layer=True, merge_layer=True)



def base_run() -> RunConfig:
    return RunConfig(
        name="tiny-test",
        model=ModelConfig(vocab_size=0, d_model=48, n_layers=2, n_heads=4, d_ff=64, max_seq_len=64, moe=MHMOE),
        train=TrainConfig(max_steps=6, batch_size=4, seq_len=32),
        data=DataConfig(corpus="corpus.txt", tokenizer="byte", val_sets=(), val_tokens=512),
    )


# ---- validation --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "override, field",
    [
        ("train.lr=-1", "train.lr"),
        ("train.lr=0", "train.lr"),
        ("train.lr=abc", "train.lr"),
        ("train.lr=[1", "train.lr"),  # unparsable YAML
        ("train.lrr=1e-3", "train.lrr"),
        ("train.max_steps=0", "train.max_steps"),
        ("train.max_steps=abc", "train.max_steps"),
        ("train.batch_size=2.5", "train.batch_size"),
        ("train.seq_len=128", "train.seq_len"),  # > model.max_seq_len
        ("train.schedule=exponential", "train.schedule"),
        ("train.dtype=float64", "train.dtype"),
        ("train.device=tpu", "train.device"),
        ("train.min_lr_ratio=2", "train.min_lr_ratio"),
        ("train.compile=maybe", "train.compile"),
        ("model.n_heads=5", "model.n_heads"),
        ("model.n_heads=16", "model.n_heads"),  # divides 48 but gives an odd head dim (RoPE)
        ("model.n_layers=0", "model.n_layers"),
        ("model.nlayers=2", "model.nlayers"),
        ("model.tie_embeddings=maybe", "model.tie_embeddings"),
        ("model.moe.top_k=99", "model.moe.top_k"),
        ("model.moe.heads=5", "model.moe.heads"),
        ("model.moe.router=hash", "model.moe.router"),
        ("model.moe.capacity_factor=0", "model.moe.capacity_factor"),
        ("model.moe.n_expert=4", "model.moe.n_expert"),
        ("data.tokenizer=sentencepiece", "data.tokenizer"),
        ("data.val_tokens=0", "data.val_tokens"),
        ("data.corpuss=kjv", "data.corpuss"),
        ("optim.lr=1", "optim.lr"),
    ],
)
def test_invalid_override_names_the_field(override, field):
    with pytest.raises(ConfigError) as info:
        base_run().with_overrides([override])
    assert info.value.field == field
    msg = str(info.value)
    assert field in msg and "allowed" in msg and "\n" not in msg


def test_set_without_equals_sign():
    with pytest.raises(ConfigError, match="key=value") as info:
        base_run().with_overrides(["train.lr"])
    assert info.value.field == "--set"


def test_from_dict_rejects_unknown_sections_and_non_mappings():
    with pytest.raises(ConfigError) as info:
        RunConfig.from_dict({"model": {}, "optim": {}})
    assert info.value.field == "optim"
    with pytest.raises(ConfigError):
        RunConfig.from_yaml("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="YAML"):
        RunConfig.from_yaml("model: [\n")
    with pytest.raises(ConfigError) as info:
        RunConfig.from_yaml("train: 3\n")
    assert info.value.field == "train"


def test_overrides_parse_yaml_scalars():
    base = base_run()
    run = base.with_overrides(["train.lr=1e-3", "train.max_steps=20", "train.schedule=cosine",
                               "model.moe.capacity_factor=1.25", "train.grad_clip=0", "data.val_sets=[kjv, pydocs]",
                               "train.compile=false", "model.moe.top_k=2"])
    assert run.train.lr == 1e-3 and isinstance(run.train.lr, float)
    assert run.train.max_steps == 20 and isinstance(run.train.max_steps, int)
    assert run.train.schedule == "cosine" and run.train.compile is False
    assert run.model.moe.capacity_factor == 1.25 and run.model.moe.top_k == 2
    assert run.train.grad_clip == 0.0 and isinstance(run.train.grad_clip, float)
    assert run.data.val_sets == ("kjv", "pydocs")
    assert base.train.lr == 5e-4 and base.model.moe.top_k == 3  # the original is untouched
    assert run.with_overrides(["model.moe.capacity_factor=null"]).model.moe.capacity_factor is None
    assert run.with_overrides(["train.lr=2"]).train.lr == 2.0


def test_yaml_floats_without_a_dot_are_floats():
    """YAML 1.1 reads ``1e-3`` as a string; the config still gets a float."""
    run = RunConfig.from_yaml("train:\n  lr: 1e-3\n  eps: 1e-8\n  seq_len: 32\nmodel:\n  max_seq_len: 64\n")
    assert run.train.lr == 1e-3 and run.train.eps == 1e-8


# ---- YAML round trips ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", preset_names())
def test_every_preset_round_trips_through_yaml(name, tmp_path):
    p = get_preset(name)
    assert RunConfig.from_yaml(p.to_yaml()) == p
    assert RunConfig.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    (tmp_path / "p.yaml").write_text(p.to_yaml())
    assert RunConfig.load(tmp_path / "p.yaml") == p
    assert p.with_overrides([]) == p


def test_custom_config_round_trips():
    r = base_run().with_overrides(["model.moe.capacity_factor=1.5", "train.lr=3e-4", "data.val_sets=[kjv]"])
    assert RunConfig.from_yaml(r.to_yaml()) == r


def test_preset_names_and_aliases():
    names = preset_names()
    assert len(names) == len(set(names))
    for scale in ("tiny", "paper"):
        for v in ("dense", "smoe", "smoe-shared", "fgmoe", "fgmoe-shared", "mh2", "mh2-shared", "mh3", "mh3-shared",
                  "icml-xmoe-8", "icml-mh4-8", "icml-xmoe-32", "icml-mh4-32"):
            assert f"{scale}-{v}" in names
            assert get_preset(f"{scale}-{v}").name == f"{scale}-{v}"
    for short in ("icml-xmoe-8", "icml-mh4-8", "icml-xmoe-32", "icml-mh4-32"):
        assert get_preset(short) == get_preset(f"paper-{short}")
    with pytest.raises(ConfigError) as info:
        get_preset("tiny-mh9")
    assert info.value.field == "preset" and "tiny-mh3" in str(info.value)


def test_mh_presets_follow_the_papers():
    for scale in ("tiny", "paper"):
        for h in (2, 3):
            moe = get_preset(f"{scale}-mh{h}").model.moe
            assert moe.heads == h and moe.top_k == h and moe.head_layer and moe.merge_layer  # v2: top-k = h
        icml = get_preset(f"{scale}-icml-mh4-8").model.moe
        assert icml.heads == 4 and icml.top_k == 2 and icml.router == "xmoe" and icml.ffn == "relu"
        assert get_preset(f"{scale}-smoe").model.moe.top_k == 1


# ---- parity with the SMoE baseline --------------------------------------------------------------------------
MOE_PRESETS = [n for n in preset_names() if n.split("-")[0] in ("tiny", "paper")
               and get_preset(n).model.moe.kind == "moe"]
# the *-bitnet presets are these models quantized (tests/quant/test_bitnet.py checks they match them); the
# *-icml-ml-* / *-icml-mm-* presets have the *-icml-* layers (tests/config/test_settings_presets.py)
COMPARED = [n for n in MOE_PRESETS if not n.endswith(("-smoe", "-smoe-shared", "-bitnet")) and "-icml-xmoe-" not in n
            and "-icml-ml-" not in n and "-icml-mm-" not in n]


def baseline_of(name: str) -> str:
    scale, rest = name.split("-", 1)
    if rest.startswith("icml-mh4-"):  # icml-mh4-E[-code] -> icml-xmoe-E[-code]
        return f"{scale}-{rest.replace('-mh4-', '-xmoe-')}"
    return f"{scale}-smoe-shared" if rest.endswith("-shared") else f"{scale}-smoe"


def layer_params(name: str) -> int:
    """Parameters of one MoE layer of the preset, router excluded (built on the meta device)."""
    m = get_preset(name).model
    with torch.device("meta"):
        layer = build_ffn_layer(m.d_model, m.moe)
    return sum(p.numel() for n, p in layer.named_parameters() if ".router." not in f".{n}")


def layer_flops_per_token(name: str, tokens: int = 64) -> float:
    """Measured matmul FLOPs per token of one MoE layer, router excluded (FlopCounterMode)."""
    m = get_preset(name).model
    layer = build_ffn_layer(m.d_model, m.moe).eval()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        layer(torch.randn(tokens, m.d_model))
    router = sum(sum(v.values()) for k, v in counter.get_flop_counts().items() if k.endswith(".router"))
    return (counter.get_total_flops() - router) / tokens


def planner_count(name: str):
    m = get_preset(name).model
    moe = m.moe
    mats = moe.mlp_layers * (int(moe.head_layer) + int(moe.merge_layer))
    return count_layer(m.d_model, moe.d_expert, moe.n_experts, moe.top_k, moe.ffn, heads=moe.heads,
                       head_merge_mats=mats, shared=moe.n_shared, d_shared=moe.shared_width)


def test_parity_cases_cover_every_moe_preset():
    assert len(COMPARED) == 2 * 10  # per scale: fgmoe, mh2, mh3 (+ shared each), icml-mh4-8/32 (+ -code each)
    assert {baseline_of(n) for n in COMPARED} <= set(MOE_PRESETS)


@pytest.mark.parametrize("name", COMPARED)
def test_moe_preset_params_within_1pct_of_baseline(name):
    ours, base = layer_params(name), layer_params(baseline_of(name))
    assert abs(ours / base - 1) < 0.01, f"{name}: {ours:,} vs {baseline_of(name)}: {base:,}"
    # the built layer matches the planner's count (which leaves out the head/merge and expert biases)
    m = get_preset(name).model
    hm_bias = m.d_model * int(m.moe.head_layer) + m.d_model * int(m.moe.merge_layer)
    expert_bias = m.moe.n_experts * (m.moe.d_expert + m.d_model // m.moe.heads) if m.moe.expert_bias else 0
    assert ours == planner_count(name).params + hm_bias * m.moe.mlp_layers + expert_bias


@pytest.mark.parametrize("name", COMPARED)
def test_moe_preset_flops_within_1pct_of_baseline(name):
    ours, base = planner_count(name).flops_per_token, planner_count(baseline_of(name)).flops_per_token
    if "-icml-mh4-" in name:
        # ICML setting: parameter parity only -- the wider experts cost ~h x the FLOPs (by design)
        assert ours / base > 2
        return
    assert abs(ours / base - 1) < 0.01, f"{name}: {ours:,.0f} vs {base:,.0f}"


@pytest.mark.parametrize("name", [n for n in COMPARED if n.startswith("tiny-") and "-icml-" not in n])
def test_tiny_preset_measured_flops_within_1pct_of_baseline(name):
    ours, base = layer_flops_per_token(name), layer_flops_per_token(baseline_of(name))
    assert abs(ours / base - 1) < 0.01, f"{name}: {ours:,.0f} vs {base:,.0f}"


def test_dense_preset_matches_smoe_active_flops():
    """The dense baseline's FFN costs what one top-1 SMoE expert costs (same width d_ff)."""
    for scale in ("tiny", "paper"):
        dense, smoe = get_preset(f"{scale}-dense").model, get_preset(f"{scale}-smoe").model
        assert dense.moe.kind == "dense" and dense.moe.d_expert == smoe.moe.d_expert == smoe.d_ff
    assert layer_flops_per_token("tiny-dense") == layer_flops_per_token("tiny-smoe")


def test_tiny_models_whole_forward_flops_match():
    """Measured forward FLOPs/token of the whole tiny models (attention, routers, LM head included)."""
    torch.manual_seed(0)
    seq = 64
    flops = {}
    for name in ("tiny-dense", "tiny-smoe", "tiny-fgmoe", "tiny-mh2", "tiny-mh3"):
        run = get_preset(name).with_overrides([f"model.max_seq_len={seq}", f"train.seq_len={seq}"])
        flops[name] = forward_flops_per_token(LM(run.model), seq)
    for name, f in flops.items():
        assert abs(f / flops["tiny-smoe"] - 1) < 0.01, (name, f, flops["tiny-smoe"])


# ---- the presets subcommand ------------------------------------------------------------------------------------
def test_presets_command_lists_all(capsys):
    assert main(["presets"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in lines] == preset_names()
    assert main(["presets", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == preset_names()
    mh3 = next(r for r in rows if r["name"] == "tiny-mh3")
    assert mh3["d_model"] == 192 and "h=3" in mh3["ffn"] and "top-3" in mh3["ffn"]


@pytest.mark.parametrize("name", ["tiny-mh3", "tiny-dense", "paper-icml-mh4-32"])
def test_presets_show_prints_loadable_yaml(name, capsys):
    assert main(["presets", "--show", name]) == 0
    assert RunConfig.from_yaml(capsys.readouterr().out) == get_preset(name)
    assert main(["presets", "--show", name, "--json"]) == 0
    assert RunConfig.from_dict(json.loads(capsys.readouterr().out)) == get_preset(name)


def test_presets_show_unknown(capsys):
    assert main(["presets", "--show", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "preset" in err and "`mhmoe presets` lists them" in err
    assert main(["presets", "--show", "tiny-mh33"]) == 2  # a typo: the closest name, not all 70
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did you mean tiny-mh3?" in err and "paper-dense" not in err
