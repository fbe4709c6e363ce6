"""Run logging: ``metrics.jsonl`` / ``eval.jsonl`` (+ TensorBoard when installed) and the per-step routing
summary written into them (the progress bars: :mod:`mhmoe.train.progress`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mhmoe.errors import UnsafePathError
from mhmoe.moe.layers import RoutingStats
from mhmoe.runtime.files import atomic_write, make_dirs, open_append


def sum_routing(acc: list[RoutingStats] | None, new: list[RoutingStats]) -> list[RoutingStats]:
    """Per-layer routing statistics summed over the micro-steps of one optimizer step (device tensors)."""
    return list(new) if acc is None else [a + s for a, s in zip(acc, new, strict=True)]


def routing_summary(stats: list[RoutingStats], n_micro: int) -> dict[str, Any]:
    """Expert-load statistics for metrics.jsonl (averaged over MoE layers). Reads the device once."""
    if not stats:
        return {}
    names = list(stats[0].losses)
    per_layer = torch.stack([torch.stack([
        *(s.losses[k].float() for k in names), s.counts.float().max() / s.counts.float().mean().clamp_min(1e-9),
        s.dropped.float(), s.counts.sum().float().clamp_min(1), (s.counts > 0).float().mean()]) for s in stats])
    rows = per_layer.tolist()  # the one host sync
    n = len(rows)
    out: dict[str, Any] = {f"{k}_loss": sum(r[i] for r in rows) / (n * n_micro) for i, k in enumerate(names)}
    j = len(names)
    out["load_imbalance"] = sum(r[j] for r in rows) / n
    out["load_imbalance_per_layer"] = [round(r[j], 4) for r in rows]
    out["dropped_frac"] = sum(r[j + 1] for r in rows) / sum(r[j + 2] for r in rows)
    out["experts_used_frac"] = sum(r[j + 3] for r in rows) / n
    return out


class MetricsWriter:
    """metrics.jsonl / eval.jsonl (+ TensorBoard when available) writer; a fresh run empties both
    files, a resumed one drops their lines past the resume step (logged after that checkpoint)."""

    def __init__(self, run_dir: Path, resume_step: int | None) -> None:
        self.run_dir, self.path = run_dir, run_dir / "metrics.jsonl"
        for path in (self.path, run_dir / "eval.jsonl"):  # never through a symlink (mhmoe.runtime.files)
            if resume_step is not None and path.exists():
                lines = [(ln, logged_step(ln)) for ln in path.read_text(encoding="utf-8").splitlines()]
                keep = [ln for ln, s in lines if s is not None and s <= resume_step]
                atomic_write(path, "".join(ln + "\n" for ln in keep), root=run_dir)
            elif resume_step is None:
                atomic_write(path, "", root=run_dir)
        self.tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(make_dirs(run_dir / "tb", root=run_dir)))
        except UnsafePathError:
            raise
        except Exception:  # tensorboard missing: jsonl only
            self.tb = None

    def log(self, record: dict[str, Any], file: str = "metrics.jsonl") -> None:
        with open_append(self.run_dir / file, root=self.run_dir) as f:
            f.write((json.dumps(record) + "\n").encode("utf-8"))
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
    except (ValueError, AttributeError, TypeError, RecursionError):
        return None
