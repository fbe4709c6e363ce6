"""BitNet b1.58 quantization-aware training and packed export (docs/BITNET.md): ternary weights with
gamma per expert, 8-bit activations, STE gradients, every dispatch path against the loop oracle with
quantization on, full-precision router/embeddings, pack/unpack, packed inference, `mhmoe export`,
config validation, two-stage schedule with bit-exact resume, presets."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import oracle_pair

from mhmoe.cli import main
from mhmoe.config.data import DataConfig
from mhmoe.config.model import ModelConfig
from mhmoe.config.moe import MoEConfig
from mhmoe.config.presets import get_preset
from mhmoe.config.run import RunConfig
from mhmoe.config.train import TrainConfig
from mhmoe.errors import ConfigError
from mhmoe.integrations.bitnet_packed import (
    FILE_NAME,
    export_bitnet,
    load_packed,
    pack_ternary,
    read_metadata,
    unpack_ternary,
)
from mhmoe.model.lm import LM
from mhmoe.moe.dispatch import choose_impl
from mhmoe.moe.dispatch.sorted import sorted_moe
from mhmoe.moe.experts import GroupedExperts
from mhmoe.quant.bitnet import (
    BitLinear,
    absmean_gamma,
    activation_codes,
    activation_quant,
    quantized_weights,
    set_prequantized,
    weight_quant,
)
from mhmoe.train.loop import train
from mhmoe.train.optim import build_optimizer, lr_lambda, weight_decay_at

Q = "bitnet158"
WORDS = "in the beginning was the word and light dark water earth heaven man made said god day night".split()



def tiny_model_cfg(moe: MoEConfig, quant: str = Q, vocab: int = 64, **kw) -> ModelConfig:
    d = dict(vocab_size=vocab, d_model=48, n_layers=2, n_heads=4, d_ff=64, max_seq_len=64, moe=moe, quant=quant)
    d.update(kw)
    return ModelConfig(**d)


MHMOE = MoEConfig(n_experts=6, top_k=3, d_expert=16, heads=3, head_layer=True, merge_layer=True, n_shared=2,
                  d_shared=8)


# ---- weights ----------------------------------------------------------------------------------------------
def test_expert_weights_are_ternary_times_gamma_per_expert():
    ex = GroupedExperts(5, 12, 20, quant=Q)
    with torch.no_grad():  # give the experts clearly different scales
        for e in range(5):
            for w in (ex.w1, ex.w2, ex.w3):
                w[e] *= 1 + e
    w1, w2, w3, *_ = ex.effective_weights()
    for latent, q in ((ex.w1, w1), (ex.w2, w2), (ex.w3, w3)):
        gammas = []
        for e in range(5):
            g = latent[e].detach().abs().mean().clamp_min(1e-5)
            assert set(q[e].detach().unique().tolist()) <= {-float(g), 0.0, float(g)}
            assert torch.equal(q[e].detach().abs().unique(), torch.stack([torch.zeros(()), g]))  # both used
            gammas.append(float(g))
        assert len(set(gammas)) == 5  # one gamma per expert, not one over all experts
        assert absmean_gamma(latent, (1, 2)).flatten().tolist() == gammas


def test_weight_quant_matrix_dtype_and_rounding():
    w = torch.randn(7, 9, dtype=torch.bfloat16)
    q = weight_quant(w)
    assert q.dtype == torch.bfloat16 and q.shape == w.shape
    g = w.float().abs().mean()
    ref = (w.float() / g).round().clamp(-1, 1) * g
    assert torch.equal(q, ref.to(torch.bfloat16))
    assert float(absmean_gamma(torch.zeros(3, 3))) == pytest.approx(1e-5)  # clamped


def test_reduce_gamma_hook_gives_full_matrix_gamma_on_shards():
    w = torch.randn(4, 10, 6)
    shards = w.split([3, 7], dim=1)  # a tensor-parallel split inside every expert
    stats = [torch.stack([s.abs().sum((1, 2), keepdim=True), torch.full((4, 1, 1), float(s[0].numel()))])
             for s in shards]
    total = stats[0] + stats[1]
    for shard, part in zip(shards, weight_quant(w, (1, 2)).split([3, 7], dim=1), strict=True):
        got = weight_quant(shard, (1, 2), reduce_gamma=lambda t: total)  # the all-reduce, simulated
        torch.testing.assert_close(got, part, rtol=1e-6, atol=0)
    assert not torch.equal(weight_quant(shards[0], (1, 2)), weight_quant(w, (1, 2))[:, :3])  # local gamma differs


# ---- activations --------------------------------------------------------------------------------------------
def test_activations_are_int8_levels_per_token():
    x = torch.randn(6, 33) * torch.tensor([1e-3, 0.1, 1.0, 10.0, 1e3, 0.0])[:, None]
    q = activation_quant(x)
    codes, scale = activation_codes(x)
    assert scale.shape == (6, 1)
    level = q * scale
    torch.testing.assert_close(level, level.round(), rtol=0, atol=1e-3)
    assert level.round().min() >= -128 and level.round().max() <= 127
    assert torch.equal(codes, level.round())
    assert codes[:5].abs().amax(1).tolist() == [127.0] * 5  # absmax per row maps to 127
    assert torch.equal(q[5], torch.zeros(33))  # an all-zero row stays zero (clamped scale)
    torch.testing.assert_close(q[:5], x[:5], rtol=0, atol=float((x[:5].abs().amax(1) / 254).max()) * 1.001)


# ---- straight-through estimator -----------------------------------------------------------------------------------
def test_ste_gradients_are_identity_and_forward_is_exactly_quantized():
    w = torch.randn(3, 8, 5, requires_grad=True)
    g = torch.randn(3, 8, 5)
    q = weight_quant(w, (1, 2))
    (q * g).sum().backward()
    assert torch.equal(w.grad, g)  # d/dW sum(weight_quant(W) * G) == G
    with torch.no_grad():
        assert torch.equal(q, weight_quant(w, (1, 2)))  # value: exactly the quantized tensor
    x = torch.randn(4, 16, requires_grad=True)
    gx = torch.randn(4, 16)
    a = activation_quant(x)
    (a * gx).sum().backward()
    assert torch.equal(x.grad, gx)
    assert torch.equal(a.detach(), activation_quant(x.detach()))


def test_bitlinear_gradients_equal_the_full_precision_path_on_the_quantized_point():
    lin = BitLinear(16, 8)
    assert lin.bias is None
    x = torch.randn(5, 16, requires_grad=True)
    g = torch.randn(5, 8)
    (lin(x) * g).sum().backward()
    xq, wq = activation_quant(x.detach()), weight_quant(lin.weight.detach())
    xr, wr = xq.clone().requires_grad_(True), wq.clone().requires_grad_(True)
    (F.linear(xr, wr) * g).sum().backward()  # the full-precision layer evaluated at (xq, wq)
    torch.testing.assert_close(x.grad, xr.grad, rtol=0, atol=0)
    torch.testing.assert_close(lin.weight.grad, wr.grad, rtol=0, atol=0)


# ---- every dispatch path against the loop oracle, quantization on --------------------------------------------------


def _run(layer, x, mask):
    x = x.clone().requires_grad_(True)
    out = layer(x, mask)
    g = torch.randn_like(out.out, generator=torch.Generator().manual_seed(1))
    ((out.out * g).sum() + out.aux_loss).backward()
    return out, x.grad, {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("impl", ["padded", "sorted", "grouped_mm", "fused", "chunked"])
@pytest.mark.parametrize("ffn, heads, k, cf, shared", [("swiglu", 1, 2, None, 0), ("relu", 2, 2, 1.0, 1),
                                                       ("swiglu", 3, 3, None, 2)])
def test_dispatch_paths_match_loop_oracle_quantized(impl, ffn, heads, k, cf, shared):
    torch.manual_seed(heads * 10 + k)
    d_model = 16 * heads
    cfg = MoEConfig(n_experts=5, top_k=k, d_expert=16, ffn=ffn, capacity_factor=cf, heads=heads,
                    head_layer=heads > 1, merge_layer=heads > 1, n_shared=shared, d_shared=8, impl=impl,
                    expert_bias=ffn == "relu" and impl not in ("fused", "chunked"), z_loss_weight=1e-3, quant=Q)
    fast, ref = oracle_pair(d_model, cfg)
    x = torch.randn(2, 7, d_model)
    mask = torch.rand(2, 7) > 0.3
    mask[0, 0] = True
    o1, gx1, g1 = _run(fast, x, mask)
    o2, gx2, g2 = _run(ref, x, mask)
    close(o1.out, o2.out)
    close(gx1, gx2)
    assert g1.keys() == g2.keys() and any(n.endswith("experts.sub_norm") for n in g1)
    for name in g1:
        close(g1[name], g2[name], name)


def close(a, b, name=""):
    """Float-rounding agreement relative to the tensor's scale (the sub-norms divide by small RMS values
    at init, so weight gradients reach O(100) and single elements near 0 carry O(1e-6) noise)."""
    scale = max(1.0, float(b.detach().abs().max()))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * scale, msg=lambda m: f"{name}: {m}")


def test_fused_falls_back_to_sorted_when_quantized():
    ex = GroupedExperts(4, 8, 16, quant=Q)
    x = torch.randn(3, 8)
    assert choose_impl("fused", x, ex) is sorted_moe
    assert choose_impl("auto", x, ex) is sorted_moe  # on CPU
    assert choose_impl("fused", x, GroupedExperts(4, 8, 16)) is not sorted_moe


def test_quantized_expert_ffn_is_the_documented_row_recipe():
    """x -> act_quant -> W1/W3 (ternary) -> SwiGLU -> per-expert sub-norm -> act_quant -> W2 (ternary)."""
    ex = GroupedExperts(3, 8, 12, quant=Q)
    with torch.no_grad():
        ex.sub_norm.uniform_(0.5, 1.5)
    x = torch.randn(5, 8)
    e = 2
    wq = [weight_quant(w, (1, 2))[e] for w in (ex.w1, ex.w2, ex.w3)]
    xq = activation_quant(x)
    h = F.silu(xq @ wq[0]) * (xq @ wq[2])
    h = F.rms_norm(h, (12,), eps=1e-5) * ex.sub_norm[e]
    ref = activation_quant(h) @ wq[1]
    torch.testing.assert_close(ex.expert_forward(e, x), ref, rtol=0, atol=0)


# ---- what stays full precision ------------------------------------------------------------------------------------
def test_router_embeddings_lm_head_and_norms_stay_full_precision():
    moe = MoEConfig(n_experts=4, top_k=2, d_expert=16)
    model = LM(tiny_model_cfg(moe, moe_every=1, tie_embeddings=False))
    q = quantized_weights(model)
    assert model.cfg.moe.quant == Q and moe.quant == "none"  # set from model.quant, the shared config untouched
    for name in q:
        assert not any(s in name for s in ("embed", "lm_head", "router", "norm")), name
    assert {n.split(".", 2)[2] for n in q} == {"attn.qkv.weight", "attn.proj.weight", "ffn.experts.w1",
                                               "ffn.experts.w2", "ffn.experts.w3"}
    assert type(model.lm_head) is torch.nn.Linear and not isinstance(model.lm_head, BitLinear)
    assert model.embed.weight.unique().numel() > 100  # not ternary
    idx = torch.randint(0, 64, (2, 8))
    layer = model.blocks[0].ffn
    seen = []
    hook = layer.router.register_forward_hook(lambda m, args, out: seen.append(args[0].detach()))
    out = model(idx, return_routing=True)
    hook.remove()
    route = out.layer_outputs[0].route
    assert route.logits.dtype == torch.float32
    # the router reads unquantized inputs with its unquantized weight
    xs = seen[0]
    assert not torch.equal(activation_quant(xs), xs)
    torch.testing.assert_close(route.logits, xs.float() @ layer.router.weight.float().t(), rtol=0, atol=0)
    assert layer.router.weight.unique().numel() > 100


@pytest.mark.parametrize("moe", [MoEConfig(kind="dense", d_expert=64), MoEConfig(n_experts=4, top_k=1, d_expert=64),
                                 MoEConfig(n_experts=6, top_k=3, d_expert=16, heads=3, head_layer=True,
                                           merge_layer=True)], ids=["dense", "smoe", "mhmoe"])
def test_quantized_model_trains(moe):
    """QAT learns: 80 AdamW steps on one fixed batch take the loss from ~log(64) to < 0.25 nats."""
    model = LM(tiny_model_cfg(moe, moe_every=1))
    opt = build_optimizer(model, TrainConfig(lr=6e-3, weight_decay=0.0))
    x = torch.randint(0, 64, (4, 33))
    for _ in range(80):
        out = model(x[:, :-1], x[:, 1:])
        opt.zero_grad()
        out.total_loss.backward()
        opt.step()
    assert out.loss.item() < 0.25


def test_optimizer_does_not_decay_sub_norms():
    model = LM(tiny_model_cfg(MHMOE))
    opt = build_optimizer(model, TrainConfig(weight_decay=0.1))
    decayed = {id(p) for p in opt.param_groups[0]["params"]}
    for name, p in model.named_parameters():
        if "norm" in name:
            assert id(p) not in decayed, name
    assert any(n.endswith("experts.sub_norm") and p.dim() == 2 for n, p in model.named_parameters())


# ---- packing ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 13, 64, 1001])
def test_pack_unpack_round_trips_bit_exactly(n):
    codes = torch.randint(-1, 2, (3, n), dtype=torch.int8)
    packed = pack_ternary(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (3, (n + 3) // 4)
    assert torch.equal(unpack_ternary(packed, n), codes)


def test_pack_bit_order():
    # element 4j+i -> bits 2i..2i+1 of byte j, code + 1: [-1, 0, 1, 1] -> 0b10_10_01_00; [0] + pad -> 0b01_01_01_01
    packed = pack_ternary(torch.tensor([[-1, 0, 1, 1, 0]]))
    assert packed.tolist() == [[0b10100100, 0b01010101]]
    with pytest.raises(ValueError):
        pack_ternary(torch.tensor([[2]]))


# ---- packed inference -----------------------------------------------------------------------------------------
def _trained_like(model: LM) -> LM:
    """Perturb every parameter (norms, sub-norms, router, ...) so the check is not on the init values."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


@pytest.mark.parametrize("moe", [MHMOE, MoEConfig(n_experts=4, top_k=1, d_expert=32, n_shared=1, d_shared=16)],
                         ids=["mhmoe-shared", "smoe"])
def test_packed_inference_matches_the_fake_quantized_model(moe, tmp_path):
    model = _trained_like(LM(tiny_model_cfg(moe))).eval()
    report = export_bitnet(model, tmp_path)
    assert report.path == tmp_path / FILE_NAME and report.packed_bytes < report.fp32_bytes / 2
    meta = read_metadata(report.path)
    assert meta["code_map"] == {"0": -1, "1": 0, "2": 1} and "W = code * gamma" in meta["scale_convention"]
    assert set(meta["packed"]) == set(quantized_weights(model))
    assert meta["packed"]["blocks.1.ffn.moe.experts.w1" if moe.heads > 1 else "blocks.1.ffn.experts.w1"]["groups"] \
        == moe.n_experts
    packed = load_packed(tmp_path)
    assert all(m.prequantized for m in packed.modules() if hasattr(m, "prequantized"))
    for name, dims in quantized_weights(model).items():  # stored weights are the fake-quantized ones
        torch.testing.assert_close(packed.get_parameter(name), weight_quant(model.get_parameter(name), dims),
                                   rtol=0, atol=0)
    idx = torch.randint(0, 64, (2, 24))
    with torch.no_grad():
        ref, got = model(idx).logits, packed(idx).logits
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)  # the stated tolerance (observed: 0)
        set_prequantized(packed, False)  # re-quantizing ternary*gamma is not idempotent: gamma' = mean|W_q|
        assert not torch.allclose(packed(idx).logits, ref, atol=1e-3)


def test_export_refuses_a_full_precision_model(tmp_path):
    with pytest.raises(ConfigError) as info:
        export_bitnet(LM(tiny_model_cfg(MHMOE, quant="none")), tmp_path)
    assert info.value.field == "model.quant"


# ---- training + `mhmoe export --bitnet` ------------------------------------------------------------------------------
def tiny_run(tmp_path: Path, moe: MoEConfig = MHMOE, **train_kw) -> RunConfig:
    corpus = tmp_path / "corpus"
    if not corpus.exists():
        rng = random.Random(0)
        corpus.mkdir(parents=True)
        for i in range(12):
            (corpus / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(250)) + "\n")
    t = dict(max_steps=3, batch_size=4, seq_len=32, log_every=1, eval_batches=1, warmup_steps=1, lr=2e-3,
             dtype="float32", device="cpu", threads=1, weight_decay=0.1, wd_stage2=0.0, lr_stage2_ratio=0.5)
    t.update(train_kw)
    return RunConfig(name="tiny-bitnet-test", model=tiny_model_cfg(moe, vocab=0), train=TrainConfig(**t),
                     data=DataConfig(corpus=str(corpus), tokenizer="byte", val_sets=(), val_tokens=512,
                                     cache_dir=str(tmp_path / "cache")))


def test_export_cli_on_a_trained_checkpoint(tmp_path, capsys):
    run_dir = tmp_path / "run"
    res = train(tiny_run(tmp_path), run_dir, progress=False)
    assert res.step == 3
    out = tmp_path / "export"
    assert main(["export", "--bitnet", str(run_dir), str(out)]) == 0
    text = capsys.readouterr().out
    assert (out / FILE_NAME).is_file() and (out / "config.yaml").is_file() and (out / "tokenizer").is_dir()
    assert "bytes" in text and "x smaller" in text and "max |diff| = 0" in text
    out2 = tmp_path / "export2"  # a new folder: export never writes into a non-empty one
    assert main(["export", "--bitnet", str(run_dir), str(out2), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["packed_bytes"] == (out2 / FILE_NAME).stat().st_size < rep["fp32_bytes"]
    assert rep["max_abs_logit_diff"] <= 1e-5 and rep["step"] == 3
    assert main(["export", str(run_dir), str(out)]) == 2  # --bitnet is required for now
    assert "--bitnet" in capsys.readouterr().err


def test_two_stage_schedule_resumes_bit_exactly(tmp_path):
    """lr x0.5 and weight decay 0.1 -> 0 from step max_steps // 2; a run stopped before the switch
    and resumed after it matches the uninterrupted run bit for bit."""
    run = tiny_run(tmp_path, MoEConfig(n_experts=4, top_k=2, d_expert=16), max_steps=4, eval_batches=1)
    full, split = tmp_path / "full", tmp_path / "split"
    train(run, full, progress=False)
    train(run, split, progress=False, stop_after=1)
    train(run, split, resume=True, progress=False)
    recs = [[json.loads(ln) for ln in (d / "metrics.jsonl").read_text().splitlines()] for d in (full, split)]
    assert [r["loss"] for r in recs[0]] == [r["loss"] for r in recs[1]]
    assert [r["lr"] for r in recs[0]] == [r["lr"] for r in recs[1]]
    from mhmoe.loading.checkpoint import load_latest

    a, b = load_latest(full).model.state_dict(), load_latest(split).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_schedule_functions():
    cfg = TrainConfig(max_steps=10, warmup_steps=0, schedule="constant", lr_stage2_ratio=0.5, weight_decay=0.1,
                      wd_stage2=0.0)
    f = lr_lambda(cfg)
    assert [f(s) for s in range(10)] == [1.0] * 5 + [0.5] * 5
    assert [weight_decay_at(cfg, s) for s in (0, 4, 5, 9)] == [0.1, 0.1, 0.0, 0.0]
    plain = TrainConfig(max_steps=10, warmup_steps=2)
    assert weight_decay_at(plain, 9) == plain.weight_decay
    assert [lr_lambda(plain)(s) for s in range(10)] == [
        lr_lambda(TrainConfig(max_steps=10, warmup_steps=2, lr_stage2_ratio=1.0))(s) for s in range(10)]


# ---- config -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("override, field", [("model.quant=int4", "model.quant"),
                                             ("model.moe.quant=int4", "model.moe.quant"),
                                             ("train.lr_stage2_ratio=0", "train.lr_stage2_ratio"),
                                             ("train.wd_stage2=-1", "train.wd_stage2")])
def test_config_validation_names_the_field(override, field):
    with pytest.raises(ConfigError) as info:
        get_preset("tiny-mh3").with_overrides([override])
    assert info.value.field == field
    if "quant" in field:
        assert "bitnet158" in str(info.value)


def test_quant_override_round_trips_and_model_quant_is_authoritative():
    run = get_preset("tiny-smoe").with_overrides(["model.quant=bitnet158"])
    assert run.model.quant == run.model.moe.quant == Q
    assert RunConfig.from_yaml(run.to_yaml()) == run
    off = get_preset("tiny-smoe-bitnet").with_overrides(["model.quant=none"])
    assert off.model.moe.quant == "none"


@pytest.mark.parametrize("variant", ["dense", "smoe", "fgmoe", "mh2", "mh3"])
def test_bitnet_presets_are_the_full_precision_models_quantized(variant):
    fp, bn = get_preset(f"tiny-{variant}"), get_preset(f"tiny-{variant}-bitnet")
    assert bn.name == f"tiny-{variant}-bitnet" and bn.model.quant == bn.model.moe.quant == Q
    assert bn.train.lr == 2 * fp.train.lr and bn.train.lr_stage2_ratio == 0.5
    assert (bn.train.weight_decay, bn.train.wd_stage2) == (0.1, 0.0)
    same = lambda m: {k: v for k, v in m.to_dict().items() if k not in ("quant", "proj_bias")}  # noqa: E731
    assert same(bn.model.moe) == same(fp.model.moe) and not bn.model.moe.proj_bias
    assert get_preset(f"paper-{variant}-bitnet").train.lr == 2 * get_preset(f"paper-{variant}").train.lr
