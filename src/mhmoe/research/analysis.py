"""Routing analysis behind the papers' figures: expert activation (ICML Fig. 1/5), sub-token assign
diversity (ICML Fig. 7), router entropy and load imbalance per MoE layer.

Shape legend: L MoE layers, E experts, T tokens analysed, H heads, K top-k; a token's H sub-tokens
give it H*K (expert) slots.

Definitions (pure functions, tested on hand-made routing decisions):

- **activation frequency** of expert e in a layer = (number of slots routed to e) / (number of
  tokens), as the ICML paper defines it ("the ratio of each expert's selection frequency ... to the
  total number of tokens"); an expert is *activated* when its frequency exceeds ``threshold``; the
  *activation ratio* is the fraction of (layer, expert) pairs that are activated. For MH-MoE the
  selections of all H sub-tokens count, which is the paper's point.
- **assign diversity** of a token = number of distinct experts its H*K slots reach in a layer,
  averaged over layers.
- **router entropy** = mean over routed (sub-)tokens of the gate distribution's entropy (nats);
  **load imbalance** = max / mean expert load.

Every number needs its chance level beside it. Under uniformly random routing (each sub-token picks
K distinct experts uniformly) an expert's expected frequency is **H*K/E** selections per token, so a
model with more slots per token clears a fixed activation threshold more easily by construction, and
a token's expected assign diversity is **E * (1 - (1 - K/E)^H)** (3.90 for H=K=2, E=41; 8.71 for
H=K=3, E=93). :func:`summarize` reports both, and the same statistics measured on simulated random
routing of as many tokens (``random_routing``).
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from mhmoe.runtime.files import atomic_write, make_dirs
from mhmoe.runtime.reading import read_json, regular_or_missing


def activation_frequency(experts: Tensor, valid: Tensor, n_experts: int, n_tokens: int) -> Tensor:
    """[E] selections per token: slots routed to each expert / number of tokens."""
    counts = torch.bincount(experts[valid], minlength=n_experts).double()
    return counts / max(1, n_tokens)


def activation_ratio(freq: Tensor, threshold: float) -> float:
    """Fraction of entries of ``freq`` ([L, E] or [E]) above ``threshold``."""
    return float((freq > threshold).double().mean())


def assign_diversity(experts: Tensor, valid: Tensor) -> Tensor:
    """experts, valid: [T, H*K] per token -> [T] number of distinct valid experts per token."""
    big = int(experts.max()) + 1 if experts.numel() else 1
    e = torch.where(valid, experts, big + torch.arange(experts.shape[1], device=experts.device))  # invalid: unique
    s, _ = torch.sort(e, dim=1)
    distinct = torch.ones_like(s[:, :1]) + (s[:, 1:] != s[:, :-1]).sum(1, keepdim=True)
    return (distinct.squeeze(1) - (~valid).sum(1)).clamp_min(0)


def router_entropy(probs: Tensor, mask: Tensor) -> float:
    p = probs[mask].double()
    if p.numel() == 0:
        return 0.0
    return float(-(p * (p + 1e-30).log()).sum(-1).mean())


def load_imbalance(counts: Tensor) -> float:
    c = counts.double()
    return float(c.max() / c.mean()) if c.numel() and float(c.mean()) > 0 else 1.0


def uniform_frequency(n_experts: int, heads: int, top_k: int) -> float:
    """Expected selections per token of every expert under uniform routing: H*K/E."""
    return heads * top_k / n_experts


def expected_random_diversity(n_experts: int, heads: int, top_k: int) -> float:
    """Expected distinct experts per token when each of its H sub-tokens picks K distinct experts
    uniformly at random: an expert is missed by one sub-token with probability 1 - K/E."""
    return n_experts * (1 - (1 - top_k / n_experts) ** heads)


def random_routing(n_tokens: int, heads: int, top_k: int, n_experts: int, generator: torch.Generator) -> Tensor:
    """[T, H*K] expert ids of uniformly random routing: every sub-token picks K distinct experts."""
    scores = torch.rand(n_tokens * heads, n_experts, generator=generator)
    return scores.topk(top_k, dim=-1).indices.reshape(n_tokens, heads * top_k)


def random_baseline(records: list[RoutingRecord], threshold: float, seed: int = 0) -> dict:
    """The statistics of :func:`summarize` for uniformly random routing of the same layers and tokens."""
    gen = torch.Generator().manual_seed(seed)
    freq, div, imbalance = [], [], []
    for r in records:
        e = random_routing(r.tokens, r.heads, r.top_k, r.n_experts, gen)
        valid = torch.ones_like(e, dtype=torch.bool)
        freq.append(activation_frequency(e, valid, r.n_experts, r.tokens))
        div.append(assign_diversity(e, valid).double())
        imbalance.append(load_imbalance(freq[-1]))
    return {
        "activation_ratio": activation_ratio(torch.stack(freq), threshold) if freq else 0.0,
        "mean_assign_diversity": float(torch.stack(div).mean()) if div else 0.0,
        "expected_assign_diversity_per_layer": [expected_random_diversity(r.n_experts, r.heads, r.top_k)
                                                for r in records],
        "load_imbalance_per_layer": imbalance,
    }


@dataclass
class RoutingRecord:
    """Accumulated routing of one MoE layer over the analysed tokens."""

    n_experts: int
    slots_per_token: int  # H * K
    counts: Tensor
    top_k: int = 1  # K slots per routed (sub-)token
    tokens: int = 0
    entropy_sum: float = 0.0
    entropy_n: int = 0
    diversity: list[Tensor] = field(default_factory=list)  # [T] per batch

    @property
    def heads(self) -> int:
        """H routed sub-tokens per token."""
        return self.slots_per_token // self.top_k


@torch.no_grad()
def collect_routing(model, batches, device: torch.device | str = "cpu") -> tuple[list[RoutingRecord], list[Tensor]]:
    """Run ``model`` on (x, y) batches and collect per-layer routing records and the token ids."""
    model.eval()
    records: list[RoutingRecord] = []
    token_ids: list[Tensor] = []
    for x, _ in batches:
        x = x.to(device)
        out = model(x, return_routing=True)
        token_ids.append(x.reshape(-1).cpu())
        for i, f in enumerate(out.layer_outputs or []):
            r = f.route
            n_tok = x.numel()
            if len(records) <= i:
                records.append(RoutingRecord(r.probs.shape[1], r.experts.numel() // n_tok,
                                             torch.zeros(r.probs.shape[1], dtype=torch.float64), r.top_k))
            rec = records[i]
            rec.counts += torch.bincount(r.experts[r.valid].cpu(), minlength=rec.n_experts).double()
            rec.tokens += n_tok
            m = r.token_mask.cpu()
            rec.entropy_sum += router_entropy(r.probs.cpu(), m) * int(m.sum())
            rec.entropy_n += int(m.sum())
            per_tok = r.experts.cpu().reshape(n_tok, -1)
            rec.diversity.append(assign_diversity(per_tok, r.valid.cpu().reshape(n_tok, -1)))
    return records, token_ids


def summarize(records: list[RoutingRecord], threshold: float) -> dict:
    """Per-model routing statistics with their chance levels: ``uniform_frequency_per_layer`` (H*K/E)
    and ``random_routing`` (the same statistics for uniformly random routing of the same tokens)."""
    freq = torch.stack([r.counts / max(1, r.tokens) for r in records]) if records else torch.zeros(0, 0)
    div = torch.stack([torch.cat(r.diversity).double() for r in records]).mean(0) if records else torch.zeros(0)
    return {
        "threshold": threshold,
        "activation_ratio": activation_ratio(freq, threshold) if freq.numel() else 0.0,
        "activation_ratio_per_layer": [activation_ratio(f, threshold) for f in freq],
        "uniform_frequency_per_layer": [uniform_frequency(r.n_experts, r.heads, r.top_k) for r in records],
        "min_frequency_per_layer": [float(f.min()) for f in freq],
        "router_entropy_per_layer": [r.entropy_sum / max(1, r.entropy_n) for r in records],
        "load_imbalance_per_layer": [load_imbalance(r.counts) for r in records],
        "mean_assign_diversity": float(div.mean()) if div.numel() else 0.0,
        "max_possible_diversity": max((min(r.n_experts, r.slots_per_token) for r in records), default=0),
        "n_experts": records[0].n_experts if records else 0,
        "heads": records[0].heads if records else 0,
        "top_k": records[0].top_k if records else 0,
        "random_routing": random_baseline(records, threshold),
        "frequency": freq,
        "diversity": div,
    }


def write_report(summary: dict, token_ids: list[Tensor], decode, out_dir: str | Path, top: int = 20) -> dict:
    """Write activation.png/csv, diversity.png/csv (:mod:`mhmoe.research.analysis_plots`) and summary.json
    into ``out_dir``."""
    from mhmoe.research.analysis_plots import activation_figure, diversity_figure
    from mhmoe.train.plot_style import save_figure

    out = make_dirs(out_dir, root=Path(out_dir).parent)  # RUN/analysis: refused if it is a symlink
    freq: Tensor = summary.pop("frequency")
    div: Tensor = summary.pop("diversity")
    buf = io.StringIO(newline="")
    w = csv.writer(buf)
    w.writerow(["layer"] + [f"expert_{e}" for e in range(freq.shape[1] if freq.numel() else 0)])
    for i, row in enumerate(freq.tolist()):
        w.writerow([i] + [f"{v:.6g}" for v in row])
    atomic_write(out / "activation.csv", buf.getvalue())
    save_figure(activation_figure(freq.numpy(), summary), out / "activation.png", dpi=120)
    ids = torch.cat(token_ids) if token_ids else torch.zeros(0, dtype=torch.long)
    values, counts = np.unique(div.numpy().round(3), return_counts=True) if div.numel() else ([], [])
    buf = io.StringIO(newline="")
    w = csv.writer(buf)
    w.writerow(["mean_distinct_experts", "tokens"])
    w.writerows(zip(values, counts, strict=True))
    atomic_write(out / "diversity.csv", buf.getvalue())
    save_figure(diversity_figure(div.numpy(), summary), out / "diversity.png", dpi=120)
    if div.numel():
        order = torch.argsort(div, descending=True, stable=True)
        pick = lambda idx: [{"token": decode([int(ids[i])]), "diversity": float(div[i])} for i in idx]  # noqa: E731
        summary["highest_diversity_tokens"] = pick(order[:top].tolist())
        summary["lowest_diversity_tokens"] = pick(order.flip(0)[:top].tolist())
    summary["tokens_analysed"] = int(ids.numel())
    atomic_write(out / "summary.json", json.dumps(summary, indent=2, default=float))
    return summary


def analyze_checkpoint(checkpoint: str, out_dir: str, data: str | None = None, batches: int = 8,
                       threshold: float = 0.01, device: str = "cpu", extras: dict[str, Callable] | None = None) -> dict:
    """Analyse routing of a checkpoint on held-out text (the training corpus's validation split, or
    ``data``: a corpus name or path, tokenised with the checkpoint's tokenizer). Each ``extras[name]``
    is called as ``fn(records, token_ids, decode, out_dir)`` (e.g. :func:`mhmoe.research.polysemy.polysemy_report`)
    and its result returned under ``name``."""
    from mhmoe.config.data import DataConfig
    from mhmoe.data import iter_eval_batches, prepare_data
    from mhmoe.loading.checkpoint import load_latest

    ck = load_latest(checkpoint, device)
    cfg = ck.run.train
    dcfg = ck.run.data if data is None else DataConfig(**{**ck.run.data.__dict__, "corpus": data, "val_sets": ()})
    prepared = prepare_data(dcfg, seq_len=cfg.seq_len, tokenizer=ck.tokenizer)
    val = next(iter(prepared.val.values()))
    it = iter_eval_batches(val, batch_size=cfg.batch_size, seq_len=cfg.seq_len, max_batches=batches)
    records, ids = collect_routing(ck.model, it, device)
    if not records:
        raise ValueError(f"checkpoint {ck.path} has no MoE layers to analyse (dense model)")
    summary = summarize(records, threshold)
    summary["checkpoint"] = str(ck.path)
    summary = write_report(summary, ids, ck.tokenizer.decode, out_dir)
    for name, fn in (extras or {}).items():
        summary[name] = fn(records, ids, ck.tokenizer.decode, out_dir)
    return summary



# ---- a whole suite (``mhmoe analyze --suite DIR``) --------------------------------------------------------
SUITE_STATS = {  # name -> (how to read it from one checkpoint's summary, decimals)
    "activation_ratio": (lambda s: s["activation_ratio"], 3),
    "random_activation_ratio": (lambda s: s["random_routing"]["activation_ratio"], 3),
    "uniform_frequency": (lambda s: float(np.mean(s["uniform_frequency_per_layer"])), 3),
    "min_frequency": (lambda s: min(s["min_frequency_per_layer"]), 3),
    "assign_diversity": (lambda s: s["mean_assign_diversity"], 2),
    "random_assign_diversity": (lambda s: s["random_routing"]["mean_assign_diversity"], 2),
    "expected_random_diversity": (lambda s: float(np.mean(s["random_routing"]["expected_assign_diversity_per_layer"])),
                                  2),
    "router_entropy": (lambda s: float(np.mean(s["router_entropy_per_layer"])), 2),
    "load_imbalance": (lambda s: float(np.mean(s["load_imbalance_per_layer"])), 2),
    "random_load_imbalance": (lambda s: float(np.mean(s["random_routing"]["load_imbalance_per_layer"])), 2),
}


def _suite_runs(suite_dir: Path) -> list[tuple[str, Path]]:
    """(label, run dir) of every finished run of a ``mhmoe reproduce`` folder (in the run store or, in an
    older folder, below it: :func:`mhmoe.research.store.suite_run_dirs`), in its table's order."""
    from mhmoe.research.reproduce import run_dir_name
    from mhmoe.research.store import suite_run_dirs

    summary = suite_dir / "summary.json"  # a symlink, a FIFO, an oversized file: one line naming it
    labels = ([r["label"] for r in read_json(summary, follow=False, what="summary.json")["rows"]]
              if regular_or_missing(summary) else [])
    by_dir = {run_dir_name(label): label for label in labels}
    runs = [(by_dir.get(label, label), seed, d) for label, seed, d in suite_run_dirs(suite_dir)]
    order = {label: i for i, label in enumerate(labels)}
    return [(label, d) for label, _, d in sorted(runs, key=lambda r: (order.get(r[0], len(order)), r[0], r[1]))]


def analyze_suite(suite_dir: str | Path, batches: int = 8, threshold: float = 0.01, device: str = "cpu") -> dict:
    """Analyse every finished MoE run of a suite folder (each into ``RUN/analysis``) and write
    ``SUITE/analysis.json``: per model, the mean and std over seeds of every :data:`SUITE_STATS` entry,
    rounded as printed, beside its random-routing baseline."""
    from mhmoe.checkpoint.layout import ANALYSIS_DIR, CONFIG_FILE
    from mhmoe.config.run import RunConfig

    root = Path(suite_dir)
    per_label: dict[str, list[dict]] = {}
    for label, run_dir in _suite_runs(root):
        if RunConfig.load(run_dir / CONFIG_FILE).model.moe.kind == "dense":
            continue
        per_label.setdefault(label, []).append(analyze_checkpoint(str(run_dir), str(run_dir / ANALYSIS_DIR), None,
                                                                  batches, threshold, device))
    if not per_label:
        raise ValueError(f"{root}: no finished MoE runs to analyse (its results.json lists none found here)")
    rows = []
    for label, summaries in per_label.items():
        first = summaries[0]
        row: dict = {"label": label, "seeds": len(summaries), "tokens_analysed": first["tokens_analysed"],
                     "moe_layers": len(first["load_imbalance_per_layer"]), "n_experts": first["n_experts"],
                     "heads": first["heads"], "top_k": first["top_k"],
                     "log_n_experts": round(math.log(first["n_experts"]), 2),
                     "max_possible_diversity": first["max_possible_diversity"]}
        for name, (read, digits) in SUITE_STATS.items():
            v = [float(read(s)) for s in summaries]
            row[name] = {"mean": round(float(np.mean(v)), digits),
                         "std": round(float(np.std(v, ddof=1)), digits) if len(v) > 1 else 0.0}
        rows.append(row)
    out = {"suite_dir": str(root), "threshold": threshold, "batches": batches, "rows": rows}
    atomic_write(root / "analysis.json", json.dumps(out, indent=1) + "\n")
    return out
