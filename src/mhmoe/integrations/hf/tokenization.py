"""Export our tokenizers (:mod:`mhmoe.data`) as a transformers ``PreTrainedTokenizerFast``.

All four kinds convert to a Hugging Face ``tokenizers`` model with the same id mapping:

- ``bpe`` (trained with ``tokenizers``): the tokenizer itself;
- ``byte``: a byte-level BPE with the 256 byte symbols as ids 0..255, no merges, EOS = 256;
- ``tiktoken`` (``gpt2``, ``cl100k_base``): the mergeable ranks become a BPE vocabulary with the
  merges recovered from the ranks (every split of a token into two lower-ranked tokens, in rank
  order; ``ignore_merges`` reproduces tiktoken's whole-word shortcut), the tiktoken regex becomes a
  ``Split`` pre-tokenizer, and the special tokens keep their ids (cl100k has gaps in its id range).

:func:`to_hf_tokenizer` checks the converted tokenizer against ours on probe texts and raises a
one-line ``DataError`` if any id differs. One documented difference: our ``encode`` treats a literal
``<|endoftext|>`` in the text as plain text, the transformers tokenizer maps it to the EOS id.
"""

from __future__ import annotations

from functools import lru_cache

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from mhmoe.data.bpe import BPETokenizer
from mhmoe.data.tiktoken_tok import TiktokenTokenizer, parse_ranks
from mhmoe.data.tokenizer import EOS_TEXT, ByteTokenizer, Tokenizer
from mhmoe.errors import DataError

PROBES = (
    "In the beginning God created the heaven and the earth.",
    "  Multiple   spaces,\ttabs\nand\r\nnewlines\n\n  ",
    "Numbers 12345 67.89, punctuation!?;: \"quotes\" 'n' don't I'll we've",
    "Unicode: naïve café, Ελληνικά, 日本語テキスト, emoji 🙂👍🏽.",
    "def f(x):\n    return x ** 2  # code",
)


@lru_cache(maxsize=1)
def _byte_table() -> tuple[str, ...]:
    table = bytes_to_unicode()
    return tuple(table[b] for b in range(256))


def _byte_string(b: bytes) -> str:
    """The byte-level (GPT-2) unicode spelling of a byte string."""
    table = _byte_table()
    return "".join([table[c] for c in b])


def _byte_tokenizer(tok: ByteTokenizer) -> HFTokenizer:
    vocab = {_byte_string(bytes([b])): b for b in range(256)}
    vocab[EOS_TEXT] = tok.eos_id
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    return hf


def _merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[str, str]]:
    """BPE merges that rebuild every multi-byte token of ``ranks`` from two lower-ranked tokens."""
    found: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            rl, rr = ranks.get(left), ranks.get(right)
            if rl is not None and rr is not None and rl < rank and rr < rank:
                found.append((rank, rl, rr, left, right))
    found.sort()
    return [(_byte_string(a), _byte_string(b)) for _, _, _, a, b in found]


def _tiktoken_tokenizer(tok: TiktokenTokenizer) -> HFTokenizer:
    ranks = parse_ranks(tok._ranks_bytes, tok.name)
    vocab = {_byte_string(t): r for t, r in ranks.items()}
    vocab.update(tok._special)
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=_merges_from_ranks(ranks), fuse_unk=False, ignore_merges=True))
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(tok._pat_str), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    hf.decoder = decoders.ByteLevel()
    return hf


def to_hf_tokenizer(tok: Tokenizer, model_max_length: int | None = None) -> PreTrainedTokenizerFast:
    """A ``PreTrainedTokenizerFast`` with ``tok``'s ids (EOS doubles as BOS and PAD); DataError if the
    conversion does not reproduce ``tok`` on the probe texts."""
    if isinstance(tok, BPETokenizer):
        hf = HFTokenizer.from_str(tok._json)
    elif isinstance(tok, ByteTokenizer):
        hf = _byte_tokenizer(tok)
    elif isinstance(tok, TiktokenTokenizer):
        hf = _tiktoken_tokenizer(tok)
    else:
        raise DataError(f"tokenizer kind {tok.kind!r}: no transformers export (supported: bpe, byte, tiktoken)")
    specials = [t for t, i in sorted(getattr(tok, "_special", {EOS_TEXT: tok.eos_id}).items(), key=lambda x: x[1])]
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    kwargs = {} if model_max_length is None else {"model_max_length": model_max_length}
    fast = PreTrainedTokenizerFast(tokenizer_object=hf, eos_token=EOS_TEXT, bos_token=EOS_TEXT, pad_token=EOS_TEXT,
                                   clean_up_tokenization_spaces=False, **kwargs)
    for text in PROBES:
        ours, theirs = tok.encode(text), fast(text, add_special_tokens=False)["input_ids"]
        if ours != theirs or fast.decode(theirs) != tok.decode(ours):
            raise DataError(f"tokenizer {tok.name!r}: the transformers conversion differs from ours on {text[:30]!r}")
    if fast.eos_token_id != tok.eos_id:
        raise DataError(f"tokenizer {tok.name!r}: EOS id {fast.eos_token_id} after conversion, expected {tok.eos_id}")
    return fast
