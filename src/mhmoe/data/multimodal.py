"""Masked multi-modal data (BEiT-3 style, small scale) for a bidirectional encoder.

Three kinds of sequences, as in BEiT-3's pre-training, all of length ``seq_len = P + text_len + 3``
(``P`` = patches per image):

* ``image`` (kind 0):  ``[CLS] v_1 .. v_P [SEP] [PAD]...``
* ``text``  (kind 1):  ``[CLS] t_1 .. t_{seq_len-2} [SEP]`` (a window of the text corpus)
* ``pair``  (kind 2):  ``[CLS] v_1 .. v_P [SEP] c_1 .. c_n [SEP] [PAD]...`` (image + its caption,
  ``n <= text_len``)

One vocabulary (:class:`MultimodalVocab`): text ids ``[0, V_text)`` (any mhmoe tokenizer), visual
codes ``[V_text, V_text + K)`` (k-means codebook, :mod:`mhmoe.data.images`), then ``[PAD]``,
``[MASK]``, ``[CLS]``, ``[SEP]``.  Masking (BEiT-3's ratios by default): 40% of the image patches,
block-wise as in BEiT (or uniformly at random), 15% of the tokens of a text-only window and 50% of
a caption's tokens; masked positions get ``[MASK]`` in ``input_ids``, the original id in
``targets``, and ``loss_mask`` True.  Masked-prediction perplexity = exp(mean cross-entropy over
``loss_mask``), reported per modality with ``modality`` (0 text, 1 image); see
:func:`masked_perplexity_groups`.

Everything is a pure function of its arguments: a training batch of ``(seed, step, micro_step,
rank)`` (the same sha256 seeding as :class:`~mhmoe.data.sampler.BatchSampler`), a validation example
of its index (fixed masks, so validation perplexities are comparable across models and runs).
Train and validation use disjoint images (:class:`~mhmoe.data.images.ImageSet` splits) and disjoint
text documents (the text corpus's document-level splits).

For ICML Fig. 8 (patches coloured by how many distinct experts their sub-tokens go to), a batch
carries ``patch_pos`` (grid row/col per position, -1 elsewhere) and ``image_index``; the raw image
is :meth:`MaskedMultimodalData.image`, the grid :attr:`MaskedMultimodalData.grid`, and
:func:`values_to_grid` scatters per-position values of one example onto the grid.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch

from mhmoe.data.images import ImageSet, VisualCodebook, load_image_set, load_or_fit_codebook
from mhmoe.data.masking import MaskingConfig, block_mask, n_masked, random_mask
from mhmoe.data.token_cache import default_cache_dir, load_or_build_tokens
from mhmoe.data.tokenizer import Tokenizer
from mhmoe.errors import ConfigError, DataError

KIND_IMAGE, KIND_TEXT, KIND_PAIR = 0, 1, 2
KINDS: tuple[str, ...] = ("image", "text", "pair")
MODALITY_TEXT, MODALITY_IMAGE = 0, 1
SPECIALS: tuple[str, ...] = ("[PAD]", "[MASK]", "[CLS]", "[SEP]")


@dataclass(frozen=True)
class MultimodalVocab:
    """Id layout: text ``[0, text_size)``, visual codes ``[text_size, text_size + n_codes)``, then
    ``[PAD] [MASK] [CLS] [SEP]``."""

    text_size: int
    n_codes: int

    @property
    def code_offset(self) -> int:
        return self.text_size

    @property
    def pad_id(self) -> int:
        return self.text_size + self.n_codes

    @property
    def mask_id(self) -> int:
        return self.pad_id + 1

    @property
    def cls_id(self) -> int:
        return self.pad_id + 2

    @property
    def sep_id(self) -> int:
        return self.pad_id + 3

    @property
    def size(self) -> int:
        return self.pad_id + len(SPECIALS)


@dataclass
class MultimodalBatch:
    """A batch for a bidirectional encoder.  All ``[B, T]`` unless noted:

    * ``input_ids`` int64 (masked inputs), ``targets`` int64 (original ids everywhere),
      ``loss_mask`` bool (masked positions: predict ``targets`` there);
    * ``modality`` int64 (0 text, 1 image; ``[CLS]``/``[SEP]`` take their segment's modality, padding 0),
      ``attention_mask`` bool (False on ``[PAD]``), ``position`` int64 (0..T-1);
    * ``patch_pos`` int64 ``[B, T, 2]`` (grid row, col of image patches; -1 elsewhere);
    * ``kind`` int64 ``[B]`` (0 image, 1 text, 2 pair), ``image_index`` int64 ``[B]`` (index into
      the image set, -1 for text).
    """

    input_ids: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    modality: torch.Tensor
    attention_mask: torch.Tensor
    position: torch.Tensor
    patch_pos: torch.Tensor
    kind: torch.Tensor
    image_index: torch.Tensor

    def to(self, device: torch.device | str) -> MultimodalBatch:
        return MultimodalBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def collate(examples: Sequence[MultimodalBatch]) -> MultimodalBatch:
    """Concatenate batches (e.g. single examples) along the batch dimension."""
    return MultimodalBatch(
        **{f.name: torch.cat([getattr(e, f.name) for e in examples]) for f in fields(MultimodalBatch)}
    )


def example_seed(*parts: object) -> int:
    """63-bit generator seed from sha256 of the parts (``mhmoe-mm:`` prefixed)."""
    digest = hashlib.sha256(("mhmoe-mm:" + ":".join(map(str, parts))).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def values_to_grid(
    batch: MultimodalBatch, row: int, values: torch.Tensor | np.ndarray, grid: tuple[int, int]
) -> np.ndarray:
    """Scatter per-position ``values [T]`` of example ``row`` onto its patch grid: float64
    ``[rows, cols]`` (NaN where the example has no patch, e.g. a text-only row)."""
    vals = np.asarray(torch.as_tensor(values).detach().cpu(), dtype=np.float64)
    out = np.full(grid, np.nan)
    pos = batch.patch_pos[row].cpu().numpy()
    for t in np.nonzero(pos[:, 0] >= 0)[0]:
        out[pos[t, 0], pos[t, 1]] = vals[t]
    return out


def masked_perplexity_groups(batch: MultimodalBatch, token_loss: torch.Tensor) -> dict[str, tuple[float, int]]:
    """Sum of per-position losses ``token_loss [B, T]`` (nats) and counts over masked positions,
    by group: ``all``, ``image`` (masked patches), ``text`` (masked text tokens).  Accumulate sums
    and counts over validation batches; perplexity = exp(sum / count)."""
    out = {}
    for name, sel in (
        ("all", batch.loss_mask),
        ("image", batch.loss_mask & (batch.modality == MODALITY_IMAGE)),
        ("text", batch.loss_mask & (batch.modality == MODALITY_TEXT)),
    ):
        out[name] = (float(token_loss[sel].double().sum()), int(sel.sum()))
    return out


class MaskedMultimodalData:
    """Training batches and fixed validation examples of masked multi-modal modelling.

    ``text_train``/``text_val`` are 1-D token arrays (e.g. token-cache memmaps, EOS-separated
    documents) of the text corpus's train/val splits, tokenized with a tokenizer of
    ``text_vocab_size`` ids.  ``captions`` are token ids per image (any length; cut to ``text_len``).
    """

    def __init__(
        self,
        images: ImageSet,
        codebook: VisualCodebook,
        *,
        text_vocab_size: int,
        text_train: np.ndarray,
        text_val: np.ndarray,
        captions: Sequence[Sequence[int]],
        text_len: int = 16,
        masking: MaskingConfig | None = None,
        mix: Sequence[float] = (1.0, 1.0, 1.0),
        seed: int = 1234,
        val_text_windows: int = 256,
    ) -> None:
        if codebook.codes.shape != (len(images.images), images.n_patches):
            raise DataError("codebook codes do not match the image set (fit it on this set)")
        if len(captions) != len(images.images):
            raise DataError(f"{len(captions)} captions for {len(images.images)} images")
        if not isinstance(text_len, int) or text_len < 1:
            raise ConfigError("text_len", text_len, "integer >= 1")
        if len(mix) != 3 or any(m < 0 for m in mix) or sum(mix) <= 0:
            raise ConfigError("mix", tuple(mix), "three weights >= 0 (image, text, pair), not all 0")
        self.images = images
        self.codebook = codebook
        self.vocab = MultimodalVocab(text_vocab_size, codebook.size)
        self.text_len = text_len
        self.seq_len = images.n_patches + text_len + 3
        self.masking = masking or MaskingConfig()
        self.mix = tuple(float(m) for m in mix)
        self.seed = seed
        self.text = {"train": text_train, "val": text_val}
        self.captions = [list(map(int, c))[:text_len] for c in captions]
        self.val_text_windows = val_text_windows
        self._val_cache: dict[int, list[MultimodalBatch]] = {}
        self.grid = images.grid
        self.patch_size = images.patch
        self.split_images = {s: images.split_indices(s) for s in ("train", "val", "test")}
        for split in ("train", "val"):
            if len(self.text[split]) < self.seq_len - 1:
                raise DataError(
                    f"text {split} split has {len(self.text[split])} tokens; a text window needs {self.seq_len - 1}"
                )
            if len(self.split_images[split]) == 0:
                raise DataError(f"image set {images.name!r}: empty {split} split")

    # -- analysis helpers -------------------------------------------------------------------
    def image(self, index: int) -> np.ndarray:
        """The raw image ``uint8 [H, W, C]`` of image-set index ``index``."""
        return self.images.images[index]

    def caption(self, index: int) -> str:
        return self.images.captions[index]

    # -- building sequences -----------------------------------------------------------------
    def _empty(self) -> dict[str, torch.Tensor]:
        t = self.seq_len
        return {
            "input_ids": torch.full((t,), self.vocab.pad_id, dtype=torch.int64),
            "modality": torch.full((t,), MODALITY_TEXT, dtype=torch.int64),
            "patch_pos": torch.full((t, 2), -1, dtype=torch.int64),
            "loss_mask": torch.zeros(t, dtype=torch.bool),
        }

    def _put_image(self, ex: dict[str, torch.Tensor], index: int, mask: bool, gen: torch.Generator) -> int:
        p = self.images.n_patches
        rows, cols = self.grid
        codes = torch.from_numpy(np.asarray(self.codebook.codes[index], dtype=np.int64)) + self.vocab.code_offset
        ex["input_ids"][0] = self.vocab.cls_id
        ex["input_ids"][1 : p + 1] = codes
        ex["input_ids"][p + 1] = self.vocab.sep_id
        ex["modality"][: p + 2] = MODALITY_IMAGE
        k = torch.arange(p)
        ex["patch_pos"][1 : p + 1, 0] = k // cols
        ex["patch_pos"][1 : p + 1, 1] = k % cols
        if mask:
            m = self.masking
            count = n_masked(p, m.image_ratio)
            if m.image_mode == "block":
                pm = block_mask(rows, cols, count, gen, m.min_block)
            else:
                pm = random_mask(p, count, gen)
            ex["loss_mask"][1 : p + 1] = pm
        return p + 2

    def _put_text(
        self, ex: dict[str, torch.Tensor], start: int, ids: Sequence[int], ratio: float | None, gen: torch.Generator
    ) -> None:
        n = len(ids)
        if start > 0:  # a caption after the image segment
            ex["input_ids"][start : start + n] = torch.tensor(list(ids), dtype=torch.int64)
            ex["input_ids"][start + n] = self.vocab.sep_id
        else:
            ex["input_ids"][0] = self.vocab.cls_id
            ex["input_ids"][1 : n + 1] = torch.tensor(list(ids), dtype=torch.int64)
            ex["input_ids"][n + 1] = self.vocab.sep_id
            start = 1
        ex["modality"][start : start + n + 1] = MODALITY_TEXT
        if ratio is not None and n > 0:
            ex["loss_mask"][start : start + n] = random_mask(n, n_masked(n, ratio), gen)

    def _finish(self, ex: dict[str, torch.Tensor], kind: int, image_index: int) -> MultimodalBatch:
        targets = ex["input_ids"].clone()
        inputs = torch.where(ex["loss_mask"], torch.tensor(self.vocab.mask_id), targets)
        t = self.seq_len
        return MultimodalBatch(
            input_ids=inputs[None],
            targets=targets[None],
            loss_mask=ex["loss_mask"][None],
            modality=ex["modality"][None],
            attention_mask=(targets != self.vocab.pad_id)[None],
            position=torch.arange(t, dtype=torch.int64)[None],
            patch_pos=ex["patch_pos"][None],
            kind=torch.tensor([kind], dtype=torch.int64),
            image_index=torch.tensor([image_index], dtype=torch.int64),
        )

    def image_example(self, index: int, *, pair: bool = False, mask: bool = True, seed: int = 0) -> MultimodalBatch:
        """One image (``pair=False``) or image-caption (``pair=True``) example of image ``index``
        (any split); ``mask=False`` gives the unmasked sequence (e.g. for routing analysis)."""
        gen = torch.Generator().manual_seed(example_seed(self.seed, "image", index, pair, seed))
        ex = self._empty()
        end = self._put_image(ex, index, mask, gen)
        if pair:
            ratio = self.masking.pair_text_ratio if mask else None
            self._put_text(ex, end, self.captions[index], ratio, gen)
        return self._finish(ex, KIND_PAIR if pair else KIND_IMAGE, index)

    def text_example(self, split: str, offset: int, *, mask: bool = True, seed: int = 0) -> MultimodalBatch:
        """A text-only window of ``seq_len - 2`` tokens at ``offset`` of the ``split`` text stream."""
        n = self.seq_len - 2
        ids = np.asarray(self.text[split][offset : offset + n], dtype=np.int64).tolist()
        if len(ids) != n:
            raise DataError(f"text window at {offset} runs past the {split} stream ({len(self.text[split])} tokens)")
        gen = torch.Generator().manual_seed(example_seed(self.seed, "text", split, offset, seed))
        ex = self._empty()
        self._put_text(ex, 0, ids, self.masking.text_ratio if mask else None, gen)
        return self._finish(ex, KIND_TEXT, -1)

    def kinds_for_batch(self, batch_size: int) -> list[int]:
        """Kinds of a batch's rows: counts proportional to ``mix`` (largest remainder), in kind order."""
        total = sum(self.mix)
        quotas = [batch_size * m / total for m in self.mix]
        counts = [int(q) for q in quotas]
        for i in sorted(range(3), key=lambda i: (-(quotas[i] - counts[i]), i))[: batch_size - sum(counts)]:
            counts[i] += 1
        return [k for k in range(3) for _ in range(counts[k])]

    def get_batch(self, step: int, micro_step: int = 0, *, batch_size: int, rank: int = 0) -> MultimodalBatch:
        """Training batch: a pure function of ``(seed, step, micro_step, rank)``; train images and text only."""
        gen = torch.Generator().manual_seed(example_seed(self.seed, "batch", step, micro_step, rank))
        train_images = self.split_images["train"]
        n_text = len(self.text["train"]) - (self.seq_len - 2) + 1
        rows = []
        for j, kind in enumerate(self.kinds_for_batch(batch_size)):
            if kind == KIND_TEXT:
                offset = int(torch.randint(n_text, (), generator=gen))
                rows.append(self.text_example("train", offset, seed=f"{step}:{micro_step}:{rank}:{j}"))
            else:
                index = int(train_images[int(torch.randint(len(train_images), (), generator=gen))])
                rows.append(self.image_example(index, pair=kind == KIND_PAIR, seed=f"{step}:{micro_step}:{rank}:{j}"))
        return collate(rows)

    def val_examples(self) -> list[tuple[str, int, int]]:
        """The fixed validation set: ``(kind, image index or text offset)`` per example as
        ``(kind_name, kind, key)``: every val image alone, every val image with its caption, and up
        to ``val_text_windows`` consecutive non-overlapping windows of the val text stream."""
        out = [("image", KIND_IMAGE, int(i)) for i in self.split_images["val"]]
        out += [("pair", KIND_PAIR, int(i)) for i in self.split_images["val"]]
        n = self.seq_len - 2
        windows = min(self.val_text_windows, len(self.text["val"]) // n)
        out += [("text", KIND_TEXT, w * n) for w in range(windows)]
        return out

    def val_example(self, kind: int, key: int) -> MultimodalBatch:
        if kind == KIND_TEXT:
            return self.text_example("val", key, seed="val")
        return self.image_example(key, pair=kind == KIND_PAIR, seed="val")

    def iter_val_batches(self, batch_size: int, max_batches: int | None = None) -> Iterator[MultimodalBatch]:
        """The validation set in fixed order and fixed masks, ``batch_size`` examples per batch."""
        examples = self.val_examples()
        cache = self._val_cache.setdefault(batch_size, [])  # fixed examples: build each batch once
        for b, start in enumerate(range(0, len(examples), batch_size)):
            if max_batches is not None and b >= max_batches:
                return
            if b == len(cache):
                cache.append(collate([self.val_example(k, key) for _, k, key in examples[start : start + batch_size]]))
            yield cache[b]

    def describe(self) -> dict[str, Any]:
        """Sizes for a manifest or a report."""
        return {
            "image_set": self.images.name,
            "images": {s: len(v) for s, v in self.split_images.items()},
            "image_shape": list(self.images.images.shape[1:]),
            "patch": self.patch_size,
            "grid": list(self.grid),
            "codebook_size": self.codebook.size,
            "codebook_key": self.codebook.key,
            "captions_real": self.images.captions_real,
            "text_tokens": {s: len(v) for s, v in self.text.items()},
            "vocab_size": self.vocab.size,
            "seq_len": self.seq_len,
            "masking": dict(self.masking.__dict__),
            "n_val_examples": len(self.val_examples()),
        }


@dataclass
class MultimodalConfig:
    """What :func:`prepare_multimodal` builds."""

    image_set: str = "emoji"  # emoji | digits
    codebook_size: int = 0  # 0: the image set's default (digits 64, emoji 256)
    text_corpus: str = "kjv"  # registry name or path: the text-only stream
    tokenizer: str = "byte"  # byte | gpt2 | cl100k_base | bpe
    vocab_size: int = 8192  # for bpe
    text_len: int = 16  # caption tokens per pair
    val_text_tokens: int = 65536
    mix: tuple[float, float, float] = (1.0, 1.0, 1.0)  # image, text, pair
    masking: MaskingConfig = field(default_factory=MaskingConfig)
    seed: int = 1234
    codebook_seed: int = 0
    cache_dir: str = ""


def prepare_multimodal(
    cfg: MultimodalConfig, *, tokenizer: Tokenizer | None = None, progress: bool = False
) -> MaskedMultimodalData:
    """Image set + cached codebook + tokenized text corpus (train/val splits) -> the data module."""
    from mhmoe.data.bpe import load_or_train_bpe
    from mhmoe.data.corpora import load_corpus
    from mhmoe.data.tokenizer import get_pretrained_tokenizer

    images = load_image_set(cfg.image_set, cache_dir=cfg.cache_dir)
    codebook = load_or_fit_codebook(images, cfg.codebook_size or None, seed=cfg.codebook_seed, cache_dir=cfg.cache_dir)
    corpus = load_corpus(cfg.text_corpus, cache_dir=cfg.cache_dir)
    cache = default_cache_dir(cfg.cache_dir)
    if tokenizer is None:
        if cfg.tokenizer == "bpe":
            tokenizer = load_or_train_bpe(corpus.split("train"), cfg.vocab_size, cache, progress=progress)
        else:
            tokenizer = get_pretrained_tokenizer(cfg.tokenizer)
    train = load_or_build_tokens(cache, corpus.key, "train", corpus.split("train"), tokenizer, progress=progress)
    val = load_or_build_tokens(cache, corpus.key, "val", corpus.split("val"), tokenizer, max_tokens=cfg.val_text_tokens)
    captions = tokenizer.encode_batch(list(images.captions))
    return MaskedMultimodalData(
        images,
        codebook,
        text_vocab_size=tokenizer.vocab_size,
        text_train=train.tokens,
        text_val=val.tokens,
        captions=captions,
        text_len=cfg.text_len,
        masking=cfg.masking,
        mix=cfg.mix,
        seed=cfg.seed,
    )


__all__ = [
    "KINDS",
    "KIND_IMAGE",
    "KIND_PAIR",
    "KIND_TEXT",
    "MODALITY_IMAGE",
    "MODALITY_TEXT",
    "MaskedMultimodalData",
    "MaskingConfig",
    "MultimodalBatch",
    "MultimodalConfig",
    "MultimodalVocab",
    "block_mask",
    "collate",
    "masked_perplexity_groups",
    "n_masked",
    "prepare_multimodal",
    "random_mask",
    "values_to_grid",
]
