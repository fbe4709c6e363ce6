"""``LM.from_pretrained`` / ``LM.save_pretrained``: the model's weights and config, without training state.

A *saved directory* (what :meth:`PretrainedMixin.save_pretrained` writes) is the layout of a transformers
model directory, so the same directory also loads with ``AutoModelForCausalLM.from_pretrained`` once
``mhmoe.integrations.hf`` is imported (names: :mod:`mhmoe.checkpoint.layout`)::

    config.json           {"model_type": "mhmoe", "mhmoe": {ModelConfig fields}, "vocab_size": ..., ...}
    model.safetensors     weights, keys "model.<LM parameter name>", tied embeddings stored once
    tokenizer/            the tokenizer (mhmoe.data.Tokenizer.save), when one was given

:func:`load_model` reads one such directory, a ``mhmoe export --hf`` directory or a checkpoint directory
(``RUN/checkpoints/step_N``, single-file or sharded DCP, opened by :func:`mhmoe.checkpoint.read.open_checkpoint`:
hashes verified, as in training); :meth:`PretrainedMixin.from_pretrained` also takes a run directory (its
newest valid checkpoint, through :func:`mhmoe.checkpoint.format.newest_valid`, the one fallback loop of
every loader). Loading never executes code (safetensors, JSON/YAML and the restricted DCP reader) and
never reads outside the directory (fixed file names; symlinks that lead out are refused).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
from safetensors.torch import save_file

from mhmoe.checkpoint.format import check_links, newest_valid
from mhmoe.checkpoint.layout import (
    SAVED_CONFIG_FILE,
    TOKENIZER_DIR,
    TOKENIZER_DIRS,
    WEIGHTS_FILE,
    is_saved_dir,
)
from mhmoe.checkpoint.read import CheckpointFiles, open_checkpoint, read_safetensors, read_weights, unloadable
from mhmoe.config.model import ModelConfig
from mhmoe.config.run import RunConfig
from mhmoe.errors import CheckpointError, ConfigError, one_line
from mhmoe.runtime.bounded import MAX_JSON_CHARS, load_json
from mhmoe.runtime.files import atomic_write, publish_dir, staging_dir
from mhmoe.runtime.reading import read_text

KEY_PREFIX = "model."  # transformers layout: MHMoEForCausalLM.model is the LM
M = TypeVar("M", bound="PretrainedMixin")
N = TypeVar("N", bound=torch.nn.Module)


@dataclass(frozen=True)
class PretrainedFiles:
    """Where a loadable model's pieces are: its config, the directory, its tokenizer directory (or None)
    and, for a training checkpoint, the opened checkpoint (step, run config, format)."""

    config: ModelConfig
    path: Path
    tokenizer: Path | None
    checkpoint: CheckpointFiles | None = None

    @property
    def step(self) -> int | None:
        """The training step (None for a saved directory)."""
        return self.checkpoint.step if self.checkpoint is not None else None

    @property
    def run(self) -> RunConfig | None:
        """The run config (None for a saved directory)."""
        return self.checkpoint.run if self.checkpoint is not None else None


def _tokenizer_dir(d: Path) -> Path | None:
    return next((d / n for n in TOKENIZER_DIRS if (d / n).is_dir()), None)


def saved_dir_files(d: Path) -> PretrainedFiles:
    """A saved (or ``export --hf``) directory: ``config.json`` with an ``mhmoe`` model config + weights."""
    check_links(d)
    try:
        meta = load_json(read_text(d / SAVED_CONFIG_FILE, MAX_JSON_CHARS), str(d / SAVED_CONFIG_FILE))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{d}: unreadable {SAVED_CONFIG_FILE} ({one_line(exc)})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("mhmoe"), dict):
        raise CheckpointError(f"{d}: {SAVED_CONFIG_FILE} is not an mhmoe model config (no \"mhmoe\" section)")
    try:
        cfg = ModelConfig.from_dict(dict(meta["mhmoe"]))
    except ConfigError as exc:
        raise CheckpointError(f"{d}: {SAVED_CONFIG_FILE}: {exc}") from None
    if not (d / WEIGHTS_FILE).is_file():
        raise CheckpointError(f"{d}: missing {WEIGHTS_FILE}")
    return PretrainedFiles(cfg, d, _tokenizer_dir(d))


def checkpoint_model_files(files: CheckpointFiles) -> PretrainedFiles:
    """The model pieces of an opened checkpoint directory (single-file or DCP)."""
    return PretrainedFiles(files.run.model, files.path, _tokenizer_dir(files.path), files)


def pretrained_files(d: Path) -> PretrainedFiles:
    """One saved, export --hf or checkpoint directory (single-file or DCP; opened by
    :func:`mhmoe.checkpoint.read.open_checkpoint`: meta.json verified, config read)."""
    return saved_dir_files(d) if is_saved_dir(d) else checkpoint_model_files(open_checkpoint(d))


def load_state(model: torch.nn.Module, state: dict[str, torch.Tensor], where: Path | str) -> None:
    """Load ``state`` into ``model``; CheckpointError (one line) unless every parameter and persistent
    buffer is present with its shape and nothing else is. Of tied parameters (one tensor, several
    names: the LM head and the embedding) one name suffices, as safetensors stores them once."""
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # shape mismatch
        raise CheckpointError(f"{where}: weights do not match the config ({one_line(exc)})") from None
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    loaded = set(state)
    tied_ok = {n for group in names.values() if loaded.intersection(group) for n in group}
    missing = [m for m in missing if m not in tied_ok]
    if missing or unexpected:
        raise CheckpointError(f"{where}: weights do not match the config (missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]})")


def load_weights(model: torch.nn.Module, files: PretrainedFiles) -> None:
    """Load the weights of ``files`` into ``model`` (a saved directory's keys with or without the
    transformers ``model.`` prefix; a checkpoint's single file or DCP shards); CheckpointError unless
    every parameter is present with its shape (:func:`load_state`)."""
    if files.checkpoint is not None:
        state = read_weights(files.checkpoint)
    else:
        state = read_safetensors(files.path / WEIGHTS_FILE, files.path)
        if state and all(k.startswith(KEY_PREFIX) for k in state):
            state = {k[len(KEY_PREFIX):]: v for k, v in state.items()}
    load_state(model, state, files.path)


def load_model(files: PretrainedFiles, build: Callable[[ModelConfig], N]) -> N:
    """``build(files.config)`` with the weights of ``files`` loaded (on the CPU, train mode);
    CheckpointError (one line) for anything unloadable."""
    model = build(files.config)
    with unloadable(files.path):
        load_weights(model, files)
    return model


def find_pretrained(path: str | os.PathLike[str], warn: bool = True) -> PretrainedFiles:
    """Where the model pieces of a saved directory, a checkpoint directory or a run directory (newest valid
    checkpoint; a damaged one is reported on stderr and the previous one is used) are."""
    return newest_valid(path, pretrained_files, warn=warn)


def _weights_for_saving(model: torch.nn.Module, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    tied = cfg.tie_embeddings
    return {KEY_PREFIX + k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()
            if not (tied and k == "lm_head.weight")}


def config_json(cfg: ModelConfig, eos_id: int | None) -> dict[str, Any]:
    """``config.json``: our ModelConfig under ``mhmoe`` plus the transformers names other tools read."""
    return {"architectures": ["MHMoEForCausalLM"], "model_type": "mhmoe", "mhmoe": cfg.to_dict(),
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads,
            "max_position_embeddings": cfg.max_seq_len,
            "tie_word_embeddings": cfg.tie_embeddings, "bos_token_id": eos_id, "eos_token_id": eos_id,
            "pad_token_id": eos_id}


class PretrainedMixin:
    """``from_pretrained`` / ``save_pretrained`` for :class:`mhmoe.model.LM` (which sets ``cfg``)."""

    cfg: ModelConfig

    @classmethod
    def from_pretrained(cls: type[M], path: str | os.PathLike[str], device: str | torch.device = "cpu",
                        warn: bool = True) -> M:
        """The model stored at ``path`` (saved directory, ``export --hf`` directory, checkpoint directory of
        either format, or run directory: its newest valid checkpoint), in eval mode on ``device``.
        CheckpointError (one line) for anything unloadable."""
        build = cast(Callable[[ModelConfig], torch.nn.Module], cls)  # the mixin's class is an nn.Module (LM)
        model = newest_valid(path, lambda d: load_model(pretrained_files(d), build), warn=warn)
        return cast(M, model.to(device).eval())

    def save_pretrained(self, directory: str | os.PathLike[str], tokenizer: Any = None,
                        overwrite: bool = False) -> Path:
        """Write ``config.json`` + ``model.safetensors`` (+ ``tokenizer/`` when ``tokenizer`` is given: a
        :class:`mhmoe.data.Tokenizer`) into ``directory``; returns it.

        Everything is written into a hidden sibling first and renamed into place, so ``directory`` is never
        half-written. An existing non-empty ``directory`` is refused unless ``overwrite=True``."""
        out = Path(directory)
        if (out.exists() and not out.is_symlink() and (not out.is_dir() or (any(out.iterdir()) and not overwrite))):
            raise CheckpointError(f"{out}: already exists and is not an empty directory (refusing to overwrite; "
                                  "pass overwrite=True to replace it)")
        with staging_dir(out) as tmp:
            save_file(_weights_for_saving(cast(torch.nn.Module, self), self.cfg), str(tmp / WEIGHTS_FILE),
                      metadata={"format": "pt"})
            eos = getattr(tokenizer, "eos_id", None)
            atomic_write(tmp / SAVED_CONFIG_FILE, json.dumps(config_json(self.cfg, eos), indent=2), durable=False)
            if tokenizer is not None:
                tokenizer.save(tmp / TOKENIZER_DIR)
            publish_dir(tmp, out, replace=True)
        return out
