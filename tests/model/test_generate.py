"""Generation: KV-cache decoding equals full-sequence recomputation, greedy decoding equals argmax
without the cache, EOS handling, and top-k / top-p filtering."""

from __future__ import annotations

import math

import pytest
import torch

from mhmoe.config.model import ModelConfig
from mhmoe.config.moe import MoEConfig
from mhmoe.model.generate import filter_logits, generate, scaled_logits
from mhmoe.model.lm import LM, KVCache

V = 97
CONFIGS = {
    "dense": MoEConfig(kind="dense", d_expert=64),
    "smoe": MoEConfig(n_experts=4, top_k=2, d_expert=32),
    "mhmoe": MoEConfig(n_experts=6, top_k=3, d_expert=16, heads=3, head_layer=True, merge_layer=True),
    "xmoe-mh-shared": MoEConfig(n_experts=4, top_k=2, d_expert=16, heads=2, head_layer=True, merge_layer=True,
                                router="xmoe", ffn="relu", n_shared=1, d_shared=16),
}



def make_model(moe: MoEConfig, max_seq_len: int = 48) -> LM:
    torch.manual_seed(0)
    model = LM(ModelConfig(vocab_size=V, d_model=48, n_layers=2, n_heads=4, d_ff=64, max_seq_len=max_seq_len,
                           moe_every=1, moe=moe, init_std=0.1))
    return model.eval()


def argmax_decode(model: LM, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy decoding by recomputing the whole sequence every step (no cache)."""
    seq = prompt
    with torch.no_grad():
        for _ in range(n):
            nxt = model(seq).logits[:, -1].argmax(-1)
            seq = torch.cat([seq, nxt[:, None]], 1)
    return seq


# ---- KV cache ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CONFIGS))
def test_incremental_logits_equal_full_sequence(name):
    model = make_model(CONFIGS[name])
    idx = torch.randint(0, V, (2, 24))
    with torch.no_grad():
        full = model(idx).logits
        for chunks in ([7] + [1] * 17, [5, 6, 1, 4, 8], [24], [1] * 24):
            cache = KVCache(model.cfg.n_layers)
            parts, start = [], 0
            for n in chunks:
                parts.append(model(idx[:, start:start + n], cache=cache).logits)
                start += n
            assert start == 24 and cache.length == 24
            inc = torch.cat(parts, 1)
            torch.testing.assert_close(inc, full, atol=1e-5, rtol=0, msg=f"{name}, chunks {chunks}")


def test_cache_respects_max_seq_len():
    model = make_model(CONFIGS["mhmoe"], max_seq_len=16)
    cache = KVCache(model.cfg.n_layers)
    with torch.no_grad():
        model(torch.zeros(1, 10, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match="max_seq_len"):
            model(torch.zeros(1, 7, dtype=torch.long), cache=cache)


# ---- generate ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_generate_equals_argmax_without_cache(name):
    model = make_model(CONFIGS[name])
    prompt = torch.randint(0, V, (3, 5))
    out = generate(model, prompt, max_new_tokens=12, temperature=0.0)
    assert out.shape == (3, 17) and torch.equal(out[:, :5], prompt)
    assert torch.equal(out, argmax_decode(model, prompt, 12))


def test_top_k_one_sampling_is_greedy():
    model = make_model(CONFIGS["mhmoe"])
    prompt = torch.randint(0, V, (2, 4))
    g = torch.Generator().manual_seed(1)
    sampled = generate(model, prompt, 10, temperature=1.3, top_k=1, generator=g)
    assert torch.equal(sampled, generate(model, prompt, 10, temperature=0.0))


def test_sampling_is_reproducible_with_a_generator():
    model = make_model(CONFIGS["smoe"])
    prompt = torch.randint(0, V, (2, 4))
    a = generate(model, prompt, 15, temperature=1.0, top_k=20, top_p=0.9, generator=torch.Generator().manual_seed(3))
    b = generate(model, prompt, 15, temperature=1.0, top_k=20, top_p=0.9, generator=torch.Generator().manual_seed(3))
    c = generate(model, prompt, 15, temperature=1.0, top_k=20, top_p=0.9, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_eos_stops_early():
    model = make_model(CONFIGS["dense"])
    prompt = torch.randint(0, V, (1, 4))
    greedy = generate(model, prompt, 8, temperature=0.0)
    eos = int(greedy[0, 6])  # the 3rd generated token
    out = generate(model, prompt, 8, temperature=0.0, eos_id=eos)
    first = (greedy[0, 4:] == eos).nonzero()[0].item()  # it may occur earlier
    assert out.shape[1] == 4 + first + 1 and int(out[0, -1]) == eos
    assert torch.equal(out, greedy[:, : out.shape[1]])


def test_eos_waits_for_every_row():
    model = make_model(CONFIGS["dense"])
    prompt = torch.randint(0, V, (2, 4))
    greedy = generate(model, prompt, 6, temperature=0.0)
    eos = int(greedy[0, 4])  # row 0 ends at once; row 1 (very likely) does not
    out = generate(model, prompt, 6, temperature=0.0, eos_id=eos)
    assert not bool((greedy[1, 4:] == eos).any())  # (true for this seed)
    assert torch.equal(out, greedy)  # row 0 hit EOS at once, decoding went on for row 1


def test_generate_rejects_bad_shapes_and_lengths():
    model = make_model(CONFIGS["dense"], max_seq_len=16)
    with pytest.raises(ValueError, match="prompt shape"):
        generate(model, torch.zeros(5, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="prompt shape"):
        generate(model, torch.zeros(1, 0, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(model, torch.zeros(1, 10, dtype=torch.long), 7)
    assert generate(model, torch.zeros(1, 10, dtype=torch.long), 6, temperature=0.0).shape == (1, 16)


# ---- filtering ------------------------------------------------------------------------------------------------
PROBS = torch.tensor([0.05, 0.5, 0.1, 0.2, 0.15])  # order by probability: 1, 3, 4, 2, 0


def kept(logits: torch.Tensor) -> set[int]:
    return set(torch.isfinite(logits).nonzero().flatten().tolist())


@pytest.mark.parametrize("k, expected", [(1, {1}), (2, {1, 3}), (3, {1, 3, 4}), (5, {0, 1, 2, 3, 4}),
                                         (50, {0, 1, 2, 3, 4}), (0, {0, 1, 2, 3, 4})])
def test_top_k_keeps_the_k_largest(k, expected):
    logits = PROBS.log()[None]
    out = filter_logits(logits, top_k=k)
    assert kept(out[0]) == expected
    assert torch.equal(out[torch.isfinite(out)], logits[torch.isfinite(out)])  # kept logits unchanged


@pytest.mark.parametrize("p, expected", [(0.3, {1}), (0.6, {1, 3}), (0.8, {1, 3, 4}), (0.9, {1, 3, 4, 2}),
                                         (0.99, {0, 1, 2, 3, 4}), (1.0, {0, 1, 2, 3, 4}), (1e-6, {1})])
def test_top_p_keeps_the_smallest_nucleus(p, expected):
    """Smallest set of most probable tokens whose probability reaches p (the top token always)."""
    out = filter_logits(PROBS.log()[None], top_p=p)
    assert kept(out[0]) == expected


def test_top_k_and_top_p_combine_per_row():
    logits = torch.stack([PROBS.log(), PROBS.flip(0).log()])
    out = filter_logits(logits, top_k=3, top_p=0.6)
    assert kept(out[0]) == {1, 3}
    assert kept(out[1]) == {3, 1}  # flipped: 0.5 at index 3, 0.2 at index 1
    assert kept(filter_logits(logits, top_k=1, top_p=0.9)[1]) == {3}  # top-k first, then top-p
    # renormalised probabilities after filtering
    probs = out.softmax(-1)
    assert torch.allclose(probs[0, [1, 3]], torch.tensor([0.5, 0.2]) / 0.7)


def test_filtered_sampling_never_leaves_the_allowed_set():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g) * 3
    for top_k, top_p in ((5, 1.0), (0, 0.5), (10, 0.8)):
        out = filter_logits(logits, top_k, top_p)
        draws = torch.multinomial(out.softmax(-1), 2000, replacement=True, generator=g)
        for row in range(4):
            assert set(draws[row].tolist()) <= kept(out[row])
        if top_k:
            assert all(len(kept(r)) <= top_k for r in out)
        if top_p < 1:
            p = logits.softmax(-1)
            for row in range(4):
                idx = sorted(kept(out[row]), key=lambda i: -p[row, i].item())
                mass = p[row, idx].sum().item()
                assert mass >= min(top_p, 1.0) - 1e-6 or top_k  # the nucleus reaches p
                if not top_k:  # and is minimal: without its least likely token it falls short of p
                    assert p[row, idx[:-1]].sum().item() < top_p


def test_temperature_sharpens():
    torch.manual_seed(0)
    model = make_model(CONFIGS["dense"])
    prompt = torch.randint(0, V, (64, 3))
    g = torch.Generator().manual_seed(0)
    greedy = generate(model, prompt, 1, temperature=0.0)[:, -1]
    cold = generate(model, prompt, 1, temperature=1e-4, generator=g)[:, -1]
    assert torch.equal(cold, greedy)
    assert math.isfinite(float(filter_logits(torch.randn(2, 9) / 1e-4, 3, 0.5).max()))


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-30, 1e300, math.inf])
def test_every_accepted_temperature_is_numerically_safe(temperature):
    """logits / 1e-300 overflowed to inf and nan (``multinomial`` then raised): scaled_logits shifts by
    the maximum first, so a tiny temperature is greedy and a huge one uniform, never nan."""
    model = make_model(CONFIGS["dense"])
    prompt = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(0)
    out = generate(model, prompt, 8, temperature=temperature, top_k=20, top_p=0.9, generator=g)
    assert out.shape == (2, 13)
    if temperature < 1e-20:
        assert torch.equal(out, generate(model, prompt, 8, temperature=0))  # greedy in the limit
    logits = torch.tensor([[1.0, 3.0, float("-inf"), 3.0]])
    s = scaled_logits(logits, temperature)
    assert not s.isnan().any() and s.max() == 0 and s.softmax(-1).sum() == pytest.approx(1.0)


def test_the_kv_cache_appends_in_place_and_grows_when_full():
    """Positions are written into a buffer (no copy of the whole cache per step); a forward that needs more room
    than ``capacity`` doubles it, keeping what was cached."""
    from mhmoe.model.lm import KVCache

    cache = KVCache(1, capacity=4)
    chunks = [torch.randn(2, 3, t, 8) for t in (3, 1, 2, 5)]
    seen = []
    for c in chunks:
        seen.append(c)
        k, v = cache.update(0, c, -c)
        assert torch.equal(k, torch.cat(seen, 2)) and torch.equal(v, -torch.cat(seen, 2))
    assert cache.length == 11 and cache.k[0].shape == (2, 3, 11, 8)
    assert cache._k[0].shape[2] == 16  # room for 4, then 8 (6 needed), then 16 (11 needed): doubled each time
    buf = cache._k[0]
    cache.update(0, torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8))
    assert cache._k[0] is buf and cache.length == 16  # positions 12-16 fit: written in place
    cache.update(0, torch.randn(2, 3, 20, 8), torch.randn(2, 3, 20, 8))
    assert cache._k[0].shape[2] == 36 and torch.equal(cache.k[0][:, :, :11], torch.cat(seen, 2))
