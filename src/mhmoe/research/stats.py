"""Paired comparisons of two suite rows over the seeds they share (numpy and the standard library only).

Seed k of every row of a suite trains with the same ``train.seed`` (initialisation and batch order), so
two rows form *pairs* by seed: the difference ``d_k = loss_a(k) - loss_b(k)`` of their validation losses
(nats) removes what the seed does to both. For ``n`` pairs:

- **mean difference** ``mean(d)`` (negative: row ``a`` has the lower loss);
- **95% confidence interval** of the mean by the paired t test: ``mean ± t_{0.975, n-1} · sd(d) / sqrt(n)``;
- **exact sign-flip permutation p-value** (two-sided): under "no difference" every ``d_k`` is as likely
  to have the opposite sign, so all ``2^n`` sign patterns are equally likely; ``p`` is the fraction of
  patterns whose mean difference is at least as far from 0 as the observed one. Enumerated exactly for
  ``n <= 20`` (by meet in the middle: two halves of at most 2^10 sums); above that, 100,000 random
  patterns with a fixed seed. The smallest attainable value is ``2 / 2^n`` (the observed pattern and its
  mirror): 0.0625 for 5 pairs, so **5 seeds can never give p < 0.05 by this test**; it is reported with
  that minimum beside it;
- **separated**: the 95% CI excludes 0. Under no difference (and normal ``d``) this happens with
  probability 0.05 for any ``n >= 2``, so among ``m`` pairs compared ``0.05 · m`` are separated by chance
  (:func:`separation_counts`).

The t distribution's CDF and quantiles are computed here (regularized incomplete beta function by its
continued fraction) so that nothing beyond numpy is needed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import lru_cache

import numpy as np

ALPHA = 0.05  # the separation rule's per-pair false-positive rate (95% CI)
EXACT_MAX_N = 20  # sign patterns enumerated exactly up to this many pairs
RANDOM_PATTERNS = 100_000  # above it: random sign patterns (fixed seed)
RULE = ("separated: the 95% confidence interval (paired t) of the mean paired difference of validation loss "
        "excludes 0; false-positive rate 0.05 per pair compared")


# ---- the t distribution ----------------------------------------------------------------------------
def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function ``I_x(a, b)`` for ``a, b > 0``, ``0 <= x <= 1``."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    if not df > 0:
        raise ValueError(f"df must be > 0, got {df}")
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


@lru_cache(maxsize=256)
def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (bisection on :func:`t_cdf`)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
        if hi - lo <= 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


def t_critical(n: int, level: float = 1 - ALPHA) -> float:
    """The two-sided critical value of a paired t interval over ``n >= 2`` pairs."""
    return t_quantile(0.5 + level / 2.0, n - 1)


# ---- one pair of rows --------------------------------------------------------------------------------
def paired_ci(diffs: Sequence[float], level: float = 1 - ALPHA) -> tuple[float, float, float] | None:
    """(mean, low, high): the paired-t confidence interval of the mean of ``diffs`` (None for < 2 values)."""
    d = np.asarray(diffs, dtype=np.float64)
    if d.size < 2:
        return None
    mean = float(d.mean())
    half = t_critical(d.size, level) * float(d.std(ddof=1)) / math.sqrt(d.size)
    return mean, mean - half, mean + half


def min_sign_flip_p(n: int) -> float:
    """The smallest two-sided sign-flip p-value ``n`` nonzero pairs can give: ``2 / 2^n`` (1 for n <= 1)."""
    return 1.0 if n <= 1 else 2.0 ** (1 - n)


def _half_sums(d: np.ndarray) -> np.ndarray:
    """All 2^len(d) signed sums of ``d``."""
    sums = np.zeros(1)
    for v in d:
        sums = np.concatenate([sums + v, sums - v])
    return sums


def sign_flip_p(diffs: Sequence[float], exact_max_n: int = EXACT_MAX_N, n_random: int = RANDOM_PATTERNS,
                seed: int = 0) -> float | None:
    """Two-sided sign-flip permutation p-value of the mean of ``diffs`` (module docstring): the fraction
    of sign patterns whose ``|sum|`` is at least the observed ``|sum|`` (ties within 1e-9 relative count).
    Exact for ``len(diffs) <= exact_max_n``; else ``(1 + hits) / (1 + n_random)`` over random patterns."""
    d = np.asarray(diffs, dtype=np.float64)
    n = d.size
    if n == 0:
        return None
    obs = abs(float(d.sum()))
    tol = 1e-9 * float(np.abs(d).sum())
    if obs - tol <= 0:  # a zero mean: every pattern is at least as far from 0
        return 1.0
    if n <= exact_max_n:
        left, right = _half_sums(d[: n // 2]), np.sort(_half_sums(d[n // 2:]))
        thr = obs - tol  # |l + r| >= thr  <=>  r >= thr - l  or  r <= -thr - l (disjoint as thr > 0)
        hits = right.size - np.searchsorted(right, thr - left, side="left")
        hits += np.searchsorted(right, -thr - left, side="right")
        return float(hits.sum()) / 2.0 ** n
    rng = np.random.default_rng(seed)
    signs = rng.choice(np.array([-1.0, 1.0]), size=(n_random, n))
    hits = int((np.abs(signs @ d) >= obs - tol).sum())
    return (1 + hits) / (1 + n_random)


def compare_paired(a: Mapping[int, float], b: Mapping[int, float]) -> dict | None:
    """The paired comparison of row ``a`` against row ``b`` over the seeds both have (``seed -> loss``):
    ``n``, ``seeds``, ``mean_diff`` (a - b, nats), ``sd_diff``, ``ci95`` ([low, high]; None for n < 2),
    ``p_sign_flip`` and ``p_min`` (its smallest attainable value) and ``separated`` (the CI excludes 0).
    None when the rows share no seed."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return None
    d = [float(a[s]) - float(b[s]) for s in seeds]
    ci = paired_ci(d)
    sd = float(np.std(d, ddof=1)) if len(d) > 1 else None
    return {"n": len(d), "seeds": seeds, "mean_diff": float(np.mean(d)), "sd_diff": sd,
            "ci95": None if ci is None else [ci[1], ci[2]], "p_sign_flip": sign_flip_p(d),
            "p_min": min_sign_flip_p(len(d)), "separated": ci is not None and (ci[1] > 0 or ci[2] < 0)}


def separation_counts(comparisons: Sequence[Mapping]) -> dict:
    """How many of the pairs compared (those with a CI, n >= 2) are separated, beside the number expected
    by chance when no pair differs: ``ALPHA`` times the number compared (each pair's false-positive rate
    under the rule; pairs on several validation sets are counted once per set)."""
    compared = [c for c in comparisons if c.get("ci95") is not None]
    return {"rule": RULE, "compared": len(compared), "separated": sum(bool(c["separated"]) for c in compared),
            "expected_by_chance": round(ALPHA * len(compared), 2), "false_positive_rate": ALPHA}


def format_comparison(c: Mapping, a: str, b: str) -> str:
    """One line: ``a - b: mean -0.0123 nats, 95% CI [-0.03, 0.01], p = 0.19 (min 0.0625), 5 seeds``."""
    if c.get("ci95") is None:
        return f"{a} - {b}: {c['mean_diff']:+.4f} nats over {c['n']} seed (no interval with one seed)"
    lo, hi = c["ci95"]
    tag = " separated" if c["separated"] else ""
    return (f"{a} - {b}: {c['mean_diff']:+.4f} nats, 95% CI [{lo:+.4f}, {hi:+.4f}]{tag}; sign-flip "
            f"p = {c['p_sign_flip']:.3g} (smallest possible {c['p_min']:.3g}); {c['n']} seeds")
