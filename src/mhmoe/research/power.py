"""How many tokens per run a paired comparison needs: ``mhmoe analyze --suite PILOT --power``.

The noise of a paired difference falls as the models train. A *pilot* suite (a few seeds of the two rows
of the primary pair, evaluated often) gives, at every evaluation step ``t`` (tokens seen) that both rows'
seeds share, the paired differences ``d_k(t) = loss_a(k, t) - loss_b(k, t)`` and their sample variance
``s^2(t)`` with ``df = seeds - 1`` degrees of freedom. The model:

    sd of a paired difference at t tokens:  sigma(t) = exp(alpha) * t^beta   (log-log linear)

fitted by weighted least squares on the *late* part of the curves (``t >= late_fraction * max t``,
default the last three quarters, past the early transient) to ``log s^2(t) - c(df)``. The correction
``c(df) = digamma(df/2) - log(df/2)`` is the mean of ``log(chi2_df / df)``, so the fit is unbiased for
``log sigma^2`` (3 seeds alone would put the fitted sd 25% low); the weights are ``1 / trigamma(df/2)``,
the inverse variance of ``log(chi2_df / df)``. With few seeds each point is noisy (3 seeds: the log sd of
one point has a standard deviation of 0.64), so the slope is uncertain; its standard error (from the
residuals, as if the points were independent, which neighbouring evaluations of one run are not: an
underestimate) is reported, and so are the tokens needed at the slope one standard error shallower
(``tokens_per_run_conservative``). A denser, longer pilot and more seeds narrow it.

**Power.** With ``n`` seeds and a true gap ``delta`` (nats), the 95% paired-t interval excludes 0 with
probability ``P(|T'| > t_{0.975, n-1})``, ``T'`` noncentral t with ``n - 1`` degrees of freedom and
noncentrality ``delta * sqrt(n) / sigma`` (:func:`power_paired_t`, by quadrature over the chi
distribution; :func:`simulate_power` checks it by simulation). The largest ``sigma`` with power >= 0.95
(:func:`required_sd`), put into the fitted law, gives the tokens per run (:func:`tokens_needed`). The gap
is held fixed: the default, ``ln(10.90 / 10.51) = 0.0364`` nats, is the v2 paper's MH-MoE (head=3) vs
SMoE gap in RedPajama perplexity at 100k steps; the pilot's own observed gap is reported, not used.
Caveat: a pilot point at ``t`` tokens is mid-schedule (the learning rate has not decayed as it has at
the end of a ``t``-token run), which usually makes its noise larger, so the estimate errs long.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from mhmoe.research.stats import ALPHA, t_critical

PAPER_GAP = math.log(10.90 / 10.51)  # v2 Table 1, 100k steps, RedPajama: SMoE 10.90 vs MH-MoE (head=3) 10.51
TARGET_POWER = 0.95
LATE_FRACTION = 0.25
EULER_GAMMA = 0.5772156649015329


def digamma_half(x: float) -> float:
    """digamma(x) for x a positive multiple of 1/2 (the degrees of freedom / 2 of a sample variance)."""
    k = round(2 * x)
    if k < 1 or abs(2 * x - k) > 1e-9:
        raise ValueError(f"x must be a positive multiple of 1/2, got {x}")
    v, base = (-EULER_GAMMA, 1.0) if k % 2 == 0 else (-EULER_GAMMA - 2 * math.log(2), 0.5)
    while base < x - 1e-9:
        v, base = v + 1.0 / base, base + 1.0
    return v


def trigamma_half(x: float) -> float:
    """trigamma(x) for x a positive multiple of 1/2."""
    k = round(2 * x)
    if k < 1 or abs(2 * x - k) > 1e-9:
        raise ValueError(f"x must be a positive multiple of 1/2, got {x}")
    v, base = (math.pi ** 2 / 6, 1.0) if k % 2 == 0 else (math.pi ** 2 / 2, 0.5)
    while base < x - 1e-9:
        v, base = v - 1.0 / base ** 2, base + 1.0
    return v


def log_var_bias(df: int) -> float:
    """E[log(s^2 / sigma^2)] for a sample variance with ``df`` degrees of freedom."""
    return digamma_half(df / 2) - math.log(df / 2)


# ---- power of the paired t interval -------------------------------------------------------------------
def _norm_cdf(x: np.ndarray) -> np.ndarray:
    return 0.5 * np.vectorize(math.erfc)(-x / math.sqrt(2.0))


def power_paired_t(delta: float, sigma: float, n: int, alpha: float = ALPHA, points: int = 401) -> float:
    """P(the (1 - alpha) paired-t interval over ``n`` pairs excludes 0) when the differences are
    N(delta, sigma^2): ``E_U[Phi(lam - c U/sqrt(df)) + Phi(-lam - c U/sqrt(df))]``, ``U`` chi-distributed with
    ``df = n - 1``, ``lam = delta sqrt(n) / sigma``, ``c`` the critical value; Simpson's rule over ``U``."""
    if n < 2:
        raise ValueError("a paired t interval needs n >= 2")
    if sigma <= 0:
        return 1.0 if delta != 0 else alpha
    df, c = n - 1, t_critical(n, 1 - alpha)
    lam = abs(delta) * math.sqrt(n) / sigma
    u = np.linspace(0.0, math.sqrt(df) + 12.0, points)
    f = np.exp((df - 1) * np.log(np.maximum(u, 1e-300)) - u * u / 2 - (df / 2 - 1) * math.log(2)
               - math.lgamma(df / 2))  # the chi density with df degrees of freedom
    s = c * u / math.sqrt(df)
    g = f * (_norm_cdf(lam - s) + _norm_cdf(-lam - s))
    w = np.ones(points)
    w[1:-1:2], w[2:-1:2] = 4.0, 2.0
    return float(min(1.0, (u[1] - u[0]) / 3.0 * (w * g).sum()))


def simulate_power(delta: float, sigma: float, n: int, sims: int = 20_000, alpha: float = ALPHA,
                   seed: int = 0) -> float:
    """:func:`power_paired_t` by simulation (numpy, fixed seed): the fraction of ``sims`` experiments of
    ``n`` N(delta, sigma^2) differences whose paired-t interval excludes 0."""
    rng = np.random.default_rng(seed)
    d = rng.normal(delta, sigma, size=(sims, n))
    t = d.mean(axis=1) / (d.std(axis=1, ddof=1) / math.sqrt(n))
    return float((np.abs(t) > t_critical(n, 1 - alpha)).mean())


@lru_cache(maxsize=256)
def required_sd(delta: float, n: int, power: float = TARGET_POWER, alpha: float = ALPHA) -> float:
    """The largest sd of a paired difference at which a gap ``delta`` is detected with ``power`` at ``n``
    seeds (bisection; power falls as sd grows)."""
    lo, hi = 0.0, abs(delta)
    while power_paired_t(delta, hi, n, alpha) >= power:
        lo, hi = hi, hi * 2
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if power_paired_t(delta, mid, n, alpha) >= power else (lo, mid)
    return lo


# ---- the noise law ---------------------------------------------------------------------------------
@dataclass
class NoiseLaw:
    """``sigma(t) = exp(log_scale) * t ** slope`` fitted on ``points`` evaluation points in
    ``[tokens_min, tokens_max]``; ``slope_se``: the slope's standard error (module docstring)."""

    log_scale: float
    slope: float
    points: int
    tokens_min: int
    tokens_max: int
    slope_se: float = math.inf

    def tilted(self, by: float) -> NoiseLaw:
        """The law with its slope changed by ``by`` (at most to 0), through the same point at the geometric
        middle of the fitted range."""
        pivot = 0.5 * (math.log(self.tokens_min) + math.log(self.tokens_max))
        slope = min(0.0, self.slope + by)
        return NoiseLaw(self.log_scale + (self.slope - slope) * pivot, slope, self.points, self.tokens_min,
                        self.tokens_max, self.slope_se)

    def tokens_conservative(self, sd: float) -> float | None:
        """The most tokens :meth:`tokens_for` gives with the slope one standard error either way (a
        shallower slope when extrapolating past the fitted range, a steeper one before it)."""
        if not math.isfinite(self.slope_se):
            return None
        found = [self.tilted(by).tokens_for(sd) for by in (-self.slope_se, self.slope_se)]
        return None if None in found else max(found)

    def sd(self, tokens: float) -> float:
        return math.exp(self.log_scale + self.slope * math.log(tokens))

    def tokens_for(self, sd: float) -> float | None:
        """The tokens at which the law reaches ``sd`` (None when it never does: a slope >= 0 above ``sd``)."""
        if self.slope >= 0:
            return None if self.sd(self.tokens_max) > sd else float(self.tokens_max)
        return math.exp((math.log(sd) - self.log_scale) / self.slope)


def fit_noise_law(points: Sequence[tuple[float, float, int]], late_fraction: float = LATE_FRACTION) -> NoiseLaw:
    """Fit the law to ``(tokens, sample variance, df)`` points (module docstring): the points with
    ``tokens >= late_fraction * max tokens`` (at least 3 if there are that many), bias-corrected, weighted."""
    pts = sorted((float(t), float(v), int(df)) for t, v, df in points if t > 0 and v > 0 and df >= 1)
    if len(pts) < 2:
        raise ValueError("the noise law needs at least 2 evaluation points with a positive variance")
    late = [p for p in pts if p[0] >= late_fraction * pts[-1][0]]
    if len(late) < 3:
        late = pts[-3:]
    x = np.array([math.log(t) for t, _, _ in late])
    y = np.array([(math.log(v) - log_var_bias(df)) / 2 for _, v, df in late])  # unbiased log sd
    w = np.array([1.0 / trigamma_half(df / 2) for _, _, df in late])
    span = (len(late), int(late[0][0]), int(late[-1][0]))
    if np.ptp(x) == 0:
        return NoiseLaw(float(np.average(y, weights=w)), 0.0, *span)
    xm, ym = np.average(x, weights=w), np.average(y, weights=w)
    sxx = float(np.sum(w * (x - xm) ** 2))
    slope = float(np.sum(w * (x - xm) * (y - ym)) / sxx)
    resid = y - (ym + slope * (x - xm))
    se = math.sqrt(float(np.sum(w * resid ** 2)) / (len(late) - 2) / sxx) if len(late) > 2 else math.inf
    return NoiseLaw(float(ym - slope * xm), slope, *span, se)


def paired_noise_points(curves_a: Mapping[int, Mapping[int, float]],
                        curves_b: Mapping[int, Mapping[int, float]]) -> list[tuple[int, float, int, float]]:
    """``(tokens, variance, df, mean)`` of the paired differences at every evaluation point shared by at
    least 2 seeds of both rows; ``curves_x[seed][tokens] = loss``."""
    seeds = sorted(set(curves_a) & set(curves_b))
    steps = sorted(set().union(*(set(curves_a[s]) & set(curves_b[s]) for s in seeds))) if seeds else []
    out = []
    for t in steps:
        d = [curves_a[s][t] - curves_b[s][t] for s in seeds if t in curves_a[s] and t in curves_b[s]]
        if len(d) >= 2:
            out.append((t, float(np.var(d, ddof=1)), len(d) - 1, float(np.mean(d))))
    return out


def power_analysis(curves_a: Mapping[int, Mapping[int, float]], curves_b: Mapping[int, Mapping[int, float]],
                   gap: float = PAPER_GAP, seeds: Iterable[int] = (5,), power: float = TARGET_POWER,
                   late_fraction: float = LATE_FRACTION) -> dict:
    """The whole answer for one pair: the noise points, the fitted law, and per seed count the required sd
    and the tokens per run (None when the law never gets there)."""
    pts = paired_noise_points(curves_a, curves_b)
    law = fit_noise_law([(t, v, df) for t, v, df, _ in pts], late_fraction)
    last = pts[-1]
    needs = []
    def ceil(t: float | None) -> int | None:
        return None if t is None else int(math.ceil(min(t, 1e18)))

    for n in seeds:
        sd = required_sd(gap, n, power)
        needs.append({"seeds": n, "required_sd": sd, "tokens_per_run": ceil(law.tokens_for(sd)),
                      "tokens_per_run_conservative": ceil(law.tokens_conservative(sd)),
                      "power_at_pilot_end": power_paired_t(gap, law.sd(law.tokens_max), n)})
    return {"gap_nats": gap, "power": power, "alpha": ALPHA, "late_fraction": late_fraction,
            "pilot_seeds": max(df for _, _, df, _ in pts) + 1,
            "points": [{"tokens": t, "sd": math.sqrt(v), "df": df, "mean_diff": m} for t, v, df, m in pts],
            "law": asdict(law), "sd_at_pilot_end": {"tokens": last[0], "observed": math.sqrt(last[1]),
                                                    "fitted": law.sd(last[0]), "mean_diff": last[3]},
            "needs": needs}


# ---- a pilot suite's folder ------------------------------------------------------------------------
def curves_by_seed(runs: Sequence[Mapping], label: str, val_set: str) -> dict[int, dict[int, float]]:
    """``{seed: {tokens: loss}}`` of one row's runs (entries of a suite's results.json with a ``curve``)."""
    out: dict[int, dict[int, float]] = {}
    for r in runs:
        if r.get("label") == label:
            out[int(r["seed"])] = {int(p["tokens"]): float(p["loss"][val_set]) for p in r.get("curve") or []
                                   if val_set in p.get("loss", {})}
    return out


def suite_power(suite_dir: Path, gap: float = PAPER_GAP, seeds: Iterable[int] = (5,),
                pair: tuple[str, str] | None = None, val_set: str | None = None,
                late_fraction: float = LATE_FRACTION) -> dict:
    """:func:`power_analysis` of a pilot suite folder's ``results.json`` (its per-seed evaluation curves):
    ``pair`` defaults to the suite's first primary comparison, ``val_set`` to the training corpus's own
    split. Writes ``power.json`` into the folder; ValueError when the folder cannot answer."""
    from mhmoe.checkpoint.layout import RESULTS_FILE
    from mhmoe.research.suites import suite_settings
    from mhmoe.research.tables import primary_set
    from mhmoe.runtime.files import atomic_write
    from mhmoe.runtime.reading import read_json, regular_or_missing

    path = Path(suite_dir) / RESULTS_FILE
    if not regular_or_missing(path):  # a symlink, a FIFO, a directory: one line naming it
        raise ValueError(f"{suite_dir}: no results.json (run `mhmoe reproduce decisive-pilot --out {suite_dir}` first)")
    data = read_json(path, follow=False, what=RESULTS_FILE)
    runs, suite = data.get("runs") or [], str(data.get("title", ""))
    if not any(r.get("curve") for r in runs):
        raise ValueError(f"{path}: no per-seed evaluation curves (written by an older mhmoe: `mhmoe reproduce SUITE "
                         f"--out {suite_dir} --report-only` records them)")
    primary = suite_settings(suite).primary
    pair = pair or (primary[0] if primary else None)
    if pair is None:
        raise ValueError(f"suite {suite!r} names no primary comparison: give --pair A B")
    val_set = val_set or primary_set(runs)
    a, b = (curves_by_seed(runs, label, val_set) for label in pair)
    if len(set(a) & set(b)) < 2:
        raise ValueError(f"{path}: rows {pair[0]!r} and {pair[1]!r} share fewer than 2 seeds with {val_set!r} curves")
    res = {"suite": suite, "suite_dir": str(suite_dir), "pair": list(pair), "val_set": val_set,
           **power_analysis(a, b, gap, tuple(seeds), late_fraction=late_fraction)}
    train_tokens = next((r.get("train_tokens") for r in runs if r.get("train_tokens")), None)
    res["train_tokens"] = train_tokens
    for need in res["needs"]:
        t = need["tokens_per_run"]
        need["epochs"] = round(t / train_tokens, 3) if t and train_tokens else None
    atomic_write(Path(suite_dir) / "power.json", json.dumps(res, indent=1) + "\n")
    return res
