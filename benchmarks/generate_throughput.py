"""Generation throughput of the presets: new tokens per second of greedy decoding with the KV cache
(:func:`mhmoe.model.generate.generate`: one prefill of the prompt, then one forward per new token), randomly
initialised models in eval mode, ``--batch-size`` sequences of a ``--prompt``-token random prompt.

Timing: the presets are built together and timed **round-robin** in one process (``--warmup`` untimed
generations each, then ``--repeats`` rounds in which every preset generates once in turn); the median per
preset. ``vs dense``: tokens/s over the same family's dense preset's (``tiny-mh3`` -> ``tiny-dense``); a decoding
step's FLOPs are the same for the MoE presets and their dense preset (equal active FLOPs per token), so this is
the ratio of the rates as well. Prints a markdown table and, with ``--json PATH``, writes the rows plus a
``machine`` object::

    python benchmarks/generate_throughput.py --presets tiny-dense tiny-smoe tiny-mh3 --threads 2 --json gen.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from mhmoe.config.presets import get_preset
from mhmoe.model.generate import generate
from mhmoe.model.lm import LM
from mhmoe.runtime.cpu import cpu_info, cpu_isa
from mhmoe.runtime.cpu_malloc import malloc_from_env

DEFAULT_PRESETS = ["tiny-dense", "tiny-smoe", "tiny-fgmoe", "tiny-mh2", "tiny-mh3"]


def family_dense(name: str) -> str:
    """The dense preset of ``name``'s family: ``tiny-mh3`` -> ``tiny-dense``."""
    return name.split("-", 1)[0] + "-dense"


def bench(names: list[str], batch: int, prompt_len: int, new: int, warmup: int, repeats: int,
          seed: int = 0) -> list[dict[str, Any]]:
    models, prompts = {}, {}
    for name in names:
        run = get_preset(name)
        torch.manual_seed(seed)
        models[name] = LM(run.model).eval()
        g = torch.Generator().manual_seed(seed)
        prompts[name] = torch.randint(0, run.model.vocab_size, (batch, prompt_len), generator=g)
        if prompt_len + new > run.model.max_seq_len:
            raise SystemExit(f"generate_throughput: error: --prompt + --new-tokens > {name}'s max_seq_len "
                             f"{run.model.max_seq_len}")
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + repeats):
        for name in names:
            t0 = time.perf_counter()
            generate(models[name], prompts[name], new, temperature=0)
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    rows = []
    for name in names:
        sec = statistics.median(times[name])
        rows.append({"preset": name, "params": sum(p.numel() for p in models[name].parameters()), "batch": batch,
                     "prompt": prompt_len, "new_tokens": new, "s": sec, "tokens_per_s": batch * new / sec,
                     "ms_per_token": 1e3 * sec / new})
    by = {r["preset"]: r for r in rows}
    for r in rows:
        d = by.get(family_dense(r["preset"]))
        r["vs_dense"] = r["tokens_per_s"] / d["tokens_per_s"] if d else None
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    out = ["| preset | params | batch | prompt | new tokens | tokens/s | ms/token | vs dense |", "|" + "---|" * 8]
    for r in rows:
        vs = "-" if r["vs_dense"] is None else f"{r['vs_dense']:.2f}"
        out.append(f"| {r['preset']} | {r['params'] / 1e6:.2f}M | {r['batch']} | {r['prompt']} | {r['new_tokens']} | "
                   f"{r['tokens_per_s']:,.0f} | {r['ms_per_token']:.2f} | {vs} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", nargs="+", default=DEFAULT_PRESETS, help="presets to time (default: %(default)s)")
    ap.add_argument("--batch-size", type=int, default=1, help="sequences generated together (default: 1)")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens (default: 16)")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens generated per sequence (default: 64)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed generations per preset (default: 1)")
    ap.add_argument("--repeats", type=int, default=5, help="timed round-robin rounds (default: 5)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: 0 = torch's own)")
    ap.add_argument("--json", metavar="PATH", help="write the rows and the machine as JSON")
    args = ap.parse_args(argv)
    if min(args.batch_size, args.prompt, args.new_tokens, args.repeats) < 1 or args.warmup < 0:
        print("generate_throughput: error: --batch-size, --prompt, --new-tokens, --repeats >= 1, --warmup >= 0",
              file=sys.stderr)
        return 2
    malloc_from_env()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = bench(args.presets, args.batch_size, args.prompt, args.new_tokens, args.warmup, args.repeats)
    print(format_table(rows))
    model, _ = cpu_info()
    machine = {"cpu": model, "isa": cpu_isa(), "threads": torch.get_num_threads(), "torch": torch.__version__}
    print(f"\n{model}, {machine['threads']} threads, torch {torch.__version__}; median of {args.repeats} rounds")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "command": " ".join(sys.argv),
                                               "rows": rows}, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
