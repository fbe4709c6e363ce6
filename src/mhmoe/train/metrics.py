"""Run logging: ``metrics.jsonl`` / ``eval.jsonl`` (+ TensorBoard when installed), the per-step routing
summary written into them, and the progress bar."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from mhmoe.moe.layers import RoutingStats


def sum_routing(acc: list[RoutingStats] | None, new: list[RoutingStats]) -> list[RoutingStats]:
    """Accumulate per-layer routing statistics over the micro-steps of one optimizer step."""
    if acc is None:
        return [RoutingStats(s.counts.clone(), s.tokens, s.dropped, dict(s.losses)) for s in new]
    for a, s in zip(acc, new, strict=True):
        a.counts += s.counts
        a.tokens += s.tokens
        a.dropped += s.dropped
        for k, v in s.losses.items():
            a.losses[k] = a.losses.get(k, 0.0) + v
    return acc


def routing_summary(stats: list[RoutingStats], n_micro: int) -> dict[str, Any]:
    """Expert-load statistics for metrics.jsonl (averaged over MoE layers)."""
    if not stats:
        return {}
    out: dict[str, Any] = {}
    for k in stats[0].losses:
        out[f"{k}_loss"] = sum(s.losses[k] for s in stats) / (len(stats) * n_micro)
    out["load_imbalance"] = sum(s.load_imbalance for s in stats) / len(stats)
    out["load_imbalance_per_layer"] = [round(s.load_imbalance, 4) for s in stats]
    slots = [max(1, int(s.counts.sum())) for s in stats]
    out["dropped_frac"] = sum(s.dropped for s in stats) / sum(slots)
    out["experts_used_frac"] = sum(float((s.counts > 0).float().mean()) for s in stats) / len(stats)
    return out


class MetricsWriter:
    """metrics.jsonl / eval.jsonl (+ TensorBoard when available) writer; a fresh run empties both
    files, a resumed one drops their lines past the resume step (logged after that checkpoint)."""

    def __init__(self, run_dir: Path, resume_step: int | None) -> None:
        self.path = run_dir / "metrics.jsonl"
        for path in (self.path, run_dir / "eval.jsonl"):
            if resume_step is not None and path.exists():
                lines = [(ln, logged_step(ln)) for ln in path.read_text(encoding="utf-8").splitlines()]
                keep = [ln for ln, s in lines if s is not None and s <= resume_step]
                tmp = path.with_suffix(".tmp")
                tmp.write_text("".join(ln + "\n" for ln in keep), encoding="utf-8")
                os.replace(tmp, path)
            elif resume_step is None:
                path.write_text("", encoding="utf-8")
        self.tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tb"))
        except Exception:  # tensorboard missing: jsonl only
            self.tb = None

    def log(self, record: dict[str, Any], file: str = "metrics.jsonl") -> None:
        with open(self.path.parent / file, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            prefix = "eval/" if file != "metrics.jsonl" else "train/"
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(prefix + k, v, record["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def logged_step(line: str) -> int | None:
    """The step of one metrics/eval line; None for a blank or torn line (a crash mid-write)."""
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError, TypeError):
        return None


def progress_bar(total: int, initial: int, enabled: bool):
    """A tqdm bar over optimizer steps on stderr (disabled: a no-op bar)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, unit="step", dynamic_ncols=True,
                file=sys.stderr, leave=False)
