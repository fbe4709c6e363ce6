"""A/B two versions of ``mhmoe/moe/dispatch/fused.py`` on one MoE layer, in one process, alternating.

Each file is loaded as its own module; the layer's dispatch is pointed at each version's
``fused_moe`` in turn, every repeat runs both (round-robin), so machine drift hits both alike.
For example, the committed version against the working tree:

    git show HEAD:src/mhmoe/moe/dispatch/fused.py > /tmp/fused_head.py
    MHMOE_MALLOC=tuned python benchmarks/ab_fused.py /tmp/fused_head.py src/mhmoe/moe/dispatch/fused.py \
        --config mh3 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import importlib.util

import torch

from mhmoe.moe.layers import build_ffn_layer
from mhmoe.research.bench import CONFIGS, D_MODEL, DTYPES, _runner
from mhmoe.research.timing import time_fns
from mhmoe.runtime.cpu_malloc import malloc_from_env


def load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--config", default="mh3", choices=list(CONFIGS))
    ap.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    malloc_from_env()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    x = torch.randn(args.tokens, D_MODEL, dtype=dtype, requires_grad=True)
    fns = {}
    for i, path in enumerate((args.a, args.b)):
        mod = load(path, f"fused_version_{i}")
        torch.manual_seed(0)
        layer = build_ffn_layer(D_MODEL, CONFIGS[args.config].moe_config("fused")).to(dtype=dtype)
        moe = layer.moe if hasattr(layer, "moe") else layer
        moe.dispatch = lambda xs, route, m=mod, ex=moe.experts: m.fused_moe(xs, route, ex)
        fns[path] = _runner(layer, x, "fwd_bwd")
    times, _ = time_fns(fns, x.device, args.repeats)
    for path, ms in times.items():
        print(f"{args.config} {args.dtype} fwd_bwd {path}: {ms:.1f} ms")


if __name__ == "__main__":
    main()
