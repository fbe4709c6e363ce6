"""``mhmoe.load``: a model with its tokenizer, ready to generate from Python (:class:`Pretrained`), and
the sampling defaults of ``mhmoe generate``.

``load`` takes what ``LM.from_pretrained`` takes -- a run directory (newest valid checkpoint), a
checkpoint directory (single-file or DCP), a ``save_pretrained`` or ``mhmoe export --hf`` directory --
through the same loader (:func:`mhmoe.model.pretrained.load_model` inside
:func:`mhmoe.checkpoint.format.newest_valid`), and adds the tokenizer. It reads no optimizer or trainer
state.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from mhmoe.checkpoint.format import newest_valid
from mhmoe.checkpoint.read import unloadable
from mhmoe.config.run import RunConfig
from mhmoe.data.tokenizer import load_tokenizer
from mhmoe.data.tokenizer_base import Tokenizer
from mhmoe.errors import ConfigError
from mhmoe.model import build_model
from mhmoe.model.encoder import Encoder
from mhmoe.model.generate import generate, new_tokens
from mhmoe.model.lm import LM
from mhmoe.model.pretrained import load_model, pretrained_files
from mhmoe.runtime.device import resolve_device

# sampling defaults of `mhmoe generate` and Pretrained.generate
MAX_NEW_TOKENS, TEMPERATURE, TOP_K, TOP_P, SEED = 100, 0.8, 50, 0.95, 0


@dataclass
class Pretrained:
    """A loaded model: ``model`` (eval mode; an :class:`LM`, or an :class:`Encoder` for a masked-data run),
    ``tokenizer`` (None if the directory has none), the directory it came from and the training ``step``
    and ``run`` config (None for a saved directory)."""

    model: LM | Encoder
    tokenizer: Tokenizer | None
    path: Path
    step: int | None = None
    run: RunConfig | None = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def generate(self, prompt: str, max_new_tokens: int = MAX_NEW_TOKENS, temperature: float = TEMPERATURE,
                 top_k: int = TOP_K, top_p: float = TOP_P, seed: int = SEED) -> str:
        """Continue ``prompt`` (KV cache; temperature 0 = greedy; stops at end-of-text or where the model's
        context ends) and return prompt + continuation as text. The same seed gives the same text as
        ``mhmoe generate --seed``."""
        if self.tokenizer is None:
            raise ConfigError("tokenizer", str(self.path), "a directory with a tokenizer (save_pretrained(dir, "
                              "tokenizer=...)); without one, call mhmoe.generate on token ids")
        if not isinstance(self.model, LM):
            raise ConfigError("model.arch", self.model.cfg.arch, "decoder (an encoder does not generate text)")
        check_sampling(max_new_tokens, temperature, top_k, top_p)
        ids = self.tokenizer.encode(prompt)
        if not ids:
            raise ConfigError("prompt", prompt, "a non-empty text")
        n = new_tokens(self.model.cfg.max_seq_len, len(ids), max_new_tokens, clamp=True)
        g = torch.Generator(device=self.device).manual_seed(seed)
        out = generate(self.model, torch.tensor([ids], device=self.device), n, temperature, top_k, top_p,
                       eos_id=self.tokenizer.eos_id, generator=g)
        return self.tokenizer.decode(out[0].tolist())

    def save_pretrained(self, directory: str | os.PathLike[str], overwrite: bool = False) -> Path:
        """The model and its tokenizer as a saved directory (:meth:`mhmoe.model.LM.save_pretrained`)."""
        if not isinstance(self.model, LM):
            raise ConfigError("model.arch", self.model.cfg.arch, "decoder (save_pretrained writes a language model)")
        return self.model.save_pretrained(directory, tokenizer=self.tokenizer, overwrite=overwrite)


def check_sampling(max_new_tokens: int, temperature: float, top_k: int, top_p: float) -> None:
    """ConfigError unless max_new_tokens >= 1, temperature >= 0, top_k >= 0 and 0 < top_p <= 1."""
    for name, value, ok, allowed in (("max_new_tokens", max_new_tokens, max_new_tokens >= 1, ">= 1"),
                                     ("temperature", temperature, temperature >= 0, ">= 0 (0 = greedy)"),
                                     ("top_k", top_k, top_k >= 0, ">= 0 (0 = off)"),
                                     ("top_p", top_p, 0 < top_p <= 1, "0 < top_p <= 1 (1 = off)")):
        if not ok:
            raise ConfigError(name, value, allowed)


def load(path: str | os.PathLike[str], device: str | torch.device = "auto", warn: bool = True) -> Pretrained:
    """The model (eval mode) and tokenizer stored at ``path``: a run directory (its newest valid
    checkpoint; ``warn``: a damaged one is reported on stderr), a checkpoint directory (single-file or
    DCP), a save_pretrained directory or an export --hf directory. ``device``: auto | cpu | cuda | a
    torch.device. Errors are one-line CheckpointError / ConfigError."""
    dev = device if isinstance(device, torch.device) else resolve_device(str(device), "device")

    def one(d: Path) -> Pretrained:
        files = pretrained_files(d)
        model = load_model(files, build_model)
        with unloadable(d):
            tokenizer = load_tokenizer(files.tokenizer) if files.tokenizer is not None else None
        return Pretrained(model.to(dev).eval(), tokenizer, d, files.step, files.run)

    return newest_valid(path, one, warn=warn)
