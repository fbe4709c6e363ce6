"""``mhmoe export`` (BitNet packed weights, transformers directories) and ``mhmoe convert-checkpoint``."""

from __future__ import annotations

import json
from pathlib import Path

from mhmoe.checkpoint.layout import FORMATS
from mhmoe.errors import ConfigError
from mhmoe.runtime.files import atomic_write, publish_dir, remove_tree, staging_dir


def refuse_non_empty(out: Path, flag: str = "OUT") -> None:
    """ConfigError unless ``out`` does not exist or is an empty directory: an export or conversion
    never overwrites (or prunes) what is already there."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(flag, str(out), "a new or empty directory (it exists and is not empty: refusing to "
                                          "overwrite)")


# ---- export ----------------------------------------------------------------------------------------
def _add_export(sub) -> None:
    p = sub.add_parser("export", description="Export the newest valid checkpoint of a run: --hf writes a directory "
                       "transformers' from_pretrained loads (docs/DOWNSTREAM.md); --bitnet packs the ternary weights "
                       "of a model.quant=bitnet158 run 4 per byte (docs/BITNET.md). Both reload the export and "
                       "print the largest logit difference to the checkpoint.")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--bitnet", action="store_true",
                     help="pack the ternary weights of a model.quant=bitnet158 checkpoint 4 per byte")
    fmt.add_argument("--hf", action="store_true", help="transformers from_pretrained directory (safetensors, "
                     "config.json, tokenizer.json); OUT must not exist or be empty")
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="run directory or checkpoint directory")
    p.add_argument("out", metavar="OUT", help="output directory, which must not exist or be empty (--bitnet: "
                   "model.bitnet.safetensors, config.yaml, tokenizer/; --hf: config.json, model.safetensors, "
                   "tokenizer.json)")
    p.add_argument("--hf-arch", default="mhmoe", choices=["mhmoe", "builtin"],
                   help="--hf: mhmoe = our model class, its code in the directory (trust_remote_code; every model); "
                        "builtin = a class built into transformers, no remote code: Llama for dense models, "
                        "Qwen2-MoE for softmax-routed sparse MoE without MH-MoE heads, Qwen3 / Qwen3-MoE with "
                        "model.qk_norm (others are refused); default: mhmoe")
    p.add_argument("--float-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="--bitnet: dtype of the tensors that stay unquantized")
    p.add_argument("--json", action="store_true", help="print the export report as JSON")
    p.set_defaults(func=_run_export)


def _run_export(args) -> int:
    import torch

    from mhmoe.checkpoint.layout import CONFIG_FILE, TOKENIZER_DIR
    from mhmoe.integrations.bitnet_packed import export_bitnet, load_packed
    from mhmoe.loading.checkpoint import load_latest

    if args.hf:
        from mhmoe.cli.integrations import run_export_hf

        return run_export_hf(args)
    if not args.bitnet:
        raise ConfigError("export", "(no format)", "--bitnet | --hf")
    if args.hf_arch != "mhmoe":
        raise ConfigError("--hf-arch", args.hf_arch, "only with --hf")
    out = Path(args.out)
    refuse_non_empty(out)
    ck = load_latest(args.checkpoint, "cpu")
    if ck.run.model.arch != "decoder":
        raise ConfigError("--checkpoint", args.checkpoint, "a decoder run (the packed export is for language models)")
    with staging_dir(out) as tmp:  # written completely, then renamed into place (mhmoe.runtime.files)
        report = export_bitnet(ck.model, tmp, args.float_dtype)
        atomic_write(tmp / CONFIG_FILE, ck.run.to_yaml(), durable=False)
        ck.tokenizer.save(tmp / TOKENIZER_DIR)
        # check: the packed model computes the fake-quantized model's logits
        packed = load_packed(report.path)
        model = ck.model.eval()
        g = torch.Generator().manual_seed(0)
        idx = torch.randint(0, model.cfg.vocab_size, (1, min(32, model.cfg.max_seq_len)), generator=g)
        with torch.no_grad():
            diff = float((packed(idx).logits - model(idx).logits).abs().max())
        refuse_non_empty(out)  # still new or empty after the export
        publish_dir(tmp, out)
    report.path = out / Path(report.path).name
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
    p = sub.add_parser("convert-checkpoint", description="Convert the newest valid checkpoint of a run between the "
                       "single-file safetensors format and a sharded torch.distributed.checkpoint (DCP) directory "
                       "(docs/DISTRIBUTED.md), written as OUT/checkpoints/step_N of a new run directory.")
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="run directory or checkpoint directory")
    p.add_argument("out", metavar="OUT", help="a new (or empty) run directory to write OUT/checkpoints/step_N into")
    p.add_argument("--to", required=True, choices=list(FORMATS), help="target format")
    p.set_defaults(func=_run_convert)


def _run_convert(args) -> int:
    from mhmoe.checkpoint.layout import CKPT_DIR, LOCK_FILE, SAFETENSORS
    from mhmoe.loading.checkpoint import load_latest
    from mhmoe.train.convert import dcp_to_safetensors, safetensors_to_dcp
    from mhmoe.train.lock import RunDirLock

    if args.to not in FORMATS:
        raise ConfigError("--to", args.to, " | ".join(FORMATS))

    target = Path(args.out)
    refuse_non_empty(target)  # converting into a run would replace its checkpoints and prune older ones
    src = load_latest(args.checkpoint).path
    with RunDirLock(target):  # no training may start writing into it meanwhile
        if any(p.name != LOCK_FILE for p in target.iterdir()):
            refuse_non_empty(target)
        try:
            out = (dcp_to_safetensors if args.to == SAFETENSORS else safetensors_to_dcp)(src, target)
        except BaseException:
            remove_tree(target / CKPT_DIR)  # it was empty: leave nothing half-written
            raise
    print(f"{src} -> {out}")
    return 0


PARSER_BUILDERS = {"export": _add_export, "convert-checkpoint": _add_convert}
