"""Every file and directory name inside a run, checkpoint and saved-model directory: the one place they
are spelled (``tests/checkpoint/test_layout.py`` finds any other). Pure Python.

A **run directory** (``mhmoe train --out RUN``)::

    RUN/config.yaml   metrics.jsonl   eval.jsonl   results.json   curves.png   tb/   analysis/   .lock
    RUN/checkpoints/step_00000600/    one checkpoint (below), newest valid one loaded
    RUN/.dcp-resume/                  a single-file checkpoint converted for a torchrun resume (temporary)

A **checkpoint directory** (``RUN/checkpoints/step_N``)::

    model.safetensors   (single-file format) or   dcp/ (.metadata + __<rank>_0.distcp, sharded format)
    config.yaml   trainer_state.pt   tokenizer/   meta.json (written last: step, format, sha256 of every file)

A **saved directory** (``save_pretrained``; ``mhmoe export --hf`` writes the same names, its tokenizer as
``mhmoe_tokenizer/`` beside transformers' own files)::

    config.json   model.safetensors   tokenizer/
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

# ---- a run directory -----------------------------------------------------------------------------------
CONFIG_FILE = "config.yaml"  # the full RunConfig (also in every checkpoint)
METRICS_FILE = "metrics.jsonl"  # one JSON object per logged step
EVAL_FILE = "eval.jsonl"  # one JSON object per evaluation
RESULTS_FILE = "results.json"  # the final summary, written when the run ends
CURVES_FILE = "curves.png"  # training loss and validation perplexity
TB_DIR = "tb"  # TensorBoard events (when tensorboard is installed)
ANALYSIS_DIR = "analysis"  # `mhmoe analyze --checkpoint RUN` writes here by default
LOCK_FILE = ".lock"  # held while a command writes into the run directory
CKPT_DIR = "checkpoints"
CONVERT_DIR = ".dcp-resume"  # RUN/.dcp-resume/: a single-file checkpoint converted for a torchrun resume
RUN_LOGS = (METRICS_FILE, EVAL_FILE, RESULTS_FILE)  # what an earlier run leaves even without a checkpoint

# ---- a checkpoint directory ------------------------------------------------------------------------------
PREFIX = "step_"  # RUN/checkpoints/step_00000600
META_FILE = "meta.json"
WEIGHTS_FILE = "model.safetensors"  # also the weights of a saved directory
TRAINER_STATE_FILE = "trainer_state.pt"
TOKENIZER_DIR = "tokenizer"  # also the tokenizer of a saved directory
DCP_DIR = "dcp"  # a sharded checkpoint's torch.distributed.checkpoint files
FORMAT_VERSION = 1
#: ``meta.json`` "format": one weights file (optimizer in the trainer state), or sharded DCP files
CheckpointFormat = Literal["safetensors", "dcp"]
SAFETENSORS: CheckpointFormat = "safetensors"
DCP: CheckpointFormat = "dcp"
FORMATS: tuple[CheckpointFormat, ...] = (SAFETENSORS, DCP)

# ---- a saved (save_pretrained / export --hf) directory ---------------------------------------------------
SAVED_CONFIG_FILE = "config.json"  # {"model_type": "mhmoe", "mhmoe": {ModelConfig fields}, ...}
HF_TOKENIZER_DIR = "mhmoe_tokenizer"  # our tokenizer in an export --hf directory (transformers' own is beside it)
TOKENIZER_DIRS = (TOKENIZER_DIR, HF_TOKENIZER_DIR)


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    """``RUN/checkpoints/step_0000000N``."""
    return Path(run_dir) / CKPT_DIR / f"{PREFIX}{step:08d}"


def step_of(name: str) -> int | None:
    """The step of a checkpoint directory name (``step_00000600`` -> 600), or None for any other name."""
    digits = name[len(PREFIX):]
    return int(digits) if name.startswith(PREFIX) and digits.isdigit() else None


def run_directory(path: str | Path) -> Path:
    """The run directory of a checkpoint directory (``RUN/checkpoints/step_N`` -> ``RUN``), else ``path``."""
    p = Path(path)
    return p.parent.parent if p.parent.name == CKPT_DIR and p.name.startswith(PREFIX) else p


def is_checkpoint_dir(path: Path) -> bool:
    """A single checkpoint directory (``meta.json`` inside, or named ``step_N``), not a run directory."""
    return (path / META_FILE).is_file() or path.name.startswith(PREFIX)


def is_saved_dir(path: Path) -> bool:
    """A saved-model directory (``config.json`` inside; ``save_pretrained`` or ``export --hf``), not a run or
    checkpoint directory."""
    return (path / SAVED_CONFIG_FILE).is_file() and not is_checkpoint_dir(path)
