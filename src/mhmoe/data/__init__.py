"""Data and tokenizers for mhmoe: corpora, document splits, tokenizers, token caches, batch samplers.

Entry point for the trainer::

    from mhmoe.config import DataConfig
    from mhmoe.data import prepare_data, BatchSampler, iter_eval_batches

    data = prepare_data(DataConfig(), seq_len=256)
    sampler = BatchSampler(data.train, batch_size=32, seq_len=256, seed=cfg.seed)
    x, y = sampler.get_batch(step)                      # pure function of (seed, step, micro_step, rank)
    for x, y in iter_eval_batches(data.val["kjv"], batch_size=32, seq_len=256, max_batches=20): ...

See docs/DATA.md for corpora, split rules, tokenizers and the cache format.

The names below are loaded on first use: importing one module of the package (a tokenizer, the sampler)
does not import every corpus reader.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mhmoe.runtime.lazy import lazy_exports

_EXPORTS = {
    "mhmoe.config.data": ("DataConfig",),
    "mhmoe.data.bpe": ("BPETokenizer", "load_or_train_bpe", "train_bpe"),
    "mhmoe.data.corpora": ("REGISTRY", "CorpusUnavailableError", "load_corpus", "registry_names"),
    "mhmoe.data.documents": ("Corpus", "Document", "assign_splits", "chunk_text", "source_hash"),
    "mhmoe.data.images": ("ImageSet", "VisualCodebook", "load_image_set", "load_or_fit_codebook"),
    "mhmoe.data.manpages": ("MANPAGES_VAL_SETS", "load_man_language", "load_manpages"),
    "mhmoe.data.multimodal": (
        "MaskedMultimodalData",
        "MaskingConfig",
        "MultimodalBatch",
        "MultimodalConfig",
        "masked_perplexity_groups",
        "prepare_multimodal",
        "values_to_grid",
    ),
    "mhmoe.data.prepare": ("PreparedData", "epochs", "prepare_data", "train_tokens"),
    "mhmoe.data.sampler": ("BatchSampler", "batch_seed", "count_eval_batches", "iter_eval_batches"),
    "mhmoe.data.tiktoken_tok": ("TiktokenTokenizer", "load_cl100k_base", "load_gpt2"),
    "mhmoe.data.token_cache": ("TokenFile", "default_cache_dir", "load_or_build_tokens", "token_dtype"),
    "mhmoe.data.tokenizer": ("EOS_TEXT", "ByteTokenizer", "Tokenizer", "get_pretrained_tokenizer", "load_tokenizer"),
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)

if TYPE_CHECKING:  # static analysers see the real names
    from mhmoe.config.data import DataConfig
    from mhmoe.data.bpe import BPETokenizer, load_or_train_bpe, train_bpe
    from mhmoe.data.corpora import REGISTRY, CorpusUnavailableError, load_corpus, registry_names
    from mhmoe.data.documents import Corpus, Document, assign_splits, chunk_text, source_hash
    from mhmoe.data.images import ImageSet, VisualCodebook, load_image_set, load_or_fit_codebook
    from mhmoe.data.manpages import MANPAGES_VAL_SETS, load_man_language, load_manpages
    from mhmoe.data.multimodal import (
        MaskedMultimodalData,
        MaskingConfig,
        MultimodalBatch,
        MultimodalConfig,
        masked_perplexity_groups,
        prepare_multimodal,
        values_to_grid,
    )
    from mhmoe.data.prepare import PreparedData, epochs, prepare_data, train_tokens
    from mhmoe.data.sampler import BatchSampler, batch_seed, count_eval_batches, iter_eval_batches
    from mhmoe.data.tiktoken_tok import TiktokenTokenizer, load_cl100k_base, load_gpt2
    from mhmoe.data.token_cache import TokenFile, default_cache_dir, load_or_build_tokens, token_dtype
    from mhmoe.data.tokenizer import EOS_TEXT, ByteTokenizer, Tokenizer, get_pretrained_tokenizer, load_tokenizer
