"""Training-stack subcommands of the ``mhmoe`` CLI: train, eval, generate, compare.

The settings people change every run are first-class flags (:data:`RUN_FLAGS`: ``--lr``, ``--batch-size``,
``--seed``, ``--device``, ``--dtype``, ``--eval-every``, ``--max-steps``, ``--data``), each mapping onto one
config field; ``--set KEY=VALUE`` reaches any other field, and a flag wins over ``--set`` for the same field."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from mhmoe.errors import ConfigError, TrainingStopped

# flags that set one config field each; a flag wins over --set for the same field
DEFAULT_PRESET = "tiny-mh3"  # what `mhmoe train` trains without --preset or --config
RUN_FLAGS = {"data": "data.corpus", "max_steps": "train.max_steps", "lr": "train.lr", "batch_size": "train.batch_size",
             "seed": "train.seed", "device": "train.device", "dtype": "train.dtype", "eval_every": "train.eval_every",
             "parallel": "train.parallel", "ep": "train.ep"}


def flag_overrides(args: argparse.Namespace) -> list[str]:
    """``--set`` assignments followed by those of the first-class flags that were given (:data:`RUN_FLAGS`)."""
    sets = list(getattr(args, "set", None) or [])
    for attr, key in RUN_FLAGS.items():
        value = getattr(args, attr, None)
        if value is not None:  # --max-steps 0 is an error, not "use the default"
            sets.append(f"{key}={value}")
    return sets


def _load_run(args: argparse.Namespace):
    from mhmoe.config.presets import get_preset
    from mhmoe.config.run import RunConfig

    run = RunConfig.load(args.config) if getattr(args, "config", None) else get_preset(args.preset or DEFAULT_PRESET)
    sets = flag_overrides(args)
    return run.with_overrides(sets) if sets else run


#: launch fields ``--resume`` takes from the command only when it gives them: a resumed run keeps its LR schedule
#: and its activation checkpointing (the memory it was sized for) unless told otherwise
WHEN_GIVEN = ("max_steps", "activation_checkpointing")


def _launch_fields(args: argparse.Namespace) -> tuple[str, ...]:
    """What ``--resume`` takes from this command (:data:`mhmoe.train.resume.LAUNCH_FIELDS`): the
    :data:`WHEN_GIVEN` fields only when given (``--max-steps``, ``--set train.max_steps=``,
    ``--set train.activation_checkpointing=``)."""
    from mhmoe.train.resume import LAUNCH_FIELDS

    keys = {s.split("=", 1)[0].strip() for s in (getattr(args, "set", None) or [])}
    given = {f for f in WHEN_GIVEN if f"train.{f}" in keys}
    if getattr(args, "max_steps", None) is not None:
        given.add("max_steps")
    return tuple(f for f in LAUNCH_FIELDS if f not in WHEN_GIVEN or f in given)


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def refuse_unhonoured_resume_overrides(args: argparse.Namespace, run, launch_fields: tuple[str, ...]) -> None:
    """``--resume`` continues a run with its own config: a flag or ``--set`` given on this command for any
    other field than the launch properties (``launch_fields`` of ``train``, ``data.cache_dir``) is refused
    with a one-line ConfigError when it differs from the run's value (instead of being silently ignored)."""
    from mhmoe.checkpoint.layout import CONFIG_FILE
    from mhmoe.config.run import RunConfig
    from mhmoe.runtime.reading import regular_or_missing

    saved_file = Path(args.out) / CONFIG_FILE
    if not getattr(args, "resume", False) or not regular_or_missing(saved_file):  # a symlink, a FIFO: one line
        return
    taken = {f"train.{k}" for k in launch_fields} | {"data.cache_dir"}
    refuse_changes(args, RunConfig.load(saved_file), run, taken, lambda old, launch: (
        f"the run's own value {old!r}: --resume continues {args.out} with its config (only {launch} come from "
        "this command); train into a new --out to change it"))


def refuse_changes(args: argparse.Namespace, saved, run, taken: set[str], why) -> None:
    """A flag or ``--set`` of this command for a field outside ``taken`` whose value in ``run`` differs from the
    ``saved`` run's: a one-line ConfigError, ``why(saved value, the taken fields)`` saying what is allowed."""
    saved_flat, wanted = _flat(saved.to_dict()), _flat(run.to_dict())
    for key in (s.split("=", 1)[0].strip() for s in flag_overrides(args)):
        if key not in taken and key in wanted and wanted[key] != saved_flat.get(key):
            raise ConfigError(key, wanted[key], why(saved_flat.get(key), ", ".join(sorted(taken))))


def refuse_resume_of_nothing(args: argparse.Namespace) -> None:
    """``--resume`` into a directory that holds no checkpoint and no ``config.yaml`` has no run to
    continue: refused in one line unless the run is named (``--config`` or ``--preset``), so a resume
    never trains the default preset in place of a run it cannot find."""
    from mhmoe.checkpoint.format import list_checkpoints
    from mhmoe.checkpoint.layout import CONFIG_FILE

    out = Path(args.out)
    if (not args.resume or args.config or args.preset or not out.is_dir() or os.path.lexists(out / CONFIG_FILE)
            or list_checkpoints(out)):
        return
    raise ConfigError("--out", str(out), "a run to resume (it holds no checkpoint and no config.yaml); name the run "
                      "with --config or --preset to start it from step 0, or drop --resume")


def preset_default(presets: tuple[str, ...], key: str) -> str:
    """``(default: the preset's, X)`` for ``--help``: the value of config field ``key`` (e.g.
    ``train.max_steps``) in ``presets`` (the command's default presets), one value if they agree."""
    from mhmoe.config.presets import get_preset

    values = []
    for name in presets:
        node = get_preset(name).to_dict()
        for part in key.split("."):
            node = node[part]
        values.append(node)
    whose = "the preset's" if len(presets) == 1 else "each preset's"
    if len({repr(v) for v in values}) == 1:
        shown = f"{values[0]}" + (f" for {presets[0]}" if len(presets) == 1 else "")
    else:
        shown = ", ".join(f"{n} {v}" for n, v in zip(presets, values, strict=True))
    return f"(default: {whose}: {shown})".replace("%", "%%")


def add_run_flags(p: argparse.ArgumentParser, presets: tuple[str, ...] = ("tiny-mh3",)) -> None:
    """The settings people change every run, as flags (each maps onto one config field, see RUN_FLAGS);
    their help shows the value they default to in ``presets`` (the command's default presets)."""
    from mhmoe.config.train import DEVICES, DTYPES

    d = lambda key: preset_default(presets, key)  # noqa: E731
    p.add_argument("--data", metavar="CORPUS", help="training corpus: kjv | pydocs | wordnet | manpages | man-<lang> "
                   f"or a path (text file, directory, .jsonl, .parquet); = data.corpus {d('data.corpus')}")
    p.add_argument("--max-steps", type=int, metavar="N", help=f"optimizer steps; = train.max_steps "
                   f"{d('train.max_steps')}")
    p.add_argument("--lr", type=float, help=f"peak learning rate; = train.lr {d('train.lr')}")
    p.add_argument("--batch-size", type=int, metavar="B", help="sequences per micro-batch (per rank); "
                   f"= train.batch_size {d('train.batch_size')}")
    p.add_argument("--seed", type=int, help="seed of the initialisation and of the batch order; = train.seed "
                   f"{d('train.seed')}")
    p.add_argument("--device", choices=DEVICES, help="= train.device; auto: CUDA when available "
                   f"{d('train.device')}")
    p.add_argument("--dtype", choices=DTYPES, help="autocast dtype; = train.dtype. bfloat16 is fast on GPUs and on "
                   "CPUs with avx512_bf16/amx_bf16 only; float16 (dynamic loss scaling) is for GPUs without bf16 "
                   f"{d('train.dtype')}")
    p.add_argument("--eval-every", type=int, metavar="N", help="validate every N steps (0: only at the end); "
                   f"= train.eval_every {d('train.eval_every')}")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="any config field, e.g. model.moe.top_k=2 "
                   "(repeatable; see `mhmoe presets --show NAME`; default: none)")


def warn_slow_bf16(device: str, dtype: str) -> None:
    """One line on rank 0 when bf16 is chosen on a CPU without native bf16, or float16 on a CPU
    (mhmoe.runtime.cpu.bf16_warning)."""
    from mhmoe.runtime.console import warn_line
    from mhmoe.runtime.cpu import bf16_warning

    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    message = bf16_warning(device, dtype)
    if message:
        warn_line(message)


# ---- train -----------------------------------------------------------------------------------------
RESUME_HELP = ("continue the run in --out from its newest valid checkpoint, with the run's own config (model, "
               "data, optimizer, schedule); --max-steps, --parallel, --ep, train.threads, "
               "train.activation_checkpointing and data.cache_dir come from this command (--max-steps and "
               "train.activation_checkpointing only when given), and any other flag or --set that differs from the "
               "run's value is refused. "
               "Without a checkpoint (killed before the first), the run's own config.yaml starts again from step 0; "
               "without a checkpoint and a config.yaml, name the run with --config or --preset. "
               "Without --resume, an --out that holds checkpoints is refused")


BRANCH_HELP = ("continue another run from one of its checkpoints (a checkpoint directory, or a run directory: its "
               "newest valid one) into the new or empty --out, leaving that run as it is: its weights, optimizer, "
               "schedule, RNG and data position, its config with the launch fields --resume takes and the schedule's "
               "shape (train.schedule, min_lr_ratio, cooldown_fraction, cooldown_shape: e.g. a wsd cooldown) from "
               "this command; the branch point is saved into --out first (default: none)")


def _add_train(sub) -> None:
    p = sub.add_parser("train",
                       description="Train a model; writes OUT/config.yaml, metrics.jsonl, eval.jsonl, curves.png, "
                       "results.json and checkpoints/step_N/ (README: 'Run directories').")
    src = p.add_mutually_exclusive_group()  # what the run is: a preset, a config, or another run's checkpoint
    src.add_argument("--preset", help=f"preset name (list: `mhmoe presets`; default: {DEFAULT_PRESET})")
    src.add_argument("--config", metavar="YAML", help="a YAML run config (as printed by `mhmoe presets --show NAME`) "
                     "instead of --preset (default: none, the preset)")
    p.add_argument("--out", required=True, metavar="RUN", help="run directory (created if missing)")
    add_run_flags(p)
    p.add_argument("--resume", action="store_true", help=RESUME_HELP)
    src.add_argument("--branch-from", metavar="RUN_OR_CKPT", help=BRANCH_HELP)
    p.add_argument("--parallel", choices=["auto", "none", "ddp", "fsdp"], help="under torchrun: data parallelism "
                   "(auto = ddp when WORLD_SIZE > 1; docs/DISTRIBUTED.md); = train.parallel "
                   + preset_default(("tiny-mh3",), "train.parallel"))
    p.add_argument("--ep", type=int, help="expert-parallel group size under torchrun; = train.ep; divides the world "
                   "size and the expert count " + preset_default(("tiny-mh3",), "train.ep"))
    p.add_argument("--no-progress", action="store_true", help="no progress bars (stderr); the header and "
                   "evaluation lines are still printed")
    p.add_argument("--json", action="store_true", help="print the final summary (results.json) as JSON")
    p.set_defaults(func=_run_train)


def _branch_source(args: argparse.Namespace):
    """``--branch-from``: (the checkpoint directory to continue, its run config with this command's flags and
    ``--set``, the fields the new run takes from them); a flag or ``--set`` for any other field is refused in one
    line. The checkpoint is the newest valid one of a run directory (read here; the trainer loads it to resume)."""
    from mhmoe.config.data import DataConfig
    from mhmoe.config.run import RunConfig
    from mhmoe.loading.checkpoint import load_latest
    from mhmoe.train.resume import BRANCH_FIELDS, LAUNCH_DATA_FIELDS

    if args.resume:
        raise ConfigError("--resume", True, "left out with --branch-from (the new run starts from the branch point; "
                          "--resume it later)")
    ck = load_latest(args.branch_from, "cpu")
    d = ck.run.to_dict()  # where this machine caches tokens and keeps a bundle: never the source run's choice
    d["data"].update({k: getattr(DataConfig(), k) for k in LAUNCH_DATA_FIELDS})
    base = RunConfig.from_dict(d)
    run = base.with_overrides(flag_overrides(args)) if flag_overrides(args) else base
    fields = (*_launch_fields(args), *BRANCH_FIELDS)
    taken = {f"train.{k}" for k in fields} | {f"data.{k}" for k in LAUNCH_DATA_FIELDS}
    refuse_changes(args, ck.run, run, taken, lambda old, launch: (
        f"the branched run's own value {old!r}: a branch continues its optimizer and data stream (only {launch} "
        "come from this command)"))
    return ck.path, run, fields


def _run_train(args) -> int:
    branch, fields = None, _launch_fields(args)
    if args.branch_from:
        branch, run, fields = _branch_source(args)
    else:
        run = _load_run(args)  # config errors before the (slow) torch.distributed import
    import torch

    from mhmoe.checkpoint.layout import RESULTS_FILE
    from mhmoe.parallel.launch import train_parallel as train
    from mhmoe.runtime.bounded import MAX_JSON_CHARS, load_json
    from mhmoe.runtime.reading import read_text

    refuse_resume_of_nothing(args)
    refuse_unhonoured_resume_overrides(args, run, _launch_fields(args))
    warn_slow_bf16(run.train.device, run.train.dtype)
    try:
        res = train(run, args.out, resume=args.resume, progress=not args.no_progress, launch_fields=fields,
                    branch_from=branch)
    except torch.cuda.OutOfMemoryError:  # = torch.OutOfMemoryError (any device) in recent torch
        raise  # one line, exit 2 (mhmoe.cli.main)
    except TrainingStopped as exc:  # too many non-finite steps (other RuntimeErrors: mhmoe.cli.main)
        print(f"mhmoe train: {exc}", file=sys.stderr)
        return 1
    if res.rank != 0:  # torchrun: rank 0 reports
        return 0
    summary = load_json(read_text(Path(args.out) / RESULTS_FILE, MAX_JSON_CHARS, follow=False), RESULTS_FILE)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:  # the run's own name: a resumed run keeps its config, whatever --preset says
        ppl = "  ".join(f"{k} ppl {v['ppl']:.2f}" for k, v in res.eval.items())
        print(f"{summary['preset']}: step {res.step}  params {res.params:,}  {res.tokens_per_s:,.0f} tok/s  {ppl}")
    return 0


# ---- eval ------------------------------------------------------------------------------------------
def _add_eval(sub) -> None:
    from mhmoe.cli.integrations import add_harness_args

    p = sub.add_parser("eval", description="Perplexity of a checkpoint on every validation set of its run (the "
                       "run's own task, tokenizer and data; caches where this machine keeps them). --tasks: lm-eval "
                       "harness tasks instead (docs/DOWNSTREAM.md).")
    p.add_argument("--checkpoint", required=True, metavar="RUN", help="run directory (its newest valid checkpoint) "
                   "or checkpoint directory")
    p.add_argument("--batches", type=int, metavar="N", help="max evaluation batches per set (default: the run's "
                   "train.eval_batches)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where to evaluate")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="autocast dtype (default: the run's "
                   "train.dtype)")
    add_harness_args(p, tasks_required=False)
    p.add_argument("--no-progress", action="store_true", help="no progress bar (stderr)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_run_eval)


def _run_eval(args) -> int:
    if args.tasks is not None:
        from mhmoe.cli.integrations import run_eval_tasks

        return run_eval_tasks(args)
    from mhmoe.loading.checkpoint import load_latest
    from mhmoe.runtime.device import resolve_device
    from mhmoe.train.objectives import evaluate_checkpoint

    if args.batches is not None and args.batches < 1:
        raise ConfigError("--batches", args.batches, ">= 1")
    device = resolve_device(args.device, "--device")
    ck = load_latest(args.checkpoint, device)
    dtype = args.dtype or ck.run.train.dtype
    warn_slow_bf16(device.type, dtype)
    res = evaluate_checkpoint(ck, args.batches or ck.run.train.eval_batches, device, dtype,  # the run's own task
                              progress=not args.no_progress)
    if args.json:
        print(json.dumps({"checkpoint": str(ck.path), "step": ck.step, "eval": res}, indent=2))
    else:
        print(f"{ck.path} (step {ck.step})")
        for name, r in res.items():
            print(f"  {name:<10} loss {r['loss']:.4f}  ppl {r['ppl']:.2f}  ({r['tokens']:,} tokens)")
    return 0


# ---- generate --------------------------------------------------------------------------------------
def _add_generate(sub) -> None:
    from mhmoe.loading.pretrained import MAX_NEW_TOKENS, SEED, TEMPERATURE, TOP_K, TOP_P

    p = sub.add_parser("generate",
                       description="Continue --prompt with the model of a run, checkpoint, save_pretrained or "
                       "export --hf directory; prints prompt + continuation. Python: mhmoe.load(path).generate(...)")
    p.add_argument("--checkpoint", required=True, metavar="PATH", help="run, checkpoint or saved model directory")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS, metavar="N",
                   help="tokens to add at most (fewer when the model's context ends or end-of-text is drawn)")
    p.add_argument("--temperature", type=float, default=TEMPERATURE, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-k", type=int, default=TOP_K, help="sample among the K most likely tokens; 0 = all")
    p.add_argument("--top-p", type=float, default=TOP_P, help="nucleus sampling mass; 1 = off")
    p.add_argument("--seed", type=int, default=SEED, help="sampling seed (the same seed gives the same text)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where to run the model")
    p.set_defaults(func=_run_generate)


def _run_generate(args) -> int:
    from mhmoe.loading.pretrained import check_sampling, load

    try:
        check_sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p)
        if not 0 <= args.seed < 2**63:  # as train.seed: torch seeds are 64-bit, a negative one would wrap
            raise ConfigError("seed", args.seed, "an integer in 0..2**63-1")
        model = load(args.checkpoint, args.device)
        if model.run is not None and model.run.model.arch != "decoder":
            raise ConfigError("--checkpoint", args.checkpoint, "a decoder (language model) run; this one is an encoder")
        print(model.generate(args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed))
    except ConfigError as exc:  # name the flag, not the Python parameter
        raise ConfigError("--" + exc.field.replace("_", "-"), exc.value, exc.allowed, exc.hint) from None
    return 0


# ---- compare (the README's main job) -----------------------------------------------------------------
def _add_compare(sub) -> None:
    from mhmoe.research.compare import DEFAULT_PRESETS

    p = sub.add_parser("compare", description="Train and evaluate every preset (x --seeds) the same way into "
                       "OUT/<preset>/seed<k>/ and write OUT/results.md, results.csv, results.json and curves.png. "
                       "Finished runs are reused (a run with a different config is refused).")
    p.add_argument("--presets", nargs="+", default=list(DEFAULT_PRESETS), metavar="PRESET", help="presets to compare")
    p.add_argument("--out", required=True, metavar="DIR", help="suite directory (one run directory per preset and "
                   "seed)")
    p.add_argument("--seeds", type=int, default=1, help="seeds per preset (seed k trains with train.seed + k); the "
                   "table shows mean ± std when > 1")
    p.add_argument("--first-seed", type=int, default=0, metavar="K", help="the first seed index: every preset trains "
                   "and reports seeds K .. K+N-1 (N: --seeds) in OUT/<preset>/seed<k>/, e.g. more seeds beside "
                   "finished ones or a fresh set (default: 0)")
    add_run_flags(p, tuple(DEFAULT_PRESETS))
    p.add_argument("--timing-steps", type=int, default=3, metavar="N", help="after training, time N training steps "
                   "of each final model round-robin for the tok/s column (0: show each run's average instead)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (stderr); the header and "
                   "evaluation lines are still printed")
    p.add_argument("--json", action="store_true", help="print every run's summary as JSON instead of the table")
    p.set_defaults(func=_run_compare)


def _run_compare(args) -> int:
    from mhmoe.research.compare import compare_runs, run_compare

    t0 = time.perf_counter()
    # checks every name and override
    first = compare_runs(args.presets, args.seeds, flag_overrides(args), args.first_seed)[0][2]
    warn_slow_bf16(first.train.device, first.train.dtype)
    if args.timing_steps < 0:
        raise ConfigError("--timing-steps", args.timing_steps, "an integer >= 0")
    runs, table = run_compare(args.presets, args.out, args.seeds, flag_overrides(args), progress=not args.no_progress,
                              timing_rounds=args.timing_steps, first_seed=args.first_seed)
    if not runs:  # torchrun: rank 0 reports
        return 0
    if args.json:
        print(json.dumps({"runs": runs, "wall_s": time.perf_counter() - t0}, indent=2))
    else:
        print(table)
        print(f"wall time {(time.perf_counter() - t0) / 60:.1f} min; {args.out}/results.(md|csv|json), curves.png",
              file=sys.stderr)
    return 0


PARSER_BUILDERS = {"train": _add_train, "eval": _add_eval, "generate": _add_generate, "compare": _add_compare}
