"""Byte-level BPE trained with Hugging Face ``tokenizers`` (the default ``bpe`` tokenizer).

GPT-2 style: byte-level pre-tokenizer (GPT-2 regex, no prefix space), all 256 byte symbols in the
initial alphabet (so any text round-trips), ``<|endoftext|>`` as special token id 0 (EOS).
:func:`load_or_train_bpe` caches the trained tokenizer under
``<cache>/tokenizers/bpe-<vocab>-<key>/`` where ``key`` hashes (training text, vocab size,
:data:`BPE_VERSION`, ``tokenizers`` version).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from mhmoe.config.data import MIN_BPE_VOCAB
from mhmoe.data.documents import Document, source_hash
from mhmoe.data.tokenizer_base import EOS_TEXT, Tokenizer, encode_in_pieces, sha256_hex
from mhmoe.errors import DataError
from mhmoe.runtime.bounded import MAX_JSON_CHARS
from mhmoe.runtime.files import atomic_write
from mhmoe.runtime.reading import read_text

BPE_VERSION = 1
BPE_FILE = "tokenizer.json"
log = logging.getLogger(__name__)


class BPETokenizer(Tokenizer):
    """A trained byte-level BPE (wraps a ``tokenizers.Tokenizer``)."""

    kind = "bpe"

    def __init__(self, hf: HFTokenizer, name: str = "bpe") -> None:
        eos = hf.token_to_id(EOS_TEXT)
        if eos is None:
            raise DataError(f"bpe tokenizer: vocabulary lacks the {EOS_TEXT} special token")
        try:  # a literal "<|endoftext|>" in the input is ordinary text (tokenizers >= 0.15.1)
            hf.encode_special_tokens = True
        except AttributeError:
            log.warning("tokenizers %s: a literal %s will encode as EOS", tokenizers.__version__, EOS_TEXT)
        self._hf = hf
        self._json = hf.to_str()
        self.name = name
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        self.eos_id = eos

    def encode(self, text: str) -> list[int]:
        return self._hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        enc = getattr(self._hf, "encode_batch_fast", self._hf.encode_batch)
        return encode_in_pieces(texts, lambda pieces: (e.ids for e in enc(pieces, add_special_tokens=False)))

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise DataError(f"bpe tokenizer: token id {bad[0]} out of range 0..{self.vocab_size - 1}")
        return self._hf.decode(ids, skip_special_tokens=False)

    @property
    def fingerprint(self) -> str:
        return sha256_hex("bpe", self._json)

    def _save_files(self, directory: Path) -> dict[str, Any]:
        atomic_write(directory / BPE_FILE, self._json.encode("utf-8"))
        return {"file": BPE_FILE, "tokenizers_version": tokenizers.__version__}

    @classmethod
    def _from_saved(cls, directory: Path, meta: dict[str, Any]) -> Tokenizer:
        path = directory / BPE_FILE
        try:
            hf = HFTokenizer.from_str(read_text(path, MAX_JSON_CHARS, what="tokenizer"))  # a FIFO never blocks
        except Exception as e:  # missing file, bad JSON, or a schema the library rejects
            raise DataError(f"{path}: cannot load BPE tokenizer ({type(e).__name__}: {e})") from None
        return cls(hf, name=str(meta.get("name", "bpe")))


def train_bpe(texts: Iterable[str], vocab_size: int = 8192, *, progress: bool = False) -> BPETokenizer:
    """Train a byte-level BPE of ``vocab_size`` ids (including EOS) on ``texts``; deterministic."""
    if vocab_size < MIN_BPE_VOCAB:
        raise DataError(f"bpe vocab_size {vocab_size}: must be >= {MIN_BPE_VOCAB} (256 bytes + EOS)")
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    hf.train_from_iterator(texts, trainer=trainer)
    return BPETokenizer(hf)


def bpe_cache_key(train_hash: str, vocab_size: int) -> str:
    """Cache key of a BPE trained on text with source hash ``train_hash``."""
    return sha256_hex("bpe", str(BPE_VERSION), tokenizers.__version__, str(vocab_size), train_hash)[:16]


def load_or_train_bpe(
    documents: Sequence[Document], vocab_size: int, cache_dir: Path, *, progress: bool = False
) -> BPETokenizer:
    """Load the cached BPE for (``documents``, ``vocab_size``) or train and cache it.

    A cached tokenizer that fails to load (missing/corrupt files, fingerprint mismatch) is retrained.
    """
    directory = (
        cache_dir / "tokenizers" / f"bpe-{vocab_size}-{bpe_cache_key(source_hash(documents), vocab_size)}"
    )
    if (directory / "tokenizer_meta.json").exists():
        try:
            tok = BPETokenizer.load(directory)
            if isinstance(tok, BPETokenizer) and tok.vocab_size <= vocab_size:
                return tok
            log.warning("cached tokenizer %s has the wrong kind/size; retraining", directory)
        except DataError as e:
            log.warning("cached tokenizer unusable (%s); retraining", e)
    t0 = time.perf_counter()
    tok = train_bpe((d.text for d in documents), vocab_size, progress=progress)
    log.info(
        "trained bpe vocab=%d on %d documents in %.2fs",
        tok.vocab_size,
        len(documents),
        time.perf_counter() - t0,
    )
    tok.save(directory)
    return tok
