"""Training-stack subcommands of the ``mhmoe`` CLI: presets, train, eval, generate, compare, bench, export."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from mhmoe.errors import ConfigError


def _load_run(args: argparse.Namespace):
    from mhmoe.config.presets import get_preset
    from mhmoe.config.run import RunConfig

    run = RunConfig.load(args.config) if getattr(args, "config", None) else get_preset(args.preset)
    sets = list(args.set or [])
    if getattr(args, "data", None):
        sets.append(f"data.corpus={args.data}")
    if getattr(args, "max_steps", None) is not None:  # --max-steps 0 is an error, not "use the default"
        sets.append(f"train.max_steps={args.max_steps}")
    if getattr(args, "parallel", None) is not None:
        sets.append(f"train.parallel={args.parallel}")
    if getattr(args, "ep", None) is not None:
        sets.append(f"train.ep={args.ep}")
    return run.with_overrides(sets) if sets else run


# ---- train -----------------------------------------------------------------------------------------
def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train a model from a preset or a YAML config")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default="tiny-mh3", help="preset name (see `mhmoe presets`)")
    src.add_argument("--config", help="a YAML run config (as printed by `mhmoe presets --show`)")
    p.add_argument("--out", required=True, help="run directory (metrics.jsonl, checkpoints/)")
    p.add_argument("--data", help="corpus: registry name (kjv, pydocs, wordnet) or a path")
    p.add_argument("--max-steps", type=int, help="optimizer steps")
    p.add_argument("--resume", action="store_true", help="continue from the newest valid checkpoint")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override, e.g. train.lr=1e-3 (repeatable)")
    p.add_argument("--parallel", help="under torchrun: ddp | fsdp (FSDP2) | none | auto (= train.parallel; "
                   "auto: ddp when WORLD_SIZE > 1), docs/DISTRIBUTED.md")
    p.add_argument("--ep", help="expert-parallel group size (= train.ep; divides the world size and the expert count)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true", help="print the final summary as JSON")
    p.set_defaults(func=_run_train)


def _run_train(args) -> int:
    from mhmoe.parallel.launch import train_parallel as train

    run = _load_run(args)
    try:
        res = train(run, args.out, resume=args.resume, progress=not args.no_progress)
    except RuntimeError as exc:  # e.g. too many NaN steps
        print(f"mhmoe train: {exc}", file=sys.stderr)
        return 1
    if res.rank != 0:  # torchrun: rank 0 reports
        return 0
    summary = json.loads((Path(args.out) / "results.json").read_text())
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        ppl = "  ".join(f"{k} ppl {v['ppl']:.2f}" for k, v in res.eval.items())
        print(f"{run.name}: step {res.step}  params {res.params:,}  {res.tokens_per_s:,.0f} tok/s  {ppl}")
    return 0


# ---- eval ------------------------------------------------------------------------------------------
def _add_eval(sub) -> None:
    from mhmoe.cli.ecosystem import add_harness_args

    p = sub.add_parser("eval", help="perplexity of a checkpoint on every validation set (--tasks: lm-eval tasks)")
    p.add_argument("--checkpoint", required=True, help="run directory or checkpoint directory")
    p.add_argument("--batches", type=int, help="max evaluation batches per set (default: the run's)")
    add_harness_args(p, tasks_required=False)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_run_eval)


def _run_eval(args) -> int:
    if args.tasks is not None:
        from mhmoe.cli.ecosystem import run_eval_tasks

        return run_eval_tasks(args)
    from mhmoe.runtime.device import resolve_device
    from mhmoe.train.checkpoint import load_latest
    from mhmoe.train.tasks import evaluate_checkpoint

    device = resolve_device("auto")
    ck = load_latest(args.checkpoint, device)
    res = evaluate_checkpoint(ck, args.batches or ck.run.train.eval_batches, device)  # the run's own task
    if args.json:
        print(json.dumps({"checkpoint": str(ck.path), "step": ck.step, "eval": res}, indent=2))
    else:
        print(f"{ck.path} (step {ck.step})")
        for name, r in res.items():
            print(f"  {name:<10} loss {r['loss']:.4f}  ppl {r['ppl']:.2f}  ({r['tokens']:,} tokens)")
    return 0


# ---- generate --------------------------------------------------------------------------------------
def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="sample text from a checkpoint (KV cache)")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_run_generate)


def _run_generate(args) -> int:
    from mhmoe.model.generate import generate
    from mhmoe.runtime.device import resolve_device
    from mhmoe.train.checkpoint import load_latest

    if args.max_new_tokens < 1 or args.temperature < 0 or not 0 < args.top_p <= 1 or args.top_k < 0:
        raise ConfigError("generate", vars(args)["max_new_tokens"],
                          "--max-new-tokens >= 1, --temperature >= 0, 0 < --top-p <= 1, --top-k >= 0")
    device = resolve_device("auto")
    ck = load_latest(args.checkpoint, device)
    if ck.run.model.arch != "decoder":
        raise ConfigError("--checkpoint", args.checkpoint, "a decoder (language model) run; this one is an encoder")
    ids = ck.tokenizer.encode(args.prompt)
    if not ids:
        raise ConfigError("--prompt", args.prompt, "a non-empty text")
    g = torch.Generator(device=device).manual_seed(args.seed)
    prompt = torch.tensor([ids], device=device)
    n = min(args.max_new_tokens, ck.model.cfg.max_seq_len - len(ids))
    out = generate(ck.model, prompt, n, args.temperature, args.top_k, args.top_p,
                   eos_id=ck.tokenizer.eos_id, generator=g)
    print(ck.tokenizer.decode(out[0].tolist()))
    return 0


# ---- compare (the README's main job) -----------------------------------------------------------------
def _add_compare(sub) -> None:
    p = sub.add_parser("compare", help="train + evaluate several presets and print a comparison table")
    p.add_argument("--presets", nargs="+", default=["tiny-dense", "tiny-smoe", "tiny-mh3"])
    p.add_argument("--out", required=True, help="parent directory; one run directory per preset")
    p.add_argument("--max-steps", type=int)
    p.add_argument("--set", action="append", metavar="KEY=VALUE")
    p.add_argument("--data")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_run_compare)


def _run_compare(args) -> int:
    from mhmoe.config.presets import get_preset
    from mhmoe.parallel.launch import train_parallel as train

    rows, t_all = [], time.perf_counter()
    for name in args.presets:
        get_preset(name)  # validate all names before training anything
    for name in args.presets:
        run_dir = Path(args.out) / name
        done = run_dir / "results.json"
        if done.exists():
            print(f"[{name}] finished earlier: reusing {done}", file=sys.stderr)
            rows.append(json.loads(done.read_text()))
            continue
        ns = argparse.Namespace(preset=name, config=None, set=args.set, data=args.data, max_steps=args.max_steps)
        run = _load_run(ns)
        print(f"[{name}] training {run.train.max_steps} steps x {run.train.tokens_per_step:,} tokens", file=sys.stderr)
        train(run, run_dir, resume=bool(list((run_dir / "checkpoints").glob("step_*"))) if run_dir.exists() else False,
              progress=not args.no_progress)
        rows.append(json.loads(done.read_text()))
    wall = time.perf_counter() - t_all
    if args.json:
        print(json.dumps({"rows": rows, "wall_s": wall}, indent=2))
    else:
        print(format_table(rows))
        print(f"wall time {wall / 60:.1f} min")
    return 0


def format_table(rows: list[dict]) -> str:
    sets = sorted({k for r in rows for k in r["eval"]}, key=lambda s: (s != "kjv", s))
    head = ["model", "params", "fwd FLOPs/token"] + [f"ppl {s}" for s in sets] + ["train tok/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["preset"], f"{r['params'] / 1e6:.2f}M", f"{r['fwd_flops_per_token'] / 1e6:.2f}M"]
        cells += [f"{r['eval'][s]['ppl']:.2f}" if s in r["eval"] else "-" for s in sets]
        cells.append(f"{r['tokens_per_s']:,.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


PARSER_BUILDERS = [_add_train, _add_eval, _add_generate, _add_compare]
