"""The on-disk checkpoint format shared by single-file and sharded (DCP) checkpoints: directory layout,
``meta.json`` (format version, step, sha256 and size of every file, written last), atomic publication
by rename, verification, and the :class:`Checkpoint` a loader returns. See :mod:`mhmoe.train.checkpoint`.

The torch-free part (names, verification, listing) is :mod:`mhmoe.runtime.checkpoint_files`, so that
:meth:`mhmoe.model.LM.from_pretrained` can read checkpoints from below this layer; it is re-exported here."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mhmoe.config.run import RunConfig
from mhmoe.data.tokenizer_base import Tokenizer
from mhmoe.model.lm import LM
from mhmoe.runtime.checkpoint_files import (  # noqa: F401 -- re-exported: the file format lives in runtime/
    CKPT_DIR,
    FORMAT_VERSION,
    PREFIX,
    check_links,
    first_line,
    inside,
    list_checkpoints,
    verify_checkpoint,
)
from mhmoe.runtime.checkpoint_files import checkpoint_files as _files
from mhmoe.runtime.checkpoint_files import sha256_file as _sha256


def model_is_finite(model: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def publish_checkpoint(tmp: Path, final: Path, run_dir: str | Path, meta: dict[str, Any], keep_last: int) -> None:
    """Write ``meta.json`` (``meta`` + every file's sha256 and size) into the finished ``tmp`` directory,
    rename it to ``final`` atomically, and prune all but the newest ``keep_last`` checkpoints."""
    meta = {**meta, "files": {str(p.relative_to(tmp)): {"sha256": _sha256(p), "bytes": p.stat().st_size}
                              for p in _files(tmp)}}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


@dataclass
class Checkpoint:
    path: Path
    step: int
    run: RunConfig
    model: LM
    tokenizer: Tokenizer
    trainer_state: dict[str, Any]
