import pytest

from mhmoe.config.moe import MoEConfig
from mhmoe.errors import ConfigError
from mhmoe.moe.layers import build_ffn_layer


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(top_k=9, n_experts=8), "top_k"),
        (dict(top_k=0), "top_k"),
        (dict(n_experts=0, top_k=1), "n_experts"),
        (dict(capacity_factor=0.0), "capacity_factor"),
        (dict(eval_capacity_factor=-1.0), "eval_capacity_factor"),
        (dict(router="hash"), "router"),
        (dict(ffn="gelu"), "ffn"),
        (dict(residual="post"), "residual"),
        (dict(mlp_layers=4), "mlp_layers"),
        (dict(heads=0), "heads"),
        (dict(kind="sparse"), "kind"),
        (dict(impl="cuda"), "impl"),
        (dict(balance_loss_weight=-1.0), "balance_loss_weight"),
    ],
)
def test_invalid_config_names_field(kwargs, field):
    with pytest.raises(ValueError) as info:
        MoEConfig(**kwargs)
    assert isinstance(info.value, ConfigError)
    assert info.value.field == field
    assert "allowed" in str(info.value) and "\n" not in str(info.value)


def test_heads_must_divide_d_model():
    with pytest.raises(ConfigError, match="heads"):
        build_ffn_layer(64, MoEConfig(heads=3))


def test_from_dict_rejects_unknown_key_and_round_trips():
    cfg = MoEConfig(n_experts=4, top_k=2, heads=2, head_layer=True)
    assert MoEConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="moe.n_expert"):
        MoEConfig.from_dict({"n_expert": 3})


def test_wrong_input_shape_raises():
    layer = build_ffn_layer(32, MoEConfig(n_experts=4, d_expert=16, heads=2, head_layer=True))
    import torch

    with pytest.raises(ValueError, match="input shape"):
        layer(torch.randn(2, 3, 31))
    with pytest.raises(ValueError, match="input shape"):
        layer(torch.randn(32))
    with pytest.raises(ValueError, match="mask shape"):
        layer(torch.randn(2, 3, 32), torch.ones(2, 4, dtype=torch.bool))
