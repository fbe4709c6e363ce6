"""The paired comparison of two rows: t quantiles, the paired-t CI, the exact sign-flip p-value and the
separation count, checked by hand and on simulated experiments with a known answer."""

import itertools
import math

import numpy as np
import pytest

from mhmoe.research import stats


@pytest.mark.parametrize("df, q", [(1, 12.706204736), (2, 4.302652730), (4, 2.776445105), (10, 2.228138852),
                                   (1000, 1.962339081)])
def test_t_quantiles_match_the_tables(df, q):
    assert stats.t_quantile(0.975, df) == pytest.approx(q, abs=1e-8)
    assert stats.t_quantile(0.025, df) == pytest.approx(-q, abs=1e-8)
    assert stats.t_cdf(q, df) == pytest.approx(0.975, abs=1e-9)  # q has 10 significant digits


def test_t_cdf_against_closed_forms():
    for t in (-3.0, -0.5, 0.0, 0.7, 4.0):
        assert stats.t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-12)  # Cauchy
        assert stats.t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-12)


def test_paired_ci_by_hand():
    d = [0.01, 0.03, -0.02, 0.04, 0.02]
    mean, lo, hi = stats.paired_ci(d)
    sd = math.sqrt(sum((x - 0.016) ** 2 for x in d) / 4)  # 0.023022
    half = 2.776445105 * sd / math.sqrt(5)
    assert mean == pytest.approx(0.016) and lo == pytest.approx(0.016 - half) and hi == pytest.approx(0.016 + half)
    assert stats.paired_ci([0.1]) is None


@pytest.mark.parametrize("d, p", [([1, 2, 3], 2 / 8), ([1] * 5, 2 / 32), ([1, -1], 1.0), ([3, -1, 2, 2], 4 / 16),
                                  ([0.0, 0.0], 1.0), ([2, 1, -1], 6 / 8)])
def test_sign_flip_p_by_hand(d, p):
    # [3,-1,2,2]: |sum| >= 6 for +-(3+1+2+2) and +-(3-1+2+2); [2,1,-1]: every pattern but +-(2-1-1) has |sum| >= 2
    assert stats.sign_flip_p(d) == pytest.approx(p)


def test_sign_flip_p_equals_brute_force_and_its_minimum():
    rng = np.random.default_rng(3)
    for n in (1, 2, 5, 9, 12):
        d = rng.normal(0.01, 0.02, n)
        brute = np.mean([abs(np.dot(s, d)) >= abs(d.sum()) - 1e-12 for s in itertools.product((-1, 1), repeat=n)])
        assert stats.sign_flip_p(d) == pytest.approx(brute)
        assert stats.sign_flip_p(d) >= stats.min_sign_flip_p(n)
    assert stats.min_sign_flip_p(5) == 0.0625  # 5 seeds can never give p < 0.05
    assert stats.sign_flip_p(np.full(5, 0.03)) == 0.0625


def test_sign_flip_p_above_20_pairs_is_sampled_with_a_fixed_seed():
    d = np.random.default_rng(0).normal(0.0, 1.0, 24)
    p = stats.sign_flip_p(d, n_random=20_000)
    assert p == stats.sign_flip_p(d, n_random=20_000) and 0 < p <= 1
    assert stats.sign_flip_p(np.ones(24), n_random=20_000) == pytest.approx(1 / 20_001)


def test_null_rejection_rate_is_alpha():
    """No true difference: the CI rule separates 5% of pairs (3 and 5 seeds); the sign-flip test at 5
    seeds never rejects at 0.05 (its smallest p is 0.0625)."""
    rng = np.random.default_rng(7)
    for n in (3, 5):
        d = rng.normal(0.0, 0.03, size=(2000, n))
        rate = np.mean([stats.compare_paired(dict(enumerate(x)), dict.fromkeys(range(n), 0.0))["separated"]
                        for x in d])
        assert abs(rate - 0.05) < 0.015, (n, rate)  # 3 standard errors
    p = [stats.sign_flip_p(x) for x in rng.normal(0.0, 0.03, size=(200, 5))]
    assert min(p) == 0.0625 and np.mean(np.array(p) <= 0.0625) == pytest.approx(0.0625, abs=0.04)


def test_planted_effect_is_detected():
    rng = np.random.default_rng(11)
    a = {k: 3.00 + e for k, e in enumerate(rng.normal(0, 0.05, 8))}  # seed effects shared by both rows
    b = {k: v + 0.04 + rng.normal(0, 0.005) for k, v in a.items()}
    c = stats.compare_paired(a, b)
    assert c["separated"] and c["ci95"][1] < 0 and c["mean_diff"] == pytest.approx(-0.04, abs=0.006)
    assert c["p_sign_flip"] == pytest.approx(2 / 256) and c["p_min"] == 2 / 256 and c["n"] == 8


def test_compare_pairs_only_shared_seeds_and_counts_separation():
    c = stats.compare_paired({0: 1.0, 1: 2.0, 2: 1.5, 3: 9.0}, {0: 0.5, 1: 1.0, 2: 1.2})
    assert c["seeds"] == [0, 1, 2] and c["n"] == 3 and c["mean_diff"] == pytest.approx(0.6)
    assert stats.compare_paired({0: 1.0}, {1: 1.0}) is None
    one = stats.compare_paired({0: 1.0}, {0: 2.0})
    assert one["ci95"] is None and not one["separated"]
    counts = stats.separation_counts([c, one, {**c, "separated": True}])
    assert counts["compared"] == 2 and counts["separated"] == 1 and counts["expected_by_chance"] == 0.1
    line = stats.format_comparison({**c, "separated": True}, "A", "B")
    assert "95% CI" in line and "separated" in line and "smallest possible 0.25" in line
