"""File sizes of the BitNet b1.58 packed export (docs/BITNET.md): the tiny *-bitnet presets exported with
float32 and bfloat16 full-precision tensors against their fp32 safetensors, and the paper-scale counts.

    python benchmarks/bitnet_sizes.py --json docs/results/bitnet_sizes.json

Models are untrained (sizes do not depend on the values); vocabulary 8192 (the presets' BPE). The
paper-scale model is counted on the meta device, not written: bytes = 2 bits per ternary weight + one
fp32 scale per group + 4 (or 2) bytes per float value.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path

import torch

from mhmoe.config.presets import get_preset
from mhmoe.integrations.bitnet_packed import export_bitnet
from mhmoe.model.lm import LM
from mhmoe.quant.bitnet import quantized_weights

TINY = ("tiny-dense-bitnet", "tiny-smoe-bitnet", "tiny-mh3-bitnet")
PAPER = "paper-mh3-bitnet"


def tiny_row(name: str) -> dict:
    torch.manual_seed(0)
    model = LM(get_preset(name).model)
    row = {"preset": name}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in ("float32", "bfloat16"):
            rep = export_bitnet(model, Path(tmp) / dtype, dtype)
            row.update({"fp32_bytes": rep.fp32_bytes, f"packed_bytes_{dtype}": rep.packed_bytes,
                        f"ratio_{dtype}": rep.ratio, "packed_tensors": rep.packed_tensors,
                        "packed_params": rep.packed_params, "float_params": rep.float_params})
    row["embedding_params"] = model.embed.weight.numel()
    return row


def paper_row(name: str = PAPER) -> dict:
    with torch.device("meta"):
        model = LM(get_preset(name).model)
    quantized = quantized_weights(model)
    params = dict(model.named_parameters())
    ternary = sum(params[n].numel() for n in quantized)
    groups = sum(params[n].shape[0] if dims else 1 for n, dims in quantized.items())
    floats = sum(p.numel() for n, p in params.items() if n not in quantized)
    packed = ternary / 4 + 4 * groups
    fp32 = 4 * (ternary + floats)
    return {"preset": name, "ternary_params": ternary, "float_params": floats, "fp32_mb": fp32 / 1e6,
            "packed_mb_float32": (packed + 4 * floats) / 1e6, "packed_mb_bfloat16": (packed + 2 * floats) / 1e6,
            "ratio_float32": fp32 / (packed + 4 * floats), "ratio_bfloat16": fp32 / (packed + 2 * floats)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON (default: stdout)")
    args = ap.parse_args(argv)
    result = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "command": "python benchmarks/bitnet_sizes.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "tiny": [tiny_row(n) for n in TINY], "paper": paper_row()}
    text = json.dumps(result, indent=1) + "\n"
    if args.json:
        Path(args.json).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
