"""The run store: every run a suite trains is kept once, under the hash of what it computes, so that
suites sharing a model (under any label) reuse the finished run instead of training it again::

    STORE/runs/<key>/         the run directory (config.yaml, metrics.jsonl, eval.jsonl, checkpoints/, ...)
    RECORDS/<key>.json        the run's record (default RECORDS = STORE/records): small, self-contained,
                              meant to be committed; a suite reports from records alone

``key`` is the first 16 hex digits of the sha256 of the run's *identity*: its resolved config (model, training,
data, seed, steps -- so the token budget) without the fields that do not change what it computes
(:data:`BOOKKEEPING`: logging, evaluation and checkpoint intervals, threads, device, parallel layout, activation
checkpointing, cache directory; the preset name; the vocabulary size, which the tokenizer sets). A record holds
the identity, the full config, the run's ``results.json``, its evaluation curve (every evaluation: step, tokens
seen, loss per validation set), a thinned training-loss curve, the corpus's training tokens and the epochs
trained, the data version (training tokens and the tokenizer's fingerprint: a corpus read from installed
packages differs between machines whose package versions differ), and the environment of the process that
trained it (:mod:`mhmoe.research.provenance`; null when the record was written later from a finished run
directory).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from mhmoe.checkpoint.layout import CONFIG_FILE, EVAL_FILE, METRICS_FILE, RESULTS_FILE
from mhmoe.config.run import RunConfig
from mhmoe.runtime.bounded import MAX_JSON_CHARS, BoundedLoadError, load_json
from mhmoe.runtime.files import atomic_write
from mhmoe.runtime.reading import read_json, read_text, regular_or_missing, symlink_refused

#: fields that do not change what a run computes (launch properties and logging), ignored by the key
BOOKKEEPING = {"log_every", "eval_every", "eval_batches", "ckpt_every", "keep_last", "threads", "device", "parallel",
               "ep", "cache_dir", "activation_checkpointing"}
IGNORED = ("name", "model.vocab_size")
#: fields added to the config after run records were first written, with the value every older run had: left out
#: of the identity at that value, so that the keys and records of older runs stay valid
ADDED_FIELDS = {"model.moe.router_dtype": "float32", "train.cooldown_fraction": 0.2, "train.cooldown_shape": "1-sqrt",
                "model.n_kv_heads": 0, "model.qk_norm": False}
RECORD_FORMAT = 1
TRAIN_CURVE_POINTS = 400  # the record keeps at most this many training-loss points


def flat(d: dict, prefix: str = "") -> dict:
    """``{"train": {"lr": x}}`` -> ``{"train.lr": x}``."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        out.update(flat(v, key + ".") if isinstance(v, dict) else {key: v})
    return out


def identity(run: RunConfig) -> dict[str, Any]:
    """What a run computes: its flat config without :data:`BOOKKEEPING` and :data:`IGNORED` fields, nor
    :data:`ADDED_FIELDS` at their old value (tuples as lists, so that it equals its JSON round trip)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in sorted(flat(run.to_dict()).items())
            if k.split(".")[-1] not in BOOKKEEPING and k not in IGNORED
            and not (k in ADDED_FIELDS and v == ADDED_FIELDS[k])}


def run_key(run: RunConfig) -> str:
    """The store key of ``run``: sha256 of its canonical identity JSON, 16 hex digits."""
    text = json.dumps(identity(run), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def first_difference(old: dict, new: dict) -> str | None:
    """``"train.lr: 0.001 there, 0.002 now"`` for the first identity field that differs, else None."""
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            return f"{key}: {old.get(key)!r} there, {new.get(key)!r} now"
    return None


def eval_curve(run_dir: Path, tokens_per_step: int) -> list[dict]:
    """Every evaluation of a run directory's ``eval.jsonl``, one per step (the last line of a step wins):
    ``{"step", "tokens", "loss": {set: nats}}``, sorted by step."""
    from mhmoe.train.plots import read_jsonl

    by_step: dict[int, dict] = {}
    for rec in read_jsonl(run_dir / EVAL_FILE):
        loss = {k[:-5]: float(v) for k, v in rec.items() if k.endswith("_loss") and isinstance(v, (int, float))}
        loss = loss or {k[:-4]: math.log(v) for k, v in rec.items()  # a log without losses: ln(perplexity)
                        if k.endswith("_ppl") and isinstance(v, (int, float)) and v > 0}
        if loss and isinstance(rec.get("step"), int):
            by_step[rec["step"]] = {"step": rec["step"], "tokens": rec["step"] * tokens_per_step, "loss": loss}
    return [by_step[s] for s in sorted(by_step)]


def train_curve(run_dir: Path, points: int = TRAIN_CURVE_POINTS) -> list[list[float]]:
    """``[[step, loss], ...]`` from ``metrics.jsonl``, thinned to at most ``points`` (the last one kept)."""
    from mhmoe.train.plots import read_jsonl

    rows = [[int(r["step"]), float(r["loss"])] for r in read_jsonl(run_dir / METRICS_FILE)
            if isinstance(r.get("loss"), (int, float))]
    if len(rows) <= points:
        return rows
    every = -(-len(rows) // points)
    return rows[::every] + ([rows[-1]] if (len(rows) - 1) % every else [])


class RunStore:
    """Run directories and records under ``root`` (records in ``records``, default ``root/records``)."""

    def __init__(self, root: str | Path, records: str | Path | None = None) -> None:
        self.root = Path(root)
        self.records = Path(records) if records is not None else self.root / "records"

    def run_dir(self, key: str) -> Path:
        return self.root / "runs" / key

    def record_path(self, key: str) -> Path:
        return self.records / f"{key}.json"

    def load_record(self, run: RunConfig) -> dict | None:
        """The record of ``run`` if there is one for its key and identity (a damaged record or one whose
        identity differs is reported in one line and ignored)."""
        key = run_key(run)
        path = self.record_path(key)
        if not os.path.lexists(path):
            return None
        try:  # a symlink, a FIFO, a device or an oversized file is reported and ignored like a damaged one
            rec = read_json(path, follow=False, what="run record")
        except (OSError, BoundedLoadError) as exc:
            print(f"mhmoe: warning: ignoring run record {path}: {exc}", file=sys.stderr)
            return None
        if not isinstance(rec, dict) or not isinstance(rec.get("results"), dict):
            print(f"mhmoe: warning: ignoring run record {path}: not a run record", file=sys.stderr)
            return None
        diff = first_difference(rec.get("identity") or {}, identity(run))
        if diff:
            print(f"mhmoe: warning: ignoring run record {path}: another run ({diff})", file=sys.stderr)
            return None
        return rec

    def finished(self, run: RunConfig) -> dict | None:
        """The record of ``run``: the saved one, or one written now from its finished run directory."""
        rec = self.load_record(run)
        if rec is not None:
            return rec
        run_dir = self.run_dir(run_key(run))
        no_symlink_below(self.root, run_dir)
        if regular_or_missing(run_dir / RESULTS_FILE):  # a symlink, a FIFO: one line naming it
            return self.write_record(run, run_dir, environment=None)
        return None

    def write_record(self, run: RunConfig, run_dir: Path, environment: dict | None,
                     data: dict | None = None) -> dict:
        """Write (atomically) and return the record of the finished run in ``run_dir``; ``data``: its data version
        (:func:`mhmoe.research.epochs.data_version`)."""
        results = read_json(run_dir / RESULTS_FILE, follow=False, what=RESULTS_FILE)
        return self.save(make_record(run, run_dir, results, environment, data))

    def save(self, record: dict) -> dict:
        atomic_write(self.record_path(record["key"]), json.dumps(record, indent=1, ensure_ascii=False) + "\n")
        return record


def make_record(run: RunConfig, run_dir: Path, results: dict, environment: dict | None,
                data: dict | None = None) -> dict:
    """The record of a finished run (module docstring); ``data``: the data version (``train_tokens``, the
    corpus's training tokens, and ``tokenizer``, its fingerprint), None when not known."""
    train_tokens = (data or {}).get("train_tokens")
    step = int(results.get("step") or run.train.max_steps)
    tokens_seen = step * run.train.tokens_per_step
    return {"format": RECORD_FORMAT, "key": run_key(run), "identity": identity(run), "config": run.to_dict(),
            "results": results, "curve": eval_curve(run_dir, run.train.tokens_per_step),
            "train_curve": train_curve(run_dir), "tokens_seen": tokens_seen, "train_tokens": train_tokens,
            "epochs": round(tokens_seen / train_tokens, 4) if train_tokens else None, "data": data,
            "environment": environment, "recorded": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def read_suite_results(path: Path) -> Any:
    """The JSON value of a suite folder's ``results.json`` at ``path``; None when there is none, it cannot be
    read or it is not JSON (not a suite folder). A symlink, a FIFO, a device, a directory or a file over
    the JSON limit there: BoundedLoadError, one line naming it (never followed, blocked on or read)."""
    try:
        if not regular_or_missing(path):
            return None
        text = read_text(path, MAX_JSON_CHARS, follow=False, what=RESULTS_FILE)
    except OSError:
        return None
    try:
        return load_json(text, str(path))
    except BoundedLoadError:
        return None


def suite_run_dirs(suite_dir: str | Path) -> list[tuple[str, int, Path]]:
    """(label, seed, run directory) of every run a reproduce suite folder's ``results.json`` lists whose run
    directory is here: inside the folder (an older layout), or a store directory ``.../runs/<key>`` whose
    config hashes to that key (a results.json pointing elsewhere is not followed). A folder without a
    results.json that lists runs: its ``<label>/seed<k>/`` directories (labels as folder names)."""
    root = Path(suite_dir)
    path = root / RESULTS_FILE
    data = read_suite_results(path)
    runs: list = data.get("runs") or [] if isinstance(data, dict) else []
    out = []
    for r in runs:
        if not isinstance(r, dict) or not isinstance(r.get("run_dir"), str):
            continue
        d = Path(r["run_dir"])
        if _is_inside(d, root) or (d.name == r.get("key") and d.parent.name == "runs" and _key_of(d) == d.name):
            out.append((str(r.get("label")), int(r.get("seed", 0)), d))
    if out or runs:
        return out
    return [(d.parent.name, int(d.name[4:]), d) for d in sorted(root.glob("*/seed*"))
            if d.name[4:].isdigit() and _is_inside(d, root)]  # a symlinked row or seed leads nowhere else


def _is_inside(d: Path, root: Path) -> bool:
    """Whether ``d`` is inside ``root`` once every symlink is resolved, with a results.json."""
    try:
        return d.resolve().is_relative_to(root.resolve()) and (d / RESULTS_FILE).is_file()
    except OSError:
        return False


def no_symlink_below(root: Path, path: Path) -> None:
    """BoundedLoadError (one line naming it) when ``path`` or a directory between it and ``root`` (its
    ancestor; itself not checked: the user's own path) is a symlink: a planted link must not lead
    a reader out of a suite or store folder."""
    p = root
    for part in path.relative_to(root).parts:
        p = p / part
        if p.is_symlink():
            raise symlink_refused(p)


def _key_of(run_dir: Path) -> str | None:
    """The store key of the run config in ``run_dir`` (None when it has none or it does not load)."""
    from mhmoe.errors import ConfigError

    try:
        if not (regular_or_missing(run_dir / RESULTS_FILE) and regular_or_missing(run_dir / CONFIG_FILE)):
            return None
        return run_key(RunConfig.load(run_dir / CONFIG_FILE))
    except (OSError, ConfigError, BoundedLoadError, ValueError):
        return None
