"""``mhmoe bench``: benchmarks (``moe``: the MoE layer's execution paths, docs/PERFORMANCE.md)."""

from __future__ import annotations

import json
import sys

from mhmoe.cli.train import warn_slow_bf16
from mhmoe.errors import ConfigError

DTYPE_NAMES = ("float32", "bfloat16")


def default_dtypes(device: str) -> list[str]:
    """float32 and bfloat16, except on a CPU without native bf16 (float32 only, with a note on stderr)."""
    from mhmoe.runtime.console import warn_line
    from mhmoe.runtime.cpu import native_bf16

    if device == "cpu" and native_bf16() is False:
        warn_line("this CPU has no native bf16: timing float32 only (add --dtypes float32 bfloat16 for both)")
        return ["float32"]
    return list(DTYPE_NAMES)


# ---- bench -----------------------------------------------------------------------------------------
def _add_bench(sub) -> None:
    p = sub.add_parser("bench")
    p.add_argument("what", choices=["moe"], help="which benchmark")
    p.add_argument("--configs", nargs="+", default=["smoe", "fgmoe", "mh2", "mh3"], metavar="CONFIG",
                   help="layers to time: smoe fgmoe mh2 mh3 (the v2 paper's parity models at d=768)")
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPE_NAMES), metavar="DTYPE",
                   help="float32 bfloat16 (default: both, but float32 only on a CPU without native bf16, where "
                   "bf16 runs ~100x slower)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per layer call")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per measurement (the median is reported)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where to run")
    p.add_argument("--no-loop", action="store_true", help="skip the (slow) masked-loop baseline")
    p.add_argument("--no-input-grad", action="store_true",
                   help="fwd_bwd without the layer input's gradient (default: with it, as inside a network)")
    p.add_argument("--peers", nargs="*", default=None, metavar="PEER",
                   help="peer MoE layers to time (st_moe, moe, hf_eager, hf_grouped_mm, hf_batched_mm; default: on "
                   "CUDA the transformers block's three backends, on CPU every installed peer but hf_eager); "
                   "--peers with no name skips them")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", dest="overrides",
                   help="a MoEConfig field for every layer, e.g. --set router_dtype=model --set router=sigmoid "
                   "(repeatable; default: the configurations as they are; recorded in the JSON)")
    p.add_argument("--json", nargs="?", const="-", metavar="PATH", help="write JSON to PATH (--json alone: to "
                   "stdout instead of the table; default: the table only)")
    p.set_defaults(func=_run_bench)


def _run_bench(args) -> int:
    from mhmoe.research.bench import CONFIGS, DTYPES, format_rows, moe_overrides, run_benchmark
    from mhmoe.runtime.device import resolve_device

    device = resolve_device(args.device, "--device")
    args.dtypes = args.dtypes or default_dtypes(device.type)
    bad = [c for c in args.configs if c not in CONFIGS] + [d for d in args.dtypes if d not in DTYPES]
    if bad or args.tokens < 1 or args.repeats < 1:
        raise ConfigError("bench", bad or (args.tokens, args.repeats),
                          f"--configs from {list(CONFIGS)}, --dtypes from {list(DTYPES)}, --tokens/--repeats >= 1")
    overrides = moe_overrides(args.overrides)
    from mhmoe.research.bench_peers import default_peers, installed_peers

    device = resolve_device(args.device, "--device")
    peers = default_peers(device.type) if args.peers is None else args.peers
    missing = [p for p in peers if p not in installed_peers()]
    if missing:
        raise ConfigError("--peers", missing, f"installed peers {installed_peers()} (pip install 'mhmoe[bench,hf]')")
    if "bfloat16" in args.dtypes:
        warn_slow_bf16(device.type, "bfloat16")
    result = run_benchmark(args.configs, args.dtypes, args.tokens, args.repeats, str(device),
                           with_loop=not args.no_loop, peers=tuple(peers), input_grad=not args.no_input_grad,
                           progress=lambda m: print(f"[bench] {m}", file=sys.stderr), overrides=overrides)
    if args.json == "-":
        print(json.dumps(result, indent=2))
        return 0
    if args.json:
        from mhmoe.runtime.files import atomic_write

        atomic_write(args.json, json.dumps(result, indent=2))
    print(format_rows(result))
    return 0


PARSER_BUILDERS = {"bench": _add_bench}
