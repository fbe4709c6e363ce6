"""Sub-token assign diversity of polysemous and monosemous tokens: an analogue of ICML Fig. 7.

The paper compares the number of distinct experts a token's sub-tokens are routed to for
polysemous / false-cognate tokens (picked by GPT-4) with the other tokens. Here the groups come from
WordNet (:func:`mhmoe.data.wordnet.wordnet_sense_counts`), occurrence by occurrence:

- a token occurrence is a **whole word** when its text, leading whitespace stripped, is ASCII letters
  only, it starts a word (its text starts with whitespace, or the previous token's text does not end
  with a letter) and it ends one (the next token's text does not start with a letter);
- a whole word is **polysemous** with at least ``min_senses`` WordNet senses (summed over parts of
  speech), **monosemous** with exactly one; every other occurrence (subwords, punctuation, numbers,
  words WordNet lacks such as function words, words with 2..min_senses-1 senses) is excluded and counted.

Per MoE layer (and for the mean over layers, as :func:`mhmoe.research.analysis.summarize` averages
it) the report gives each group's mean assign diversity, the difference, and three permutation-test
p-values of that difference (two-sided, ``(1 + #{|d_perm| >= |d|}) / (1 + n_perm)``, so never below
1 / (1 + n_perm)): ``p_value`` permutes the group labels over occurrences; ``p_value_types`` over word
*types* (each word's mean over its occurrences), which does not treat repeated occurrences of a word as
independent; ``p_value_types_frequency_strata`` over word types within strata of equal
floor(log2(occurrences)), since frequent words are both more often polysemous and routed differently
(a difference that only reflects frequency is not significant there). Beside them: the same group means under
uniformly random routing of the same tokens (:func:`mhmoe.research.analysis.random_routing`) and its
expectation E(1-(1-K/E)^H). With h=1 (SMoE, X-MoE) every token reaches top_k distinct experts by
construction and the comparison is trivial; the report says so.

Shapes: L MoE layers, T tokens analysed (in the order of the routing records), W word types.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from mhmoe.research.analysis import (
    RoutingRecord,
    assign_diversity,
    expected_random_diversity,
    random_routing,
)
from mhmoe.runtime.files import atomic_write, make_dirs

POLYSEMOUS, MONOSEMOUS, EXCLUDED = 1, 0, -1
GROUPS = {"polysemous": POLYSEMOUS, "monosemous": MONOSEMOUS}
TRIVIAL_NOTE = ("h=1: every token's top_k slots are distinct experts, so its assign diversity is top_k by "
                "construction (fewer only where capacity drops a slot); the comparison is trivial")


def _letters(text: str) -> bool:
    return text.isascii() and text.isalpha()


def whole_words(texts: list[str]) -> list[str | None]:
    """texts: the decoded text of every token of a stream [T] -> the lower-cased word each token spells
    on its own (module docstring), or None."""
    out: list[str | None] = []
    for i, text in enumerate(texts):
        word = text.lstrip()
        prev = texts[i - 1] if i > 0 else " "
        nxt = texts[i + 1] if i + 1 < len(texts) else " "
        starts = text[:1].isspace() or not prev[-1:].isalpha()
        ends = not nxt[:1].isalpha()
        out.append(word.lower() if word and _letters(word) and starts and ends else None)
    return out


def classify_tokens(ids: Tensor, decode: Callable[[list[int]], str], senses: dict[str, int],
                    min_senses: int) -> tuple[Tensor, list[str | None], dict]:
    """ids [T] -> group [T] (POLYSEMOUS / MONOSEMOUS / EXCLUDED), the word of every token, and the
    counts of each exclusion reason."""
    vocab = {i: decode([i]) for i in torch.unique(ids).tolist()}
    words = whole_words([vocab[i] for i in ids.tolist()])
    group = torch.full((len(words),), EXCLUDED, dtype=torch.long)
    why = {"not_a_whole_word": 0, "not_in_wordnet": 0, f"2_to_{min_senses - 1}_senses": 0}
    for t, w in enumerate(words):
        n = senses.get(w, 0) if w else 0
        if n >= min_senses:
            group[t] = POLYSEMOUS
        elif n == 1:
            group[t] = MONOSEMOUS
        else:
            key = "not_a_whole_word" if w is None else "not_in_wordnet" if n == 0 else f"2_to_{min_senses - 1}_senses"
            why[key] += 1
    return group, words, why


def _mean(x: Tensor) -> float | None:
    """Mean of a 1-D tensor; None (JSON null) when it is empty."""
    return float(x.double().mean()) if x.numel() else None


def permutation_pvalue(values: Tensor, labels: Tensor, n_perm: int, generator: torch.Generator,
                       strata: Tensor | None = None, chunk_elems: int = 4_000_000) -> float:
    """Two-sided permutation test of mean(values[labels]) - mean(values[~labels]); values [n] float,
    labels [n] bool. With ``strata`` [n] (integers) the labels are permuted within each stratum only.
    Permutations are drawn in chunks of [c, n]: argsort of stratum + uniform noise keeps every stratum's
    block of positions and shuffles it."""
    n, k = values.numel(), int(labels.sum())
    if k == 0 or k == n:
        return 1.0
    v = values.double()
    strata = torch.zeros(n) if strata is None else strata.double()
    base = torch.argsort(strata, stable=True)  # position j of a sorted order holds stratum strata[base[j]]
    chosen = labels[base]  # the sorted positions whose labels are True
    total = float(v.sum())
    observed = abs(float(v[labels].mean() - v[~labels].mean()))
    hits, done, per = 0, 0, max(1, chunk_elems // n)
    while done < n_perm:
        c = min(per, n_perm - done)
        perm = torch.argsort(strata + torch.rand(c, n, generator=generator, dtype=torch.float64) * 0.5, dim=1)
        s = v[perm[:, chosen]].sum(1)
        diff = (s / k - (total - s) / (n - k)).abs()
        hits += int((diff >= observed - 1e-12).sum())
        done += c
    return (1 + hits) / (1 + n_perm)


def type_means(values: Tensor, words: list[str | None], group: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """values [T] -> (mean over the occurrences of every grouped word type [W], its group [W], its
    number of occurrences [W])."""
    index: dict[str, int] = {}
    idx = torch.tensor([index.setdefault(w, len(index)) if g != EXCLUDED and w else -1
                        for w, g in zip(words, group.tolist(), strict=True)], dtype=torch.long)
    keep = idx >= 0
    sums = torch.zeros(len(index), dtype=torch.float64).index_add_(0, idx[keep], values[keep].double())
    counts = torch.bincount(idx[keep], minlength=len(index)).double()
    type_group = torch.full((len(index),), EXCLUDED, dtype=torch.long)
    type_group[idx[keep]] = group[keep]
    return sums / counts.clamp_min(1), type_group, counts


def compare_groups(values: Tensor, group: Tensor, words: list[str | None], n_perm: int, seed: int) -> dict:
    """values [T] (one layer's diversity, or the mean over layers) -> group means, std, difference
    (polysemous - monosemous) and the occurrence- and type-level permutation p-values."""
    gen = torch.Generator().manual_seed(seed)
    sel = group != EXCLUDED
    v, poly = values[sel].double(), group[sel] == POLYSEMOUS
    out: dict = {}
    for name, mask in (("polysemous", poly), ("monosemous", ~poly)):
        out[f"{name}_mean"] = _mean(v[mask])
        out[f"{name}_std"] = float(v[mask].std()) if int(mask.sum()) > 1 else 0.0
    both = None not in (out["polysemous_mean"], out["monosemous_mean"])
    out["difference"] = out["polysemous_mean"] - out["monosemous_mean"] if both else None
    out["p_value"] = permutation_pvalue(v, poly, n_perm, gen)
    tv, tg, counts = type_means(values, words, group)
    out["p_value_types"] = permutation_pvalue(tv, tg == POLYSEMOUS, n_perm, gen)
    out["p_value_types_frequency_strata"] = permutation_pvalue(tv, tg == POLYSEMOUS, n_perm, gen,
                                                               strata=frequency_strata(counts))
    return out


def frequency_strata(counts: Tensor) -> Tensor:
    """[W] occurrences -> [W] stratum floor(log2(occurrences)): 1, 2-3, 4-7, ... (frequent words are more
    often polysemous; permuting within a stratum keeps each group's frequency profile)."""
    return torch.log2(counts.clamp_min(1)).floor().long()


def random_group_means(records: list[RoutingRecord], group: Tensor, seed: int) -> list[dict]:
    """Per layer: each group's mean diversity under uniformly random routing of the same T tokens."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for r in records:
        e = random_routing(group.numel(), r.heads, r.top_k, r.n_experts, gen)
        d = assign_diversity(e, torch.ones_like(e, dtype=torch.bool)).double()
        out.append({f"random_{name}_mean": _mean(d[group == g]) for name, g in GROUPS.items()}
                   | {"expected_random": expected_random_diversity(r.n_experts, r.heads, r.top_k)})
    return out


def histogram(values: Tensor, group: Tensor) -> dict:
    """Fraction of each group's tokens at every value of ``values`` [T] (rounded to 3 decimals)."""
    grid = sorted(set(np.round(values[group != EXCLUDED].numpy(), 3).tolist()))
    out: dict = {"values": grid}
    for name, g in GROUPS.items():
        v = np.round(values[group == g].numpy(), 3)
        out[name] = [float((v == x).mean()) if v.size else 0.0 for x in grid]
    return out


def examples(words: list[str | None], group: Tensor, senses: dict[str, int], top: int = 12) -> dict:
    """The most frequent words of each group: [word, senses, occurrences]."""
    out = {}
    for name, g in GROUPS.items():
        ws, n = np.unique([w for w, k in zip(words, group.tolist(), strict=True) if k == g], return_counts=True)
        order = np.argsort(-n, kind="stable")[:top]
        out[name] = [[str(ws[i]), senses[str(ws[i])], int(n[i])] for i in order]
    return out


def polysemy_statistics(records: list[RoutingRecord], token_ids: list[Tensor], decode: Callable[[list[int]], str],
                        senses: dict[str, int], min_senses: int = 3, n_perm: int = 2000, seed: int = 0) -> dict:
    """The report's numbers (module docstring) as a JSON-serialisable dict; ``records`` and ``token_ids``
    as :func:`mhmoe.research.analysis.collect_routing` returns them."""
    if min_senses < 2:
        raise ValueError(f"min_senses must be >= 2 (got {min_senses}): 1 sense is the monosemous group")
    ids = torch.cat(token_ids) if token_ids else torch.zeros(0, dtype=torch.long)
    group, words, why = classify_tokens(ids, decode, senses, min_senses)
    div = torch.stack([torch.cat(r.diversity).double() for r in records])  # [L, T]
    layers = [{"layer": i} | compare_groups(d, group, words, n_perm, seed + i) | rnd
              for i, (d, rnd) in enumerate(zip(div, random_group_means(records, group, seed), strict=True))]
    mean = compare_groups(div.mean(0), group, words, n_perm, seed + len(records))
    for key in ("random_polysemous_mean", "random_monosemous_mean", "expected_random"):
        vals = [lay[key] for lay in layers if lay[key] is not None]
        mean[key] = float(np.mean(vals)) if vals else None
    r0 = records[0]
    out = {"min_senses": min_senses, "permutations": n_perm, "seed": seed, "tokens_analysed": int(ids.numel()),
           "n_experts": r0.n_experts, "heads": r0.heads, "top_k": r0.top_k,
           "max_possible_diversity": min(r0.n_experts, r0.slots_per_token),
           "tokens": {name: int((group == g).sum()) for name, g in GROUPS.items()} | {"excluded": why},
           "word_types": {name: len({w for w, k in zip(words, group.tolist(), strict=True) if k == g})
                          for name, g in GROUPS.items()},
           "layers": layers, "mean_over_layers": mean, "histogram_mean_over_layers": histogram(div.mean(0), group),
           "examples": examples(words, group, senses)}
    if r0.heads == 1:
        out["note"] = TRIVIAL_NOTE
    return out


def polysemy_report(records: list[RoutingRecord], token_ids: list[Tensor], decode: Callable[[list[int]], str],
                    out_dir: str | Path, min_senses: int = 3, senses: dict[str, int] | None = None,
                    n_perm: int = 2000, seed: int = 0) -> dict:
    """Write ``polysemy.json`` and ``polysemy.png`` into ``out_dir`` and return the statistics;
    ``senses`` defaults to the installed WordNet's."""
    from mhmoe.data.wordnet import wordnet_sense_counts
    from mhmoe.research.analysis_plots import polysemy_figure
    from mhmoe.train.plot_style import save_figure

    senses = wordnet_sense_counts() if senses is None else senses
    stats = polysemy_statistics(records, token_ids, decode, senses, min_senses, n_perm, seed)
    out = make_dirs(out_dir, root=Path(out_dir).parent)
    atomic_write(out / "polysemy.json", json.dumps(stats, indent=1) + "\n")
    save_figure(polysemy_figure(stats), out / "polysemy.png", dpi=120)
    return stats
