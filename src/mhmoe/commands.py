"""Training-stack subcommands of the ``mhmoe`` CLI: presets, train, eval, generate, compare, bench, export."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from mhmoe.errors import CheckpointError, ConfigError


def _load_run(args: argparse.Namespace):
    from mhmoe.presets import get_preset
    from mhmoe.runconfig import RunConfig

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


# ---- presets ---------------------------------------------------------------------------------------
def _add_presets(sub) -> None:
    p = sub.add_parser("presets", help="list the named presets, or print one as YAML")
    p.add_argument("--show", metavar="NAME", help="print preset NAME as YAML")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_run_presets)


def _run_presets(args) -> int:
    from mhmoe.presets import get_preset, preset_names

    if args.show:
        run = get_preset(args.show)
        print(json.dumps(run.to_dict(), indent=2) if args.json else run.to_yaml(), end="")
        return 0
    rows = []
    for name in preset_names():
        m = get_preset(name).model
        moe = m.moe
        desc = "dense" if moe.kind == "dense" else (
            f"{moe.n_experts}x{moe.d_expert} top-{moe.top_k}" + (f" h={moe.heads}" if moe.heads > 1 else "")
            + (f" +{moe.n_shared} shared" if moe.n_shared else "") + f" {moe.router}/{moe.ffn}")
        desc += f" {m.quant}" if m.quant != "none" else ""
        rows.append({"name": name, "d_model": m.d_model, "n_layers": m.n_layers, "ffn": desc})
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            print(f"{r['name']:<24} d={r['d_model']:<4} L={r['n_layers']:<3} {r['ffn']}")
    return 0


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
    from mhmoe.train import train

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
    from mhmoe.commands_ecosystem import add_harness_args

    p = sub.add_parser("eval", help="perplexity of a checkpoint on every validation set (--tasks: lm-eval tasks)")
    p.add_argument("--checkpoint", required=True, help="run directory or checkpoint directory")
    p.add_argument("--batches", type=int, help="max evaluation batches per set (default: the run's)")
    add_harness_args(p, tasks_required=False)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_run_eval)


def _run_eval(args) -> int:
    if args.tasks is not None:
        from mhmoe.commands_ecosystem import run_eval_tasks

        return run_eval_tasks(args)
    from mhmoe.checkpoint import load_latest
    from mhmoe.data import prepare_data
    from mhmoe.evaluate import evaluate
    from mhmoe.train import resolve_device

    device = resolve_device("auto")
    ck = load_latest(args.checkpoint, device)
    cfg = ck.run.train
    data = prepare_data(ck.run.data, seq_len=cfg.seq_len, tokenizer=ck.tokenizer)
    res = evaluate(ck.model, data.val, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                   max_batches=args.batches or cfg.eval_batches, device=device, dtype=cfg.dtype)
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
    from mhmoe.checkpoint import load_latest
    from mhmoe.generate import generate
    from mhmoe.train import resolve_device

    if args.max_new_tokens < 1 or args.temperature < 0 or not 0 < args.top_p <= 1 or args.top_k < 0:
        raise ConfigError("generate", vars(args)["max_new_tokens"],
                          "--max-new-tokens >= 1, --temperature >= 0, 0 < --top-p <= 1, --top-k >= 0")
    device = resolve_device("auto")
    ck = load_latest(args.checkpoint, device)
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
    from mhmoe.presets import get_preset
    from mhmoe.train import train

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


# ---- bench -----------------------------------------------------------------------------------------
def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (moe: MoE layer paths vs masked loop vs same-FLOPs dense FFN)")
    p.add_argument("what", choices=["moe"], help="which benchmark")
    p.add_argument("--configs", nargs="+", default=["smoe", "fgmoe", "mh2", "mh3"],
                   help="smoe fgmoe mh2 mh3 (the v2 paper's parity models at d=768)")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--no-loop", action="store_true", help="skip the (slow) masked-loop baseline")
    p.add_argument("--no-input-grad", action="store_true",
                   help="fwd_bwd without the layer input's gradient (default: with it, as inside a network)")
    p.add_argument("--peers", nargs="*", default=None, metavar="PEER",
                   help="peer MoE libraries to time (st_moe, moe; default: those installed -- the `bench` extra); "
                   "--peers with no name skips them")
    p.add_argument("--json", nargs="?", const="-", metavar="PATH", help="write JSON to PATH (or stdout)")
    p.set_defaults(func=_run_bench)


def _run_bench(args) -> int:
    from mhmoe.bench import CONFIGS, DTYPES, format_rows, run_benchmark
    from mhmoe.train import resolve_device

    bad = [c for c in args.configs if c not in CONFIGS] + [d for d in args.dtypes if d not in DTYPES]
    if bad or args.tokens < 1 or args.repeats < 1:
        raise ConfigError("bench", bad or (args.tokens, args.repeats),
                          f"--configs from {list(CONFIGS)}, --dtypes from {list(DTYPES)}, --tokens/--repeats >= 1")
    from mhmoe.bench_peers import installed_peers

    peers = installed_peers() if args.peers is None else args.peers
    missing = [p for p in peers if p not in installed_peers()]
    if missing:
        raise ConfigError("--peers", missing, f"installed peers {installed_peers()} (pip install 'mhmoe[bench]')")
    device = resolve_device(args.device)
    result = run_benchmark(args.configs, args.dtypes, args.tokens, args.repeats, str(device),
                           with_loop=not args.no_loop, peers=tuple(peers), input_grad=not args.no_input_grad,
                           progress=lambda m: print(f"[bench] {m}", file=sys.stderr))
    if args.json == "-":
        print(json.dumps(result, indent=2))
        return 0
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2), encoding="utf-8")
    print(format_rows(result))
    return 0


# ---- export ----------------------------------------------------------------------------------------
def _add_export(sub) -> None:
    p = sub.add_parser("export", help="export a checkpoint (--bitnet: packed 2-bit ternary weights, docs/BITNET.md; "
                       "--hf: a transformers model directory)")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--bitnet", action="store_true",
                     help="pack the ternary weights of a model.quant=bitnet158 checkpoint 4 per byte")
    fmt.add_argument("--hf", action="store_true", help="transformers from_pretrained directory (safetensors, "
                     "config.json, tokenizer.json); OUT must not exist or be empty")
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="run directory or checkpoint directory")
    p.add_argument("out", metavar="OUT", help="output directory (model.bitnet.safetensors, config.yaml, tokenizer/)")
    p.add_argument("--float-dtype", default="float32", help="float32 | bfloat16: dtype of the unquantized tensors")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_run_export)


def _run_export(args) -> int:
    from mhmoe.bitnet_export import export_bitnet, load_packed
    from mhmoe.checkpoint import load_latest

    if args.hf:
        from mhmoe.commands_ecosystem import run_export_hf

        return run_export_hf(args)
    if not args.bitnet:
        raise ConfigError("export", "(no format)", "--bitnet | --hf")
    ck = load_latest(args.checkpoint, "cpu")
    out = Path(args.out)
    report = export_bitnet(ck.model, out, args.float_dtype)
    (out / "config.yaml").write_text(ck.run.to_yaml(), encoding="utf-8")
    ck.tokenizer.save(out / "tokenizer")
    # check: the packed model computes the fake-quantized model's logits
    packed = load_packed(report.path)
    model = ck.model.eval()
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, model.cfg.vocab_size, (1, min(32, model.cfg.max_seq_len)), generator=g)
    with torch.no_grad():
        diff = float((packed(idx).logits - model(idx).logits).abs().max())
    res = {**report.to_dict(), "checkpoint": str(ck.path), "step": ck.step, "max_abs_logit_diff": diff}
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print(f"{report.path}: {report.packed_bytes:,} bytes ({report.packed_tensors} ternary tensors, "
              f"{report.packed_params:,} weights at 2 bits; {report.float_params:,} in {report.float_dtype})")
        print(f"fp32 safetensors: {report.fp32_bytes:,} bytes -> {report.ratio:.2f}x smaller "
              f"({100 * (1 - 1 / report.ratio):.1f}% less)")
        print(f"packed vs fake-quantized logits: max |diff| = {diff:.3g}")
    return 0


# ---- convert-checkpoint ----------------------------------------------------------------------------
def _add_convert(sub) -> None:
    p = sub.add_parser("convert-checkpoint", help="convert a checkpoint between single-file safetensors and "
                       "sharded torch.distributed.checkpoint (DCP)")
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="run directory or checkpoint directory")
    p.add_argument("out", metavar="OUT", help="run directory to write OUT/checkpoints/step_N into")
    p.add_argument("--to", required=True, help="safetensors | dcp")
    p.set_defaults(func=_run_convert)


def _run_convert(args) -> int:
    from mhmoe.checkpoint import load_latest

    if args.to not in ("safetensors", "dcp"):
        raise ConfigError("--to", args.to, "safetensors | dcp")
    from mhmoe.distributed.checkpoint import dcp_to_safetensors, safetensors_to_dcp

    src = load_latest(args.checkpoint).path
    out = (dcp_to_safetensors if args.to == "safetensors" else safetensors_to_dcp)(src, args.out)
    print(f"{src} -> {out}")
    return 0


PARSER_BUILDERS = [_add_presets, _add_train, _add_eval, _add_generate, _add_compare, _add_bench, _add_export,
                   _add_convert]
__all__ = ["PARSER_BUILDERS", "format_table", "CheckpointError"]
