"""The trainer's entry point: :class:`DataConfig` -> :func:`prepare_data` -> :class:`PreparedData`.

``prepare_data`` loads the training corpus, splits it by document, trains (or loads from the cache)
the tokenizer on the train split unless one is passed in, tokenizes the train split into a cached
memory-mapped token file, and builds validation arrays: the training corpus's own ``val`` split
plus the ``val`` split of every extra corpus in ``val_sets`` (a path in ``val_sets`` is used whole),
each capped at ``val_tokens`` tokens.  Documents are joined with EOS (each one is followed by EOS).
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mhmoe.config.data import DataConfig
from mhmoe.config.fields import is_int
from mhmoe.data.bpe import load_or_train_bpe
from mhmoe.data.corpora import REGISTRY, CorpusUnavailableError, load_corpus
from mhmoe.data.documents import Corpus, Document, doc_hash
from mhmoe.data.token_cache import TokenFile, load_or_build_tokens, usable_cache_dir
from mhmoe.data.tokenizer import Tokenizer, get_pretrained_tokenizer
from mhmoe.errors import ConfigError, DataError

log = logging.getLogger(__name__)
# The BPE is trained on at most this many characters of the training split: a larger split (debdocs,
# ~140 M characters) gives a deterministic sample of whole documents (see bpe_training_documents).
BPE_SAMPLE_CHARS = 40_000_000


@dataclass
class PreparedData:
    """Tokenizer, memory-mapped train tokens, validation token arrays by name, and manifest info."""

    tokenizer: Tokenizer
    train: np.ndarray
    val: dict[str, np.ndarray]
    manifest: dict[str, Any] = field(default_factory=dict)


def _val_name(corpus: Corpus, spec: str, taken: set[str]) -> str:
    """Registry corpora keep their name; a path is named by its stem, suffixed ``_user`` if that is
    a registry name and ``_2``, ``_3``, ... if already taken."""
    if spec in REGISTRY:
        base = spec
    else:
        base = corpus.name + ("_user" if corpus.name in REGISTRY else "")
    name, k = base, 1
    while name in taken:
        k += 1
        name = f"{base}_{k}"
    return name


def bpe_training_documents(train: list[Document], max_chars: int = BPE_SAMPLE_CHARS) -> list[Document]:
    """``train`` itself if it has at most ``max_chars`` characters, else a deterministic sample: documents
    taken in the order of :func:`~mhmoe.data.documents.doc_hash` of their id while the budget lasts (one
    that would overflow it is passed over), kept in corpus order."""
    if sum(len(d.text) for d in train) <= max_chars:
        return train
    keep, used = set(), 0
    for d in sorted(train, key=lambda d: (doc_hash(d.id), d.id)):
        if used + len(d.text) <= max_chars:
            keep.add(d.id)
            used += len(d.text)
    return [d for d in train if d.id in keep]


def epochs(tokens_seen: int, prepared: PreparedData) -> float:
    """How many passes over ``prepared``'s training tokens ``tokens_seen`` training tokens are
    (``steps x batch x seq_len``; with a bundle, over the tokens the bundle carries)."""
    n = train_tokens(prepared)
    return tokens_seen / n if n else float("inf")


def train_tokens(prepared: PreparedData) -> int:
    """Number of training tokens of ``prepared`` (EOS included), also ``manifest["train_tokens"]``."""
    return int(len(prepared.train))


def _tokenizer_for(cfg: DataConfig, corpus: Corpus, cache: Path, progress: bool) -> Tokenizer:
    if cfg.tokenizer == "bpe":
        docs = bpe_training_documents(corpus.split("train"))
        return load_or_train_bpe(docs, cfg.vocab_size, cache, progress=progress)
    return get_pretrained_tokenizer(cfg.tokenizer)


def _describe(tf: TokenFile) -> dict[str, Any]:
    return {**tf.manifest, "path": str(tf.path), "built": tf.built, **tf.timings}


def prepare_data(
    cfg: DataConfig, *, seq_len: int, tokenizer: Tokenizer | None = None, progress: bool = False
) -> PreparedData:
    """Load, split, tokenize and cache everything the trainer needs (see module docstring); with
    ``cfg.bundle``, read everything from that data bundle instead (:mod:`mhmoe.data.bundle`).

    ``tokenizer`` (e.g. restored from a checkpoint) is used as is instead of ``cfg.tokenizer``.
    Raises ``DataError`` for unusable data, including a training split shorter than ``seq_len + 1``
    tokens or a held-out split too short for one evaluation window.  Extra ``val_sets`` entries that
    are registry corpora whose package is missing are skipped with a warning.
    """
    if not is_int(seq_len) or seq_len < 1:
        raise ConfigError("seq_len", seq_len, "integer >= 1")
    if cfg.val_tokens < seq_len + 1:
        raise ConfigError("data.val_tokens", cfg.val_tokens, f"integer >= seq_len+1 = {seq_len + 1}")
    if cfg.bundle:
        from mhmoe.data.bundle import read_bundle

        tok, train_tokens_, val, manifest = read_bundle(cfg, seq_len=seq_len, tokenizer=tokenizer)
        return PreparedData(tokenizer=tok, train=train_tokens_, val=val, manifest=manifest)
    cache = usable_cache_dir(cfg.cache_dir)  # a cache_dir that cannot be created: one line naming it, at once
    t0 = time.perf_counter()
    corpus = load_corpus(cfg.corpus, jsonl_field=cfg.jsonl_field, cache_dir=cfg.cache_dir, progress=progress)
    load_s = time.perf_counter() - t0
    if len(corpus.documents) < 2:
        raise DataError(
            f"corpus {cfg.corpus!r}: only {len(corpus.documents)} document; need >= 2 to hold out a "
            f"validation split (a text file is cut into ~4 KB documents at blank lines)"
        )
    t0 = time.perf_counter()
    tok = tokenizer if tokenizer is not None else _tokenizer_for(cfg, corpus, cache, progress)
    tok_s = time.perf_counter() - t0
    train = load_or_build_tokens(cache, corpus.key, "train", corpus.split("train"), tok, progress=progress)
    need = seq_len + 1
    if len(train.tokens) < need:
        raise DataError(
            f"corpus {cfg.corpus!r}: training split has {len(train.tokens)} tokens ({tok.name}); "
            f"one training sequence needs seq_len+1 = {need}"
        )
    own = load_or_build_tokens(cache, corpus.key, "val", corpus.split("val"), tok, max_tokens=cfg.val_tokens)
    if len(own.tokens) < need:
        raise DataError(
            f"corpus {cfg.corpus!r}: validation split has {len(own.tokens)} tokens ({tok.name}); "
            f"one evaluation window needs seq_len+1 = {need}"
        )
    own_name = _val_name(corpus, cfg.corpus, set())
    val, val_info, skipped = {own_name: own.tokens}, {own_name: _describe(own)}, []
    for spec in dict.fromkeys(cfg.val_sets):  # de-duplicated, order kept
        if spec == cfg.corpus:
            continue
        try:
            extra = load_corpus(spec, jsonl_field=cfg.jsonl_field, cache_dir=cfg.cache_dir)
        except CorpusUnavailableError as e:
            warnings.warn(f"skipping validation set {spec!r}: {e}", stacklevel=2)
            skipped.append(spec)
            continue
        split = "val" if spec in REGISTRY else "all"
        docs = extra.split("val") if split == "val" else list(extra.documents)
        tf = load_or_build_tokens(cache, extra.key, split, docs, tok, max_tokens=cfg.val_tokens)
        name = _val_name(extra, spec, set(val))
        if len(tf.tokens) < need:
            warnings.warn(
                f"skipping validation set {spec!r}: {len(tf.tokens)} tokens < seq_len+1 = {need}",
                stacklevel=2,
            )
            skipped.append(spec)
            continue
        val[name], val_info[name] = tf.tokens, _describe(tf)
    manifest = {
        "corpus": cfg.corpus,
        "corpus_key": corpus.key,
        "corpus_source": corpus.source,
        "n_documents": {s: len(d) for s, d in corpus.splits().items()},
        "tokenizer": {
            "name": tok.name,
            "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id,
            "fingerprint": tok.fingerprint,
        },
        "train_tokens": int(len(train.tokens)),
        "train": _describe(train),
        "val": val_info,
        "skipped_val_sets": skipped,
        "timings": {"load_corpus_s": load_s, "tokenizer_s": tok_s},
    }
    log.info("data: train %d tokens, val %s", len(train.tokens), {k: len(v) for k, v in val.items()})
    return PreparedData(tokenizer=tok, train=train.tokens, val=val, manifest=manifest)
