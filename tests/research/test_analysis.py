"""Analysis statistics on hand-made routing decisions, and the report on a tiny model."""

import json

import pytest
import torch

from mhmoe.config.model import ModelConfig
from mhmoe.config.moe import MoEConfig
from mhmoe.model.lm import LM
from mhmoe.research.analysis import (
    activation_frequency,
    activation_ratio,
    assign_diversity,
    collect_routing,
    expected_random_diversity,
    load_imbalance,
    random_routing,
    router_entropy,
    summarize,
    uniform_frequency,
    write_report,
)


def test_activation_frequency_and_ratio():
    # 4 tokens, h=2 sub-tokens each, top-1: 8 selections over 4 experts; expert 3 never chosen
    experts = torch.tensor([[0], [0], [1], [0], [2], [1], [0], [0]])
    valid = torch.ones_like(experts, dtype=torch.bool)
    freq = activation_frequency(experts, valid, 4, n_tokens=4)
    assert freq.tolist() == [5 / 4, 2 / 4, 1 / 4, 0.0]
    assert activation_ratio(freq, 0.3) == 0.5
    assert activation_ratio(torch.stack([freq, freq]), 0.0) == 0.75


def test_assign_diversity_counts_distinct_valid_experts():
    experts = torch.tensor([[1, 1, 1], [0, 2, 5], [3, 3, 4], [7, 7, 7]])
    valid = torch.tensor([[True] * 3, [True] * 3, [True, True, False], [False] * 3])
    assert assign_diversity(experts, valid).tolist() == [1, 3, 1, 0]


def test_entropy_and_imbalance():
    probs = torch.tensor([[0.5, 0.5], [1.0, 0.0], [0.25, 0.75]])
    mask = torch.tensor([True, True, False])
    assert router_entropy(probs, mask) == pytest.approx(0.5 * torch.log(torch.tensor(2.0)).item())
    assert load_imbalance(torch.tensor([2.0, 2.0, 2.0])) == 1.0
    assert load_imbalance(torch.tensor([6.0, 0.0, 0.0])) == 3.0


def test_report_on_tiny_mhmoe(tmp_path):
    torch.set_num_threads(1)
    cfg = ModelConfig(vocab_size=50, d_model=24, n_layers=2, n_heads=2, d_ff=32, max_seq_len=16,
                      moe=MoEConfig(n_experts=5, top_k=2, d_expert=8, heads=3, head_layer=True, merge_layer=True),
                      moe_every=1)
    model = LM(cfg)
    x = torch.randint(0, 50, (2, 16))
    records, ids = collect_routing(model, [(x, x)])
    assert len(records) == 2 and records[0].tokens == 32 and records[0].slots_per_token == 6
    assert float(records[0].counts.sum()) == 32 * 6
    s = summarize(records, threshold=0.5)
    assert s["frequency"].shape == (2, 5)
    assert 1 <= s["mean_assign_diversity"] <= 5 and s["max_possible_diversity"] == 5
    out = write_report(s, ids, lambda t: f"<{t[0]}>", tmp_path, top=3)
    for f in ("activation.png", "activation.csv", "diversity.png", "diversity.csv", "summary.json"):
        assert (tmp_path / f).stat().st_size > 0
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["tokens_analysed"] == 32 and len(saved["highest_diversity_tokens"]) == 3
    assert out["activation_ratio"] == saved["activation_ratio"]


@pytest.mark.parametrize("E, h, k, expected", [(8, 1, 1, 1.0), (16, 1, 2, 2.0), (41, 2, 2, 3.90), (93, 3, 3, 8.71)])
def test_random_routing_diversity_matches_its_closed_form(E, h, k, expected):
    """The chance levels behind the ICML Fig. 7 numbers (h=2: 3.90 of 4; h=3: 8.71 of 9)."""
    assert expected_random_diversity(E, h, k) == pytest.approx(expected, abs=0.005)
    e = random_routing(20_000, h, k, E, torch.Generator().manual_seed(0))
    assert e.shape == (20_000, h * k)
    div = assign_diversity(e, torch.ones_like(e, dtype=torch.bool)).double().mean()
    assert float(div) == pytest.approx(expected_random_diversity(E, h, k), abs=0.02)
    freq = activation_frequency(e, torch.ones_like(e, dtype=torch.bool), E, 20_000)
    torch.testing.assert_close(freq, torch.full((E,), uniform_frequency(E, h, k), dtype=torch.float64),
                               atol=0.01, rtol=0.05)


def test_summary_reports_the_random_routing_baseline(tmp_path):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, d_model=24, n_layers=2, n_heads=2, d_ff=32, max_seq_len=16,
                      moe=MoEConfig(n_experts=9, top_k=2, d_expert=8, heads=3, head_layer=True), moe_every=1)
    records, ids = collect_routing(LM(cfg), [(x, x) for x in torch.randint(0, 50, (4, 4, 16))])
    assert records[0].heads == 3 and records[0].top_k == 2
    s = summarize(records, threshold=0.5)
    assert s["uniform_frequency_per_layer"] == [pytest.approx(6 / 9)] * 2
    rnd = s["random_routing"]
    assert rnd["expected_assign_diversity_per_layer"] == [pytest.approx(9 * (1 - (7 / 9) ** 3))] * 2
    assert abs(rnd["mean_assign_diversity"] - 9 * (1 - (7 / 9) ** 3)) < 0.3
    assert len(rnd["load_imbalance_per_layer"]) == 2 and 0 <= rnd["activation_ratio"] <= 1
    saved = json.loads(json.dumps(write_report(s, ids, str, tmp_path), default=float))
    assert saved["random_routing"]["mean_assign_diversity"] == rnd["mean_assign_diversity"]


def test_analyze_suite_reports_mean_std_beside_random_routing(tmp_path, capsys):
    from helpers import DENSE, MHMOE, tiny_run

    from mhmoe.cli import main
    from mhmoe.research.analysis import analyze_suite
    from mhmoe.train.loop import train

    torch.set_num_threads(1)
    suite = tmp_path / "suite"
    for label, moe, seeds in (("Dense", DENSE, 1), ("MH", MHMOE, 2)):
        for k in range(seeds):
            train(tiny_run(tmp_path, moe, max_steps=2, seed=k), suite / label / f"seed{k}", progress=False)
    res = analyze_suite(suite, batches=1, threshold=0.01)
    assert [r["label"] for r in res["rows"]] == ["MH"]  # the dense run has no routing
    row = res["rows"][0]
    assert row["seeds"] == 2 and row["max_possible_diversity"] == 6  # 3 heads x top-3 over 6 experts
    assert (row["n_experts"], row["heads"], row["top_k"], row["moe_layers"]) == (6, 3, 3, 1)
    assert row["uniform_frequency"] == {"mean": 1.5, "std": 0.0}  # H*K/E = 3*3/6
    assert row["expected_random_diversity"]["mean"] == round(6 * (1 - 0.5 ** 3), 2)
    assert (suite / "analysis.json").exists() and (suite / "MH" / "seed1" / "analysis" / "summary.json").exists()
    assert main(["analyze", "--suite", str(suite), "--batches", "1"]) == 0
    assert "random routing" in capsys.readouterr().out
    assert main(["analyze", "--suite", str(suite), "--checkpoint", str(suite / "MH" / "seed0")]) == 2
    assert main(["analyze"]) == 2
    assert "--checkpoint/--suite" in capsys.readouterr().err
