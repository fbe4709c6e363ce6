"""Script form of `mhmoe bench moe` (same options): MoE layer paths vs masked loop vs same-FLOPs dense.

    python benchmarks/moe_bench.py --configs mh3 --dtypes bfloat16 --tokens 4096 --json out.json
"""

import sys

from mhmoe.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "moe", *sys.argv[1:]]))
