"""The commands of :mod:`mhmoe.integrations` (Hugging Face transformers, the LM Evaluation Harness):
``export --hf`` (handler), ``eval --tasks`` (handler), ``downstream`` and ``make-tasks``. transformers /
lm-eval are optional extras, imported only by these commands.

Their own output is kept out of ours (:func:`quiet_libraries`): no progress bars of datasets or lm-eval
(the harness gets one bar of ours over its requests), their logs at error level, and lm-eval's
``git describe`` without its ``fatal: not a git repository`` outside a git checkout."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mhmoe.errors import ConfigError

EXTRA_HINT = {"transformers": "pip install 'mhmoe[hf]'", "lm_eval": "pip install 'mhmoe[lmeval]'"}
# metrics shown in the downstream table, in this order (per task, those it reports)
TABLE_METRICS = ("acc", "acc_norm", "word_perplexity", "bits_per_byte", "exact_match")


def _require(module: str) -> None:
    try:
        importlib.import_module(module)
    except ImportError:
        raise ConfigError("extra", module, f"installed ({EXTRA_HINT[module]})") from None


def _quiet_git_hash() -> str | None:
    """lm-eval's ``get_git_commit_hash`` without git's message on stderr outside a checkout."""
    try:
        return subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL,
                                       text=True).strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """Within the context, for the libraries already imported (lm-eval imports datasets): transformers'
    and datasets' progress bars off and their logs at error level; lm-eval's per-task bars off and its
    git hash read quietly. Everything is restored on exit."""
    with contextlib.ExitStack() as stack:
        if "lm_eval" in sys.modules:
            from unittest import mock

            import lm_eval.api.task
            import lm_eval.evaluator
            from tqdm.auto import tqdm

            def no_bar(*args: Any, **kwargs: Any) -> Any:
                return tqdm(*args, **{**kwargs, "disable": True})

            stack.enter_context(mock.patch.object(lm_eval.api.task, "tqdm", no_bar))
            if hasattr(lm_eval.evaluator, "get_git_commit_hash"):
                stack.enter_context(mock.patch.object(lm_eval.evaluator, "get_git_commit_hash", _quiet_git_hash))
        if "transformers" in sys.modules:
            from transformers.utils import logging as hf_logging

            level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
            hf_logging.set_verbosity_error()
            hf_logging.disable_progress_bar()
            stack.callback(lambda: (hf_logging.set_verbosity(level),
                                    hf_logging.enable_progress_bar() if bars else None))
        if "datasets" in sys.modules:
            import datasets

            level, bars = datasets.logging.get_verbosity(), datasets.is_progress_bar_enabled()
            datasets.logging.set_verbosity_error()
            datasets.disable_progress_bars()
            stack.callback(lambda: (datasets.logging.set_verbosity(level),
                                    datasets.enable_progress_bars() if bars else None))
        yield


# ---- export --hf -----------------------------------------------------------------------------------
def run_export_hf(args: argparse.Namespace) -> int:
    """``mhmoe export --hf CHECKPOINT OUT``."""
    _require("transformers")
    from mhmoe.integrations.hf.export import export_hf
    from mhmoe.loading.checkpoint import load_latest

    ck = load_latest(args.checkpoint, "cpu")
    # quiet: transformers' bars and logs are off inside (quiet_transformers)
    report = export_hf(ck, args.out, args.hf_arch)
    if args.json:
        print(json.dumps({**report.to_dict(), "checkpoint": str(ck.path)}, indent=2))
        return 0
    code = [f for f in report.files if f.endswith(".py")]
    rest = [f for f in report.files if not f.endswith(".py") and "/" not in f]
    builtin = report.architecture != "mhmoe"
    what = f"{report.architecture} (built into transformers)" if builtin else f"{len(code)} model-code files"
    print(f"{report.path}: transformers model (step {report.step}, {report.params:,} parameters; "
          f"{', '.join(rest)}, {what})")
    how = "loaded by transformers' own class" if builtin else "loaded through its own code"
    print(f"check: {how}, logits max |diff| = {report.max_abs_logit_diff:.3g}, "
          f"greedy generate of {report.generated_tokens} tokens equal to mhmoe's")
    if builtin:
        print(f"load: AutoModelForCausalLM.from_pretrained({str(report.path)!r}) (mhmoe not needed)")
    else:
        print(f"load: AutoModelForCausalLM.from_pretrained({str(report.path)!r}, trust_remote_code=True) "
              "(mhmoe not needed), or import mhmoe.integrations.hf first and leave the flag out")
    return 0


# ---- lm-eval harness ---------------------------------------------------------------------------------
def parse_tasks(spec: str) -> list[str]:
    tasks = [t.strip() for t in spec.split(",") if t.strip()]
    if not tasks:
        raise ConfigError("--tasks", spec, "comma-separated lm-eval task names, e.g. mhmoe_kjv_cloze,mhmoe_kjv_ppl")
    return tasks


def task_manager(tasks: list[str], include_path: list[str] | None = None) -> Any:
    """An lm-eval ``TaskManager`` that knows ``tasks`` (our offline tasks + ``include_path`` + the
    harness' own tasks); ConfigError naming the unknown ones."""
    _require("lm_eval")
    from lm_eval.tasks import TaskManager

    from mhmoe.integrations.lmeval_tasks import task_dir

    for p in include_path or []:
        if not Path(p).is_dir():
            raise ConfigError("--include-path", p, "an existing directory of lm-eval task YAML files")
    paths = [str(task_dir()), *(include_path or [])]
    manager = TaskManager(include_path=paths, include_defaults=False)  # local tasks only: fast to index
    if not set(tasks) <= set(manager.all_tasks):  # standard tasks: index lm-eval's own task files too
        manager = TaskManager(include_path=paths)
    unknown = [t for t in tasks if t not in set(manager.all_tasks)]
    if unknown:
        raise ConfigError("--tasks", ",".join(unknown), "lm-eval task names (local: mhmoe_kjv_cloze, mhmoe_kjv_ppl; "
                          "see `lm_eval ls tasks`)")
    return manager


def run_harness(model: Any, tokenizer: Any, tasks: list[str], *, limit: float | None = None, batch_size: int = 8,
                num_fewshot: int | None = None, include_path: list[str] | None = None,
                bootstrap_iters: int = 100, manager: Any = None, progress: bool = False) -> dict[str, dict[str, float]]:
    """Run lm-eval ``tasks`` on an :class:`~mhmoe.model.LM` + tokenizer; ``{task: {metric: value}}``
    (``metric_stderr`` entries where the harness computes them). ``progress``: one bar over the requests
    (the libraries' own bars and messages are off, :func:`quiet_libraries`)."""
    manager = manager or task_manager(tasks, include_path)
    import lm_eval

    from mhmoe.integrations.lmeval import MHMoEHarnessLM

    lm = MHMoEHarnessLM(model=model, tokenizer=tokenizer, batch_size=batch_size, progress=progress)
    with quiet_libraries():
        res = lm_eval.simple_evaluate(model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit,
                                      task_manager=manager, bootstrap_iters=bootstrap_iters, log_samples=False)
    out: dict[str, dict[str, float]] = {}
    for task, metrics in (res or {}).get("results", {}).items():
        row = {}
        for key, value in metrics.items():
            if "," not in key or not isinstance(value, (int, float)):
                continue
            row[key.split(",", 1)[0]] = float(value)  # "acc,none" -> "acc"; "N/A" stderrs are skipped
        out[task] = row
    return out


def _check_harness_args(args: argparse.Namespace) -> None:
    if args.limit is not None and args.limit <= 0:
        raise ConfigError("--limit", args.limit, "> 0 (examples per task, or a fraction < 1)")
    if args.batch_size < 1:
        raise ConfigError("--batch-size", args.batch_size, ">= 1")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise ConfigError("--num-fewshot", args.num_fewshot, ">= 0")


def _limit(value: float | None) -> float | None:
    return None if value is None else (int(value) if value >= 1 else value)


def run_eval_tasks(args: argparse.Namespace) -> int:
    """``mhmoe eval --checkpoint X --tasks T1,T2``: the harness on one checkpoint."""
    from mhmoe.loading.checkpoint import load_latest

    tasks = parse_tasks(args.tasks)
    _check_harness_args(args)
    manager = task_manager(tasks, args.include_path)
    ck = load_latest(args.checkpoint, "cpu")
    t0 = time.perf_counter()
    res = run_harness(ck.model, ck.tokenizer, tasks, limit=_limit(args.limit), batch_size=args.batch_size,
                      num_fewshot=args.num_fewshot, manager=manager, progress=not args.no_progress)
    if args.json:
        print(json.dumps({"checkpoint": str(ck.path), "step": ck.step, "tasks": res,
                          "wall_s": time.perf_counter() - t0}, indent=2))
    else:
        print(f"{ck.path} (step {ck.step})")
        for task, metrics in res.items():
            cells = "  ".join(f"{k} {v:.4g}" for k, v in metrics.items() if not k.endswith("_stderr"))
            print(f"  {task:<24} {cells}")
    return 0


def add_harness_args(p: argparse.ArgumentParser, tasks_required: bool) -> None:
    p.add_argument("--tasks", required=tasks_required, help="comma-separated lm-eval tasks (local: mhmoe_kjv_cloze, "
                   "mhmoe_kjv_ppl; standard ones need their datasets cached, docs/DOWNSTREAM.md)"
                   + ("" if tasks_required else "; default: none, perplexity on the validation sets"))
    p.add_argument("--limit", type=float, metavar="N", help="examples per task, or a fraction < 1 (default: all)")
    p.add_argument("--batch-size", type=int, default=8, help="rows per forward pass for log-likelihoods")
    p.add_argument("--num-fewshot", type=int, metavar="N", help="few-shot examples (default: the task's)")
    p.add_argument("--include-path", action="append", metavar="DIR", help="extra lm-eval task YAML directory "
                   "(repeatable; default: only the shipped tasks and lm-eval's own)")


# ---- downstream ------------------------------------------------------------------------------------
def _add_downstream(sub) -> None:
    p = sub.add_parser("downstream", description="Run lm-eval harness tasks on several checkpoints and print one "
                       "Markdown table: a row per model, a column per task metric with its standard error "
                       "(docs/DOWNSTREAM.md).")
    p.add_argument("--checkpoints", nargs="+", required=True, metavar="RUN", help="run or checkpoint directories")
    p.add_argument("--labels", nargs="+", metavar="LABEL", help="row labels, one per checkpoint (default: the run "
                   "directory's name; for RUN/seed<k>, the parent's)")
    add_harness_args(p, tasks_required=True)
    p.add_argument("--no-progress", action="store_true", help="no progress bar (stderr)")
    p.add_argument("--json", action="store_true", help="print every row as JSON instead of the table")
    p.set_defaults(func=_run_downstream)


def _label(ck: Any, given: str | None) -> str:
    if given:
        return given
    from mhmoe.checkpoint.layout import run_directory

    run_dir = run_directory(ck.path)
    return run_dir.name if not run_dir.name.startswith("seed") else run_dir.parent.name


def _run_downstream(args) -> int:
    from mhmoe.loading.checkpoint import load_latest

    tasks = parse_tasks(args.tasks)
    _check_harness_args(args)
    if args.labels and len(args.labels) != len(args.checkpoints):
        raise ConfigError("--labels", len(args.labels), f"one label per checkpoint ({len(args.checkpoints)})")
    manager = task_manager(tasks, args.include_path)
    cks = [load_latest(c, "cpu") for c in args.checkpoints]  # all load before any evaluation
    rows, t_all = [], time.perf_counter()
    for i, ck in enumerate(cks):
        label = _label(ck, args.labels[i] if args.labels else None)
        print(f"[{label}] {ck.path}: {', '.join(tasks)}", file=sys.stderr)
        t0 = time.perf_counter()
        res = run_harness(ck.model, ck.tokenizer, tasks, limit=_limit(args.limit), batch_size=args.batch_size,
                          num_fewshot=args.num_fewshot, manager=manager, progress=not args.no_progress)
        rows.append({"model": label, "checkpoint": str(ck.path), "step": ck.step,
                     "params": sum(p.numel() for p in ck.model.parameters()), "tasks": res,
                     "wall_s": time.perf_counter() - t0})
    if args.json:
        print(json.dumps({"tasks": tasks, "rows": rows, "wall_s": time.perf_counter() - t_all}, indent=2))
    else:
        print(format_downstream(rows, tasks))
    return 0


def format_downstream(rows: list[dict], tasks: list[str]) -> str:
    """Markdown table: one row per model, one column per (task, metric) in TABLE_METRICS order."""
    cols = [(t, m) for t in tasks for m in TABLE_METRICS if any(m in r["tasks"].get(t, {}) for r in rows)]
    head = ["model", "params"] + [f"{t} {m}" for t, m in cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["model"], f"{r['params'] / 1e6:.2f}M"]
        for t, m in cols:
            v, se = r["tasks"].get(t, {}).get(m), r["tasks"].get(t, {}).get(f"{m}_stderr")
            if v is None:
                cells.append("-")
                continue
            pct = m in ("acc", "acc_norm", "exact_match")
            text = f"{100 * v:.1f}" if pct else f"{v:.3f}" if m == "bits_per_byte" else f"{v:.2f}"
            if pct and se is not None and se == se:
                text += f" ± {100 * se:.1f}"
            cells.append(text)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- make-tasks ------------------------------------------------------------------------------------
def _add_make_tasks(sub) -> None:
    p = sub.add_parser("make-tasks",
                       description="Write kjv_cloze.jsonl, kjv_ppl.jsonl and their task YAML files into OUT (the "
                       "shipped copies: src/mhmoe/integrations/tasks/).")
    p.add_argument("out", metavar="OUT", help="output directory (created if missing)")
    p.add_argument("--absolute", action="store_true", help="absolute data_files paths (for lm_eval --include_path)")
    p.add_argument("--force", action="store_true", help="replace task files that already exist in OUT")
    p.set_defaults(func=_run_make_tasks)


def _run_make_tasks(args) -> int:
    from mhmoe.integrations.lmeval_tasks import TASK_NAMES, build_tasks

    out = Path(args.out)
    if os.path.lexists(out) and not out.is_dir():
        raise ConfigError("OUT", str(out), "a directory to write the task files into (this path exists and is not a "
                          "directory)")
    names = [f"{n}.yaml" for n in TASK_NAMES] + ["kjv_cloze.jsonl", "kjv_ppl.jsonl"]
    existing = [n for n in names if (out / n).exists()]
    if existing and not args.force:
        raise ConfigError("OUT", str(out), f"a directory without task files (it has {existing[0]}; pass --force to "
                          "replace them)")
    counts = build_tasks(out, absolute_paths=args.absolute)
    for name, n in counts.items():
        print(f"{out / (name + '.yaml')}: {n} examples")
    return 0


PARSER_BUILDERS = {"downstream": _add_downstream, "make-tasks": _add_make_tasks}
