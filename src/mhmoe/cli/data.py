"""``mhmoe data``: data tools (``bundle``: a prepared corpus that travels without its packages, docs/DATA.md)."""

from __future__ import annotations

import json
import sys

from mhmoe.errors import ConfigError

DEFAULT_VAL_SETS = ("kjv", "pydocs", "wordnet")
DEFAULT_VAL_TOKENS = 262144


def main_bundle_defaults() -> dict:
    """The DataConfig fields ``mhmoe data bundle`` sets by default (besides the corpus)."""
    return {"val_sets": DEFAULT_VAL_SETS, "val_tokens": DEFAULT_VAL_TOKENS}


def _add_data(sub) -> None:
    p = sub.add_parser("data")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True, parser_class=type(p))
    b = actions.add_parser("bundle", help="write a data bundle: tokenizer, first N training tokens, validation sets",
                           description="Prepare a corpus (tokenized once, cached) and write a self-contained data "
                           "bundle into a new directory: the trained tokenizer, the first N training tokens (whole "
                           "documents), every validation set's held-out tokens (xz-compressed ids) and a manifest "
                           "with sha256 hashes. `mhmoe train ... --set data.bundle=DIR` then trains from DIR "
                           "alone, on a machine without the corpus's packages.")
    b.add_argument("--corpus", default="debdocs", help="training corpus (registry name or path)")
    b.add_argument("--out", required=True, metavar="DIR", help="new (or empty) directory to write the bundle into")
    from mhmoe.data.bundle import DEFAULT_TRAIN_TOKENS

    b.add_argument("--max-train-tokens", type=int, default=DEFAULT_TRAIN_TOKENS, metavar="N",
                   help="training tokens to carry (the longest run of whole documents from the start of the "
                   "training split that fits)")
    b.add_argument("--tokenizer", default="bpe", choices=["bpe", "gpt2", "cl100k_base", "byte"], help="tokenizer")
    b.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary size")
    b.add_argument("--val-sets", nargs="*", default=list(DEFAULT_VAL_SETS), metavar="NAME",
                   help="extra validation sets (their held-out split is carried; missing packages are skipped "
                   "with a warning)")
    b.add_argument("--val-tokens", type=int, default=DEFAULT_VAL_TOKENS, help="tokens carried per validation set")
    b.add_argument("--seq-len", type=int, default=256, help="shortest usable split, in tokens minus one")
    b.add_argument("--cache-dir", default="", help="token cache root (default: $MHMOE_CACHE, else ~/.cache/mhmoe)")
    b.add_argument("--no-progress", action="store_true", help="no progress bars")
    b.add_argument("--json", action="store_true", help="print the manifest of what was written as JSON")
    b.set_defaults(func=_run_bundle)


def _run_bundle(args) -> int:
    from mhmoe.config.data import DataConfig
    from mhmoe.data.bundle import write_bundle
    from mhmoe.data.prepare import prepare_data

    if args.max_train_tokens < args.seq_len + 1:
        raise ConfigError("--max-train-tokens", args.max_train_tokens, f"integer >= seq_len+1 = {args.seq_len + 1}")
    cfg = DataConfig(corpus=args.corpus, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                     val_sets=tuple(args.val_sets), val_tokens=args.val_tokens, cache_dir=args.cache_dir)
    prepared = prepare_data(cfg, seq_len=args.seq_len, progress=not args.no_progress)
    manifest = write_bundle(prepared, cfg, args.out, max_train_tokens=args.max_train_tokens)
    if args.json:
        print(json.dumps({"out": args.out, **manifest}, indent=1, sort_keys=True))
        return 0
    size = sum(f["bytes"] for f in manifest["files"].values())
    val = ", ".join(f"{k} {v['n_tokens']:,}" for k, v in manifest["val"].items())
    print(f"wrote {args.out}: {size / 2**20:.1f} MiB; train {manifest['train']['n_tokens']:,} tokens of "
          f"{manifest['corpus_train_tokens']:,} ({cfg.corpus}, {cfg.tokenizer} {manifest['tokenizer']['vocab_size']}); "
          f"val {val}", file=sys.stdout)
    return 0


PARSER_BUILDERS = {"data": _add_data}
