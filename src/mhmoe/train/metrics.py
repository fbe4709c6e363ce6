"""Run logging: ``metrics.jsonl`` / ``eval.jsonl`` (+ TensorBoard when installed) and the per-step routing
summary written into them (the progress bars: :mod:`mhmoe.train.progress`)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from mhmoe.checkpoint.layout import EVAL_FILE, METRICS_FILE, TB_DIR
from mhmoe.errors import UnsafePathError
from mhmoe.moe.layers import RoutingStats
from mhmoe.runtime.files import atomic_write, make_dirs, open_append
from mhmoe.runtime.reading import iter_lines, regular_or_missing


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
    files, a resumed one drops their lines past the resume step (logged after that checkpoint), and
    does not log again a step whose record it kept (the final evaluation of a finished run)."""

    def __init__(self, run_dir: Path, resume_step: int | None) -> None:
        self.run_dir, self.path = run_dir, run_dir / METRICS_FILE
        self.kept: dict[str, int] = {}  # file -> the last step of the records kept on resume
        for path in (self.path, run_dir / EVAL_FILE):  # never through a symlink (mhmoe.runtime.files)
            if resume_step is None:
                atomic_write(path, "", root=run_dir)
            elif os.path.islink(path):  # planted: not read (its target is not this run's log), replaced
                print(f"mhmoe: note: {path} is a symlink: not read, replaced by a log without its lines",
                      file=sys.stderr)
                atomic_write(path, "", root=run_dir)
            elif regular_or_missing(path):  # a FIFO, a device or a directory: refused in one line
                self.kept[path.name] = keep_logged(path, resume_step, run_dir)
        self.tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(make_dirs(run_dir / TB_DIR, root=run_dir)))
        except UnsafePathError:
            raise
        except Exception:  # tensorboard missing: jsonl only
            self.tb = None

    def log(self, record: dict[str, Any], file: str = METRICS_FILE) -> None:
        if record.get("step", 0) <= self.kept.get(file, -1):  # logged before the resume (a finished run resumed)
            return
        with open_append(self.run_dir / file, root=self.run_dir) as f:
            f.write((json.dumps(record) + "\n").encode("utf-8"))
        if self.tb is not None:
            prefix = "eval/" if file != METRICS_FILE else "train/"
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(prefix + k, v, record["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def keep_logged(path: Path, resume_step: int, run_dir: Path) -> int:
    """Rewrite the log ``path`` (atomically) with its records up to ``resume_step``, streamed line by line
    (memory bounded whatever its size; :func:`mhmoe.runtime.reading.iter_lines`); returns the last step
    kept (-1: none)."""
    last = -1

    def write(f: Any) -> None:
        nonlocal last
        for line in iter_lines(path, follow=False):
            step = logged_step(line)
            if step is not None and step <= resume_step:
                f.write(line + b"\n")
                last = max(last, step)

    atomic_write(path, write, root=run_dir)
    return last


def logged_step(line: str | bytes) -> int | None:
    """The step of one metrics/eval line; None for a blank or torn line (a crash mid-write)."""
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError, TypeError, RecursionError, OverflowError):
        return None
