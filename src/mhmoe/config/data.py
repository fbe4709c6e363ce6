"""Data configuration: :class:`DataConfig` (what to train and validate on; see docs/DATA.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from mhmoe.config.fields import check_types, is_int
from mhmoe.errors import ConfigError

MIN_BPE_VOCAB = 257  # 256 byte symbols + EOS
Tokenizer = Literal["bpe", "gpt2", "cl100k_base", "byte"]
TOKENIZERS: tuple[str, ...] = get_args(Tokenizer)
MAX_BPE_VOCAB = 1 << 20
# lm: next-token prediction on a text corpus (model.arch=decoder); masked_mm: masked multi-modal
# modelling on images + text (model.arch=encoder; mhmoe.data.multimodal, docs/ICML-SETTINGS.md)
Task = Literal["lm", "masked_mm"]
ImageSet = Literal["emoji", "digits"]  # mhmoe.data.images.IMAGE_SETS
TASKS: tuple[str, ...] = get_args(Task)
IMAGE_SETS: tuple[str, ...] = get_args(ImageSet)


@dataclass
class DataConfig:
    """What to train and validate on; validated on construction (``ConfigError``)."""

    corpus: str = "kjv"  # registry name (kjv, pydocs, wordnet, manpages, man-<lang>) or a path (file/dir/jsonl/parquet)
    jsonl_field: str = "text"  # text field of .jsonl rows / .parquet column
    tokenizer: Tokenizer = "bpe"  # bpe | gpt2 | cl100k_base | byte
    vocab_size: int = 8192  # for bpe
    val_sets: tuple[str, ...] = ("kjv", "pydocs", "wordnet")  # extra cross-domain validation corpora
    val_tokens: int = 65536  # cap of tokens per validation set
    cache_dir: str = ""  # default: $MHMOE_CACHE or ~/.cache/mhmoe
    seed: int = 1234
    # a data bundle directory (mhmoe data bundle): tokenizer + tokens, no corpus package needed; '' = none
    bundle: str = ""
    # ---- masked multi-modal modelling (task=masked_mm; corpus is then the text-only stream) ------
    task: Task = "lm"  # lm | masked_mm
    image_set: ImageSet = "emoji"  # emoji | digits
    codebook_size: int = 0  # visual vocabulary (k-means codes); 0 = the image set's default
    text_len: int = 16  # caption tokens of an image-text pair (sequence length = patches + text_len + 3)

    def __post_init__(self) -> None:
        if isinstance(self.val_sets, (list, str)):
            self.val_sets = (self.val_sets,) if isinstance(self.val_sets, str) else tuple(self.val_sets)
        check_types(self, "data.")
        for name in ("corpus", "jsonl_field"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ConfigError(f"data.{name}", value, "a non-empty string")
        if not is_int(self.vocab_size) or not MIN_BPE_VOCAB <= self.vocab_size <= MAX_BPE_VOCAB:
            raise ConfigError(
                "data.vocab_size", self.vocab_size, f"integer in {MIN_BPE_VOCAB}..{MAX_BPE_VOCAB}"
            )
        if not isinstance(self.val_sets, tuple) or not all(
            isinstance(v, str) and v.strip() for v in self.val_sets
        ):
            raise ConfigError("data.val_sets", self.val_sets, "a tuple of corpus names or paths")
        if not is_int(self.val_tokens) or self.val_tokens < 1:
            raise ConfigError("data.val_tokens", self.val_tokens, "integer >= 1")
        if not isinstance(self.cache_dir, str):
            raise ConfigError("data.cache_dir", self.cache_dir, "a directory path string ('' = default)")
        if not isinstance(self.bundle, str) or "\0" in self.bundle or (self.bundle and not self.bundle.strip()):
            raise ConfigError("data.bundle", self.bundle, "a bundle directory path ('' = none)")
        if self.bundle and self.task != "lm":
            raise ConfigError("data.bundle", self.bundle, "'' with data.task=masked_mm (bundles hold text tokens)")
        if not is_int(self.seed) or not 0 <= self.seed < 2**63:
            raise ConfigError("data.seed", self.seed, "integer in 0..2**63-1")
        self._check_masked_mm()

    def _check_masked_mm(self) -> None:
        if not is_int(self.codebook_size) or not (self.codebook_size == 0 or 2 <= self.codebook_size <= 65536):
            raise ConfigError("data.codebook_size", self.codebook_size, "0 (the image set's default) or 2..65536")
        if not is_int(self.text_len) or self.text_len < 1:
            raise ConfigError("data.text_len", self.text_len, "integer >= 1")
        if self.task == "masked_mm" and self.val_sets:
            raise ConfigError("data.val_sets", list(self.val_sets),
                              "[] with data.task=masked_mm (its validation set is the fixed masked image/text set)")
