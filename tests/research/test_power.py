"""The tokens-per-run calculation: power of the paired-t CI, the bias-corrected log-log noise law, and the
whole analysis on a synthetic pilot whose noise law is known."""

import json
import math

import numpy as np
import pytest

from mhmoe.cli import main
from mhmoe.research import power


@pytest.mark.parametrize("n, sigma", [(2, 0.02), (3, 0.01), (5, 0.02), (5, 0.04), (10, 0.02)])
def test_power_quadrature_matches_simulation(n, sigma):
    exact = power.power_paired_t(power.PAPER_GAP, sigma, n)
    assert exact == pytest.approx(power.simulate_power(power.PAPER_GAP, sigma, n, sims=40_000), abs=0.01)


def test_power_is_alpha_without_a_gap_and_required_sd_gives_the_target():
    assert power.power_paired_t(0.0, 0.03, 5) == pytest.approx(0.05, abs=1e-6)
    sd = power.required_sd(power.PAPER_GAP, 5)
    assert power.power_paired_t(power.PAPER_GAP, sd, 5) == pytest.approx(0.95, abs=1e-4)
    assert 0.015 < sd < 0.018  # delta sqrt(5) / sd ~ 4.9 (t crit 2.78 + the noncentral t's spread)
    assert power.required_sd(power.PAPER_GAP, 10) > sd > power.required_sd(power.PAPER_GAP, 3)
    assert power.PAPER_GAP == pytest.approx(math.log(10.90 / 10.51)) and round(power.PAPER_GAP, 4) == 0.0364


def test_digamma_and_trigamma_at_half_integers():
    assert power.digamma_half(1) == pytest.approx(-0.5772156649)
    assert power.digamma_half(1.5) == pytest.approx(0.0364899740)
    assert power.trigamma_half(0.5) == pytest.approx(math.pi ** 2 / 2)
    assert power.trigamma_half(2) == pytest.approx(math.pi ** 2 / 6 - 1)
    rng = np.random.default_rng(0)  # E[log s^2/sigma^2] for df = 2 (3 seeds), by simulation
    s2 = rng.normal(size=(200_000, 3)).var(axis=1, ddof=1)
    assert np.log(s2).mean() == pytest.approx(power.log_var_bias(2), abs=0.01)


def _pilot(law_scale, law_slope, seeds, tokens, rng, gap=0.01):
    """Per-seed curves of two rows whose paired difference at t tokens is N(gap, (scale t^slope)^2)."""
    a, b = {}, {}
    for s in range(seeds):
        base = {t: 5.0 / math.log(t) + rng.normal(0, 0.05) for t in tokens}  # shared by both rows of a seed
        a[s] = base
        b[s] = {t: v - gap - rng.normal(0, law_scale * t ** law_slope) for t, v in base.items()}
    return a, b


def test_noise_law_and_tokens_needed_on_a_synthetic_pilot():
    """sd(t) = 2 t^-0.4: 20 seeds pin the law down; the tokens needed are those of the true law."""
    rng = np.random.default_rng(5)
    tokens = [40_960 * k for k in range(1, 101)]
    a, b = _pilot(2.0, -0.4, 20, tokens, rng)
    res = power.power_analysis(a, b, seeds=(5,))
    law = res["law"]
    assert law["slope"] == pytest.approx(-0.4, abs=2.5 * law["slope_se"]) and law["slope_se"] < 0.06
    assert res["sd_at_pilot_end"]["fitted"] == pytest.approx(2.0 * tokens[-1] ** -0.4, rel=0.05)
    need = res["needs"][0]
    true_tokens = (need["required_sd"] / 2.0) ** (1 / -0.4)
    assert need["tokens_per_run"] == pytest.approx(true_tokens, rel=0.3)
    assert need["tokens_per_run_conservative"] > need["tokens_per_run"]
    assert res["pilot_seeds"] == 20 and len(res["points"]) == 100 and law["points"] == 76  # t >= 25% of the last


def test_three_seed_pilot_brackets_the_true_law():
    """3 seeds, as the default pilot: the slope is uncertain, and its standard error says by how much."""
    rng = np.random.default_rng(8)
    tokens = [40_960 * k for k in range(1, 21)]
    hits = 0
    for _ in range(40):
        a, b = _pilot(2.0, -0.4, 3, tokens, rng)
        law = power.power_analysis(a, b, seeds=(5,))["law"]
        hits += abs(law["slope"] + 0.4) <= 2 * law["slope_se"]
    assert hits >= 30  # ~95% if the points were independent; they are here


def test_noise_law_fit_is_unbiased_with_many_points():
    rng = np.random.default_rng(9)
    pts = [(t, float(np.var(rng.normal(0, 0.3 * t ** -0.25, 3), ddof=1)), 2) for t in np.linspace(1e5, 1e7, 2000)]
    law = power.fit_noise_law(pts, late_fraction=0.0)
    assert law.slope == pytest.approx(-0.25, abs=0.03)
    assert law.sd(1e7) == pytest.approx(0.3 * 1e7 ** -0.25, rel=0.05)


def test_a_noise_that_does_not_fall_never_reaches_a_smaller_sd():
    law = power.NoiseLaw(math.log(0.05), 0.1, 5, 10, 1000)
    assert law.tokens_for(0.01) is None and law.tokens_for(1.0) == 1000.0
    with pytest.raises(ValueError):
        power.fit_noise_law([(10, 0.1, 2)])


def test_analyze_power_reads_a_pilot_folder(tmp_path, capsys):
    rng = np.random.default_rng(2)
    tokens = [4096 * 10 * k for k in range(1, 21)]
    a, b = _pilot(1.0, -0.35, 3, tokens, rng)
    runs = [{"label": label, "seed": s, "train_tokens": 30_000_000,
             "curve": [{"step": t // 4096, "tokens": t, "loss": {"debdocs": v}} for t, v in curves[s].items()]}
            for label, curves in (("MH-MoE (head=3)", a), ("SMoE", b)) for s in curves]
    (tmp_path / "results.json").write_text(json.dumps({"title": "decisive-pilot", "runs": runs}))
    assert main(["analyze", "--suite", str(tmp_path), "--power", "--seeds", "5", "8"]) == 0
    out = capsys.readouterr().out
    assert "MH-MoE (head=3) - SMoE on debdocs" in out and "5 seeds: sd <=" in out and "8 seeds" in out
    saved = json.loads((tmp_path / "power.json").read_text())
    assert saved["pair"] == ["MH-MoE (head=3)", "SMoE"] and saved["needs"][0]["epochs"] is not None
    assert main(["analyze", "--suite", str(tmp_path), "--power", "--json", "--gap", "0.02"]) == 0
    assert json.loads(capsys.readouterr().out)["gap_nats"] == 0.02
    assert main(["analyze", "--suite", str(tmp_path), "--power", "--pair", "SMoE", "Dense"]) == 2
    assert main(["analyze", "--suite", str(tmp_path / "none"), "--power"]) == 2
    assert main(["analyze", "--checkpoint", str(tmp_path), "--power"]) == 2
