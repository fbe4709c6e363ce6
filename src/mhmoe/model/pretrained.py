"""``LM.from_pretrained`` / ``LM.save_pretrained``: the model's weights and config, without training state.

A *saved directory* (what :meth:`PretrainedMixin.save_pretrained` writes) is the layout of a transformers
model directory, so the same directory also loads with ``AutoModelForCausalLM.from_pretrained`` once
``mhmoe.integrations.hf`` is imported::

    config.json           {"model_type": "mhmoe", "mhmoe": {ModelConfig fields}, "vocab_size": ..., ...}
    model.safetensors     weights, keys "model.<LM parameter name>", tied embeddings stored once
    tokenizer/            the tokenizer (mhmoe.data.Tokenizer.save), when one was given

:meth:`PretrainedMixin.from_pretrained` reads such a model directory or a ``mhmoe export --hf``
directory itself; a checkpoint directory (``RUN/checkpoints/step_N``) or a run directory (its newest
valid checkpoint) it reads through the one loader of run directories,
:func:`mhmoe.checkpoint.open_checkpoint` with :func:`mhmoe.checkpoint.newest_valid` (hashes verified,
as in training). Loading never executes code (safetensors and JSON/YAML only) and never reads outside
the directory (fixed file names; symlinks that lead out are refused). Sharded (DCP) checkpoints hold an
optimizer and a trainer state too: :func:`mhmoe.load` reads those.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors.torch import save_file

from mhmoe.checkpoint.format import check_links, is_checkpoint_dir, newest_valid
from mhmoe.checkpoint.read import open_checkpoint, read_safetensors
from mhmoe.config.model import ModelConfig
from mhmoe.errors import CheckpointError, ConfigError, one_line
from mhmoe.runtime.bounded import load_json
from mhmoe.runtime.files import atomic_write, publish_dir, staging_dir

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_DIRS = ("tokenizer", "mhmoe_tokenizer")  # ours; the name `mhmoe export --hf` uses
KEY_PREFIX = "model."  # transformers layout: MHMoEForCausalLM.model is the LM
M = TypeVar("M", bound="PretrainedMixin")


@dataclass(frozen=True)
class PretrainedFiles:
    """Where a loadable model's pieces are: its config, weights file, tokenizer directory (or None), the
    training step (None for a saved directory) and the directory they were found in."""

    config: ModelConfig
    weights: Path
    tokenizer: Path | None
    step: int | None
    path: Path


def _tokenizer_dir(d: Path) -> Path | None:
    return next((d / n for n in TOKENIZER_DIRS if (d / n).is_dir()), None)


def saved_dir_files(d: Path) -> PretrainedFiles:
    """A saved (or ``export --hf``) directory: ``config.json`` with an ``mhmoe`` model config + weights."""
    check_links(d)
    try:
        meta = load_json((d / CONFIG_FILE).read_text(encoding="utf-8"), str(d / CONFIG_FILE))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{d}: unreadable {CONFIG_FILE} ({one_line(exc)})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("mhmoe"), dict):
        raise CheckpointError(f"{d}: {CONFIG_FILE} is not an mhmoe model config (no \"mhmoe\" section)")
    try:
        cfg = ModelConfig.from_dict(dict(meta["mhmoe"]))
    except ConfigError as exc:
        raise CheckpointError(f"{d}: {CONFIG_FILE}: {exc}") from None
    if not (d / WEIGHTS_FILE).is_file():
        raise CheckpointError(f"{d}: missing {WEIGHTS_FILE}")
    return PretrainedFiles(cfg, d / WEIGHTS_FILE, _tokenizer_dir(d), None, d)


def checkpoint_dir_files(d: Path) -> PretrainedFiles:
    """A training checkpoint directory, opened by :func:`mhmoe.checkpoint.open_checkpoint` (meta.json
    verified: sizes, hashes, names inside the directory; config read)."""
    files = open_checkpoint(d)
    if files.format == "dcp":
        raise CheckpointError(f"{d}: a sharded (DCP) checkpoint; load it with mhmoe.load(path), or convert it "
                              "with `mhmoe convert-checkpoint PATH OUT --to safetensors`")
    return PretrainedFiles(files.run.model, files.weights, _tokenizer_dir(d), files.step, d)


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
    """Load ``files.weights`` into ``model`` (keys with or without the transformers ``model.`` prefix);
    CheckpointError unless every parameter is present with its shape (:func:`load_state`)."""
    state = read_safetensors(files.weights, files.path)
    if state and all(k.startswith(KEY_PREFIX) for k in state):
        state = {k[len(KEY_PREFIX):]: v for k, v in state.items()}
    load_state(model, state, files.path)


def find_pretrained(path: str | os.PathLike[str], warn: bool = True) -> PretrainedFiles:
    """The model files of a saved directory, a checkpoint directory or a run directory (newest valid
    checkpoint; a damaged one is reported on stderr and the previous one is used)."""
    p = Path(path)
    if (p / CONFIG_FILE).is_file() and not is_checkpoint_dir(p):
        return saved_dir_files(p)
    return newest_valid(p, checkpoint_dir_files, warn=warn)


def _weights_for_saving(model: torch.nn.Module, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    tied = cfg.tie_embeddings
    return {KEY_PREFIX + k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()
            if not (tied and k == "lm_head.weight")}


def config_json(cfg: ModelConfig, eos_id: int | None) -> dict[str, Any]:
    """``config.json``: our ModelConfig under ``mhmoe`` plus the transformers names other tools read."""
    return {"architectures": ["MHMoEForCausalLM"], "model_type": "mhmoe", "mhmoe": cfg.to_dict(),
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "max_position_embeddings": cfg.max_seq_len,
            "tie_word_embeddings": cfg.tie_embeddings, "bos_token_id": eos_id, "eos_token_id": eos_id,
            "pad_token_id": eos_id}


class PretrainedMixin:
    """``from_pretrained`` / ``save_pretrained`` for :class:`mhmoe.model.LM` (which sets ``cfg``)."""

    cfg: ModelConfig

    @classmethod
    def from_pretrained(cls: type[M], path: str | os.PathLike[str], device: str | torch.device = "cpu",
                        warn: bool = True) -> M:
        """The model stored at ``path`` (saved directory, ``export --hf`` directory, checkpoint directory or
        run directory), in eval mode on ``device``. CheckpointError (one line) for anything unloadable."""
        files = find_pretrained(path, warn=warn)
        model = cls(files.config)
        load_weights(model, files)
        return model.to(device).eval()

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
            save_file(_weights_for_saving(self, self.cfg), str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
            eos = getattr(tokenizer, "eos_id", None)
            atomic_write(tmp / CONFIG_FILE, json.dumps(config_json(self.cfg, eos), indent=2), durable=False)
            if tokenizer is not None:
                tokenizer.save(tmp / TOKENIZER_DIRS[0])
            publish_dir(tmp, out, replace=True)
        return out
