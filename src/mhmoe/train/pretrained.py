"""``mhmoe.load(path)``: a trained model with its tokenizer, ready to generate from Python.

``path`` is anything the library writes: a run directory (its newest valid checkpoint), a checkpoint
directory (single-file or sharded DCP), a :meth:`~mhmoe.model.LM.save_pretrained` directory or a
``mhmoe export --hf`` directory. The model-only loader is :meth:`mhmoe.model.LM.from_pretrained`
(the model layer, which cannot know tokenizers or the training state); this one sits in the training
layer because run directories carry both. Loading never executes code from the files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from mhmoe.config.run import RunConfig
from mhmoe.data.tokenizer import load_tokenizer
from mhmoe.data.tokenizer_base import Tokenizer
from mhmoe.errors import ConfigError
from mhmoe.model.generate import generate
from mhmoe.model.lm import LM
from mhmoe.model.pretrained import CONFIG_FILE, saved_dir_files
from mhmoe.runtime.checkpoint_files import is_checkpoint_dir
from mhmoe.runtime.device import resolve_device
from mhmoe.train.checkpoint import load_latest

# sampling defaults of `mhmoe generate` and Pretrained.generate
MAX_NEW_TOKENS, TEMPERATURE, TOP_K, TOP_P, SEED = 100, 0.8, 50, 0.95, 0


@dataclass
class Pretrained:
    """A loaded model: ``model`` (eval mode), ``tokenizer`` (None if the directory has none), the training
    ``step`` and ``run`` config (None for a saved directory) and the directory it came from."""

    model: LM
    tokenizer: Tokenizer | None
    path: Path
    step: int | None = None
    run: RunConfig | None = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def generate(self, prompt: str, max_new_tokens: int = MAX_NEW_TOKENS, temperature: float = TEMPERATURE,
                 top_k: int = TOP_K, top_p: float = TOP_P, seed: int = SEED) -> str:
        """Continue ``prompt`` (KV cache; temperature 0 = greedy; stops at end-of-text) and return prompt +
        continuation as text. The same seed gives the same text as ``mhmoe generate --seed``."""
        if self.tokenizer is None:
            raise ConfigError("tokenizer", str(self.path), "a directory with a tokenizer (save_pretrained(dir, "
                              "tokenizer=...)); without one, call mhmoe.generate on token ids")
        check_sampling(max_new_tokens, temperature, top_k, top_p)
        ids = self.tokenizer.encode(prompt)
        if not ids:
            raise ConfigError("prompt", prompt, "a non-empty text")
        if len(ids) >= self.model.cfg.max_seq_len:
            raise ConfigError("prompt", f"{len(ids)} tokens", f"fewer than max_seq_len={self.model.cfg.max_seq_len}")
        n = min(max_new_tokens, self.model.cfg.max_seq_len - len(ids))
        g = torch.Generator(device=self.device).manual_seed(seed)
        out = generate(self.model, torch.tensor([ids], device=self.device), n, temperature, top_k, top_p,
                       eos_id=self.tokenizer.eos_id, generator=g)
        return self.tokenizer.decode(out[0].tolist())

    def save_pretrained(self, directory: str | os.PathLike[str], overwrite: bool = False) -> Path:
        """The model and its tokenizer as a saved directory (:meth:`mhmoe.model.LM.save_pretrained`)."""
        return self.model.save_pretrained(directory, tokenizer=self.tokenizer, overwrite=overwrite)


def check_sampling(max_new_tokens: int, temperature: float, top_k: int, top_p: float) -> None:
    """ConfigError unless max_new_tokens >= 1, temperature >= 0, top_k >= 0 and 0 < top_p <= 1."""
    for name, value, ok, allowed in (("max_new_tokens", max_new_tokens, max_new_tokens >= 1, ">= 1"),
                                     ("temperature", temperature, temperature >= 0, ">= 0 (0 = greedy)"),
                                     ("top_k", top_k, top_k >= 0, ">= 0 (0 = off)"),
                                     ("top_p", top_p, 0 < top_p <= 1, "0 < top_p <= 1 (1 = off)")):
        if not ok:
            raise ConfigError(name, value, allowed)


def load(path: str | os.PathLike[str], device: str | torch.device = "auto") -> Pretrained:
    """The model (eval mode) and tokenizer stored at ``path``: a run directory, a checkpoint directory
    (single-file or DCP), a save_pretrained directory or an export --hf directory. ``device``: auto | cpu
    | cuda | a torch.device. Errors are one-line CheckpointError / ConfigError."""
    p = Path(path)
    dev = device if isinstance(device, torch.device) else resolve_device(str(device), "device")
    if (p / CONFIG_FILE).is_file() and not is_checkpoint_dir(p):
        files = saved_dir_files(p)
        model = LM.from_pretrained(p, device=dev)
        tokenizer = load_tokenizer(files.tokenizer) if files.tokenizer is not None else None
        return Pretrained(model, tokenizer, p)
    ck = load_latest(p, dev)
    return Pretrained(ck.model.eval(), ck.tokenizer, ck.path, ck.step, ck.run)
