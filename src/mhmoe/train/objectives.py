"""Training objectives behind one small interface, selected by ``DataConfig.task`` (the config key keeps
its name; in the code an lm-eval "task" is an evaluation, :mod:`mhmoe.integrations.lmeval`).

The trainer (:mod:`mhmoe.train.loop`) sees an objective only through :class:`Objective`:

- :func:`build_objective` prepares the data (tokenizer, caches, splits) for a run config;
- ``objective.tokenizer`` is saved with every checkpoint, ``objective.vocab_size`` sizes the model's vocabulary;
- ``objective.micro_batch(step, micro, device)`` is the micro-batch of ``(step, micro)`` on the device, a pure
  function of the seed, the step, the micro-step and the rank (bit-exact resume);
- ``objective.forward(module, batch)`` runs the model's training forward and returns its output, which has
  ``loss`` and ``aux_loss`` (0-dim tensors) and ``routing`` (one RoutingStats per MoE layer);
- ``objective.evaluate(model, ...)`` returns ``{set: {"loss", "ppl", "tokens"}}`` (calling ``on_batch``
  after each of its ``objective.eval_size(max_batches)`` batches, for a progress bar);
- ``objective.summary()`` is one line on the data (tokens per split), printed before training.

Two objectives:

- :class:`LMObjective` (``lm``): next-token prediction with the causal decoder on token windows of a text
  corpus (:func:`mhmoe.data.prepare_data`, :class:`mhmoe.data.BatchSampler`); validation perplexity on
  every validation set.
- :class:`MaskedMultimodalObjective` (``masked_mm``): masked-data modelling with the bidirectional encoder
  on images, text and image-text pairs (:mod:`mhmoe.data.multimodal`); validation perplexity of the
  masked predictions overall (``masked``) and per modality (``masked_image``, ``masked_text``) on a
  fixed set of masked examples, so the numbers are comparable across models and runs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import fields
from itertools import zip_longest
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mhmoe.config.run import RunConfig
from mhmoe.config.train import TrainConfig
from mhmoe.data import BatchSampler, PreparedData, count_eval_batches, prepare_data
from mhmoe.data.bpe import load_or_train_bpe
from mhmoe.data.corpora import load_corpus
from mhmoe.data.multimodal import (
    MaskedMultimodalData,
    MultimodalBatch,
    MultimodalConfig,
    collate,
    masked_perplexity_groups,
    prepare_multimodal,
)
from mhmoe.data.token_cache import default_cache_dir
from mhmoe.data.tokenizer import get_pretrained_tokenizer
from mhmoe.data.tokenizer_base import Tokenizer
from mhmoe.errors import ConfigError
from mhmoe.train.evaluate import evaluate

MASKED_SETS = {"all": "masked", "image": "masked_image", "text": "masked_text"}  # group -> validation set name


class Objective(Protocol):
    """What the trainer needs from a training objective (see the module docstring)."""

    name: str
    tokenizer: Tokenizer
    vocab_size: int
    manifest: dict[str, Any]

    def micro_batch(self, step: int, micro: int, device: torch.device) -> Any: ...

    def forward(self, module: nn.Module, batch: Any) -> Any: ...

    def evaluate(self, model: nn.Module, *, max_batches: int | None, device: torch.device | str,
                 dtype: str, on_batch: Callable[[], None] | None = None) -> dict[str, dict[str, float]]: ...

    def eval_size(self, max_batches: int | None) -> int: ...

    def summary(self) -> str: ...


def _to_device(t: Tensor, device: torch.device) -> Tensor:
    """Page-locked on CUDA, so the copy to the device does not wait."""
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


class LMObjective:
    """Next-token prediction: batches ``x, y`` [B, T] from :class:`~mhmoe.data.BatchSampler`."""

    name = "lm"

    def __init__(self, data: PreparedData, cfg: TrainConfig, rank: int = 0, world_size: int = 1) -> None:
        self.data, self.cfg = data, cfg
        self.tokenizer = data.tokenizer
        self.vocab_size = data.tokenizer.vocab_size
        self.manifest = data.manifest
        self.sampler = BatchSampler(data.train, batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed,
                                    rank=rank, world_size=world_size)

    def micro_batch(self, step: int, micro: int, device: torch.device) -> tuple[Tensor, Tensor]:
        x, y = self.sampler.get_batch(step, micro)
        return _to_device(x, device), _to_device(y, device)

    def forward(self, module: nn.Module, batch: tuple[Tensor, Tensor]) -> Any:
        x, y = batch
        return module(x, y, return_logits=False)

    def evaluate(self, model: nn.Module, *, max_batches: int | None, device: torch.device | str,
                 dtype: str, on_batch: Callable[[], None] | None = None) -> dict[str, dict[str, float]]:
        return evaluate(model, self.data.val, batch_size=self.cfg.batch_size, seq_len=self.cfg.seq_len,
                        max_batches=max_batches, device=device, dtype=dtype, on_batch=on_batch)

    def eval_size(self, max_batches: int | None) -> int:
        """Evaluation batches over all validation sets."""
        return sum(count_eval_batches(len(v), batch_size=self.cfg.batch_size, seq_len=self.cfg.seq_len,
                                      max_batches=max_batches) for v in self.data.val.values())

    def summary(self) -> str:
        """``kjv: 1,234,567 train tokens (bpe, vocab 8,192); val kjv 65,536, pydocs 65,536``."""
        m, tok = self.data.manifest, self.tokenizer
        val = ", ".join(f"{k} {len(v):,}" for k, v in self.data.val.items())
        skipped = m.get("skipped_val_sets") or []
        return (f"{m.get('corpus', '?')}: {len(self.data.train):,} train tokens ({tok.name}, vocab "
                f"{tok.vocab_size:,}); val {val} tokens" + (f"; skipped {', '.join(skipped)}" if skipped else ""))


class MaskedMultimodalObjective:
    """Masked-data modelling: :class:`~mhmoe.data.multimodal.MultimodalBatch` micro-batches (image,
    text and image-text rows in ``mix`` proportions), loss on the masked positions."""

    name = "masked_mm"

    def __init__(self, data: MaskedMultimodalData, tokenizer: Tokenizer, cfg: TrainConfig, rank: int = 0) -> None:
        self.data, self.cfg, self.rank = data, cfg, rank
        self.tokenizer = tokenizer
        self.vocab_size = data.vocab.size
        self.manifest = data.describe()
        self._val: list[MultimodalBatch] = []  # built once: the examples and their masks are fixed

    def val_batches(self, max_batches: int | None) -> list[MultimodalBatch]:
        """The fixed validation examples (every val image alone and with its caption, text windows),
        interleaved round-robin over the three kinds so that a capped prefix mixes them all."""
        if not self._val:
            by_kind: dict[int, list[tuple[int, int]]] = {}
            for _, kind, key in self.data.val_examples():
                by_kind.setdefault(kind, []).append((kind, key))
            order = [ex for group in zip_longest(*by_kind.values()) for ex in group if ex is not None]
            bs = self.cfg.batch_size
            self._val = [collate([self.data.val_example(k, key) for k, key in order[i:i + bs]])
                         for i in range(0, len(order), bs)]
        return self._val if max_batches is None else self._val[:max_batches]

    def micro_batch(self, step: int, micro: int, device: torch.device) -> MultimodalBatch:
        b = self.data.get_batch(step, micro, batch_size=self.cfg.batch_size, rank=self.rank)
        return MultimodalBatch(**{f.name: _to_device(getattr(b, f.name), device) for f in fields(b)})

    def forward(self, module: nn.Module, b: MultimodalBatch) -> Any:
        return module(b.input_ids, b.modality, b.patch_pos, b.attention_mask, b.targets, b.loss_mask,
                      return_logits=False)

    def eval_size(self, max_batches: int | None) -> int:
        return len(self.val_batches(max_batches))

    def summary(self) -> str:
        d = self.manifest
        images = ", ".join(f"{k} {v:,}" for k, v in d["images"].items())
        text = ", ".join(f"{k} {v:,}" for k, v in d["text_tokens"].items())
        return (f"{d['image_set']} images ({images}; {d['grid'][0]}x{d['grid'][1]} patches, codebook "
                f"{d['codebook_size']}) + text tokens ({text}); {d['n_val_examples']:,} fixed validation examples")

    @torch.no_grad()
    def evaluate(self, model: nn.Module, *, max_batches: int | None, device: torch.device | str,
                 dtype: str, on_batch: Callable[[], None] | None = None) -> dict[str, dict[str, float]]:
        """Masked-prediction perplexity on the fixed validation examples (fixed masks): overall and per
        modality, token-weighted over every masked position (``max_batches`` caps the batches of
        :meth:`val_batches`; None = all)."""
        device = torch.device(device)
        was_training = model.training
        model.eval()
        sums = {g: [0.0, 0] for g in MASKED_SETS}
        for b in self.val_batches(max_batches):
            b = b.to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
                out = model(b.input_ids, b.modality, b.patch_pos, b.attention_mask)
            tgt = b.targets.masked_fill(~b.loss_mask, -100)
            token_loss = F.cross_entropy(out.logits.float().flatten(0, 1), tgt.reshape(-1), ignore_index=-100,
                                         reduction="none").view_as(tgt)
            for g, (total, n) in masked_perplexity_groups(b, token_loss).items():
                sums[g][0] += total
                sums[g][1] += n
            if on_batch is not None:
                on_batch()
        model.train(was_training)
        out_sets = {}
        for g, (total, n) in sums.items():
            if n:
                loss = total / n
                out_sets[MASKED_SETS[g]] = {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": n}
        return out_sets


def _text_tokenizer(run: RunConfig, progress: bool) -> Tokenizer:
    """The configured text tokenizer (a BPE is trained on, or loaded for, the text corpus's train split)."""
    d = run.data
    if d.tokenizer != "bpe":
        return get_pretrained_tokenizer(d.tokenizer)
    corpus = load_corpus(d.corpus, jsonl_field=d.jsonl_field, cache_dir=d.cache_dir)
    return load_or_train_bpe(corpus.split("train"), d.vocab_size, default_cache_dir(d.cache_dir), progress=progress)


def _prepare_masked_mm(run: RunConfig, tokenizer: Tokenizer, progress: bool) -> MaskedMultimodalData:
    d = run.data
    cfg = MultimodalConfig(image_set=d.image_set, codebook_size=d.codebook_size, text_corpus=d.corpus,
                           tokenizer=d.tokenizer, vocab_size=d.vocab_size, text_len=d.text_len,
                           val_text_tokens=d.val_tokens, seed=d.seed, cache_dir=d.cache_dir)
    data = prepare_multimodal(cfg, tokenizer=tokenizer, progress=progress)
    if run.train.seq_len != data.seq_len:
        raise ConfigError("train.seq_len", run.train.seq_len,
                          f"{data.seq_len} with data.task=masked_mm ({data.images.n_patches} patches of "
                          f"{d.image_set} + data.text_len={d.text_len} + 3 special tokens)")
    return data


def build_objective(run: RunConfig, *, tokenizer: Tokenizer | None = None, rank: int = 0, world_size: int = 1,
               progress: bool = False) -> LMObjective | MaskedMultimodalObjective:
    """The objective ``run.data.task`` names, with its data prepared. ``tokenizer`` (e.g. a checkpoint's) is
    used instead of building the configured one."""
    if run.data.task == "masked_mm":
        tok = tokenizer if tokenizer is not None else _text_tokenizer(run, progress)
        return MaskedMultimodalObjective(_prepare_masked_mm(run, tok, progress), tok, run.train, rank)
    prepared = prepare_data(run.data, seq_len=run.train.seq_len, tokenizer=tokenizer, progress=progress)
    return LMObjective(prepared, run.train, rank, world_size)


def evaluate_checkpoint(ck: Any, max_batches: int | None, device: torch.device | str,
                        dtype: str | None = None, progress: bool = False) -> dict[str, dict[str, float]]:
    """Validation results of a loaded :class:`~mhmoe.loading.checkpoint.Checkpoint` on its own
    objective's validation sets (the checkpoint's tokenizer), in ``dtype`` (default: the run's). Data caches go
    where this machine keeps them ($MHMOE_CACHE or ~/.cache/mhmoe), never where the checkpoint says.
    ``progress``: a bar over the evaluation batches (stderr)."""
    from mhmoe.train.progress import eval_progress

    run = dataclasses.replace(ck.run, data=dataclasses.replace(ck.run.data, cache_dir=""))
    objective = build_objective(run, tokenizer=ck.tokenizer, progress=progress)
    with eval_progress(objective.eval_size(max_batches), f"eval step {ck.step}", progress) as tick:
        return objective.evaluate(ck.model, max_batches=max_batches, device=device,
                                  dtype=dtype or ck.run.train.dtype, on_batch=tick)
