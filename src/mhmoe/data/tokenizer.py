"""Tokenizers by name: the registry of tokenizer kinds (``byte``, ``bpe``, ``tiktoken``) and the
pretrained vocabularies (``gpt2``, ``cl100k_base``, ``byte``).

The interface and the byte tokenizer live in :mod:`mhmoe.data.tokenizer_base`; the kinds in
:mod:`mhmoe.data.bpe` and :mod:`mhmoe.data.tiktoken_tok`. This module imports them all (one way).
"""

from __future__ import annotations

import os
from pathlib import Path

from mhmoe.data.bpe import BPETokenizer
from mhmoe.data.tiktoken_tok import TiktokenTokenizer, load_cl100k_base, load_gpt2
from mhmoe.data.tokenizer_base import EOS_TEXT, META_FILE, ByteTokenizer, Tokenizer, read_tokenizer_meta
from mhmoe.errors import DataError

PRETRAINED: tuple[str, ...] = ("gpt2", "cl100k_base", "byte")
TOKENIZER_CLASSES: dict[str, type[Tokenizer]] = {"byte": ByteTokenizer, "bpe": BPETokenizer,
                                                 "tiktoken": TiktokenTokenizer}


def load_tokenizer(directory: str | os.PathLike[str]) -> Tokenizer:
    """Load any tokenizer saved with :meth:`Tokenizer.save`; DataError if missing, corrupt or altered."""
    d = Path(directory)
    kind = read_tokenizer_meta(d)["kind"]
    if kind not in TOKENIZER_CLASSES:
        raise DataError(f"{d / META_FILE}: unknown tokenizer kind {kind!r} (known: {', '.join(TOKENIZER_CLASSES)})")
    return TOKENIZER_CLASSES[kind].load(d)


def get_pretrained_tokenizer(name: str) -> Tokenizer:
    """``byte``, ``gpt2`` or ``cl100k_base`` (the latter two from pip-installed vocab files)."""
    if name == "byte":
        return ByteTokenizer()
    if name in ("gpt2", "cl100k_base"):
        return load_gpt2() if name == "gpt2" else load_cl100k_base()
    raise DataError(f"tokenizer {name!r}: not a pretrained tokenizer (choose from {', '.join(PRETRAINED)})")


__all__ = ["EOS_TEXT", "PRETRAINED", "TOKENIZER_CLASSES", "ByteTokenizer", "Tokenizer", "get_pretrained_tokenizer",
           "load_tokenizer"]
