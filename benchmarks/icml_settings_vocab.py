"""Which vocabulary for the tiny multilingual setting? cl100k_base (the paper's) against byte-level BPEs
trained on the ``manpages`` training split, measured on this machine.

Per tokenizer: tokens per character on every language's validation pages; the tiny ICML MH-MoE
(h=4, 8 experts, d=192, 4 layers) with that vocabulary: parameters (and the embedding's share),
analytic forward FLOPs per token (and the LM head's share), the median wall time of a training step
(16 x 256 tokens, fp32, forward + backward + AdamW) and the text it covers per second
(tokens/s / tokens-per-character = characters/s).

    python benchmarks/icml_settings_vocab.py --out docs/results/icml-settings-vocab.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

from mhmoe.config.flops import model_flops_per_token
from mhmoe.config.presets import get_preset
from mhmoe.config.train import TrainConfig
from mhmoe.data.bpe import load_or_train_bpe
from mhmoe.data.corpora import load_corpus
from mhmoe.data.manpages import MANPAGES_LANGS
from mhmoe.data.token_cache import default_cache_dir
from mhmoe.data.tokenizer import get_pretrained_tokenizer
from mhmoe.model.lm import LM
from mhmoe.train.optim import build_optimizer


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    name = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "")
    flags = next((ln.split(":", 1)[1].split() for ln in out.splitlines() if ln.startswith("Flags")), [])
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name or platform.processor()} ({torch.get_num_threads()} threads; {' '.join(isa)})"


def tokens_per_char(tok, langs) -> dict[str, float]:
    out = {}
    for code in langs:
        docs = load_corpus(f"man-{code}").split("val")
        chars = sum(len(d.text) for d in docs)
        ids = tok.encode_batch([d.text for d in docs])
        assert all(tok.decode(i) == d.text for i, d in zip(ids, docs, strict=True)), f"{tok.name} round trip {code}"
        out[code] = sum(map(len, ids)) / chars
    return out


def step_time(vocab: int, steps: int, batch: int, seq: int) -> dict[str, float]:
    run = get_preset("tiny-icml-mh4-8")
    cfg = run.model.__class__.from_dict({**run.model.to_dict(), "vocab_size": vocab})
    torch.manual_seed(0)
    model = LM(cfg)
    opt = build_optimizer(model, TrainConfig(lr=1e-3))
    times = []
    for i in range(steps + 2):
        x = torch.randint(0, vocab, (batch, seq + 1))
        t0 = time.perf_counter()
        out = model(x[:, :-1], x[:, 1:])
        (out.loss + out.aux_loss).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 2:  # warm-up
            times.append(time.perf_counter() - t0)
    flops = model_flops_per_token(cfg, seq)
    return {"params": model.num_params(), "embedding_params": model.embed.weight.numel(),
            "fwd_flops_per_token": flops.total, "lm_head_flops_share": flops.lm_head / flops.total,
            "step_s_median": statistics.median(times), "tokens_per_s": batch * seq / statistics.median(times)}


def table(rows: dict) -> list[dict]:
    """The numbers docs/ICML-SETTINGS.md prints, rounded as printed: per tokenizer its mean tokens per
    character, parameters, embedding share, forward FLOPs per token and per character, LM-head share."""
    return [{"tokenizer": name, "vocab_size": r["vocab_size"], "tokens_per_char": round(r["tokens_per_char_mean"], 3),
             "params_M": round(r["params"] / 1e6, 2), "embedding_share": round(r["embedding_params"] / r["params"], 2),
             "fwd_flops_per_token_M": round(r["fwd_flops_per_token"] / 1e6, 2),
             "lm_head_share": round(r["lm_head_flops_share"], 2),
             "fwd_flops_per_char_M": round(r["fwd_flops_per_token"] * r["tokens_per_char_mean"] / 1e6, 2),
             "step_s": round(r["step_s_median"], 1),
             **{f"tokens_per_char_{k}": round(v, 3) for k, v in r["tokens_per_char"].items()}}
            for name, r in rows.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--table-only", action="store_true", help="recompute the printed table of an existing --out")
    ap.add_argument("--bpe", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.table_only:
        data = json.loads(Path(args.out).read_text(encoding="utf-8"))
        Path(args.out).write_text(json.dumps({**data, "table": table(data["tokenizers"])}, indent=1) + "\n",
                                  encoding="utf-8")
        return
    torch.set_num_threads(args.threads)
    train_docs = load_corpus("manpages").split("train")
    cache = default_cache_dir("")
    tokenizers = {"cl100k_base": get_pretrained_tokenizer("cl100k_base")}
    for v in args.bpe:
        t0 = time.perf_counter()
        tokenizers[f"bpe-{v}"] = load_or_train_bpe(train_docs, v, cache)
        print(f"bpe {v}: {time.perf_counter() - t0:.0f} s (train or load)", flush=True)
    rows = {}
    for name, tok in tokenizers.items():
        tpc = tokens_per_char(tok, MANPAGES_LANGS)
        mean_tpc = statistics.mean(tpc.values())
        timing = step_time(tok.vocab_size, args.steps, 16, 256)
        rows[name] = {"vocab_size": tok.vocab_size, "tokens_per_char": tpc, "tokens_per_char_mean": mean_tpc,
                      **timing, "chars_per_s": timing["tokens_per_s"] / mean_tpc}
        print(name, json.dumps({k: v for k, v in rows[name].items() if k != "tokens_per_char"}), flush=True)
    Path(args.out).write_text(json.dumps({"machine": cpu_name(), "torch": torch.__version__,
                                          "model": "tiny-icml-mh4-8 (d=192, 4 layers), batch 16 x 256, fp32",
                                          "tokenizers": rows, "table": table(rows)}, indent=1) + "\n",
                                         encoding="utf-8")


if __name__ == "__main__":
    main()
