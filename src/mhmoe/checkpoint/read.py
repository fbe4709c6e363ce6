"""Reading a checkpoint directory: :func:`open_checkpoint` verifies it and reads its config (the one
entry point of every loader of run and checkpoint directories), :func:`read_weights` and
:func:`read_trainer_state` read its tensors. Nothing here builds a model: that is the model layer's
(:func:`mhmoe.model.pretrained.load_model`, behind ``LM.from_pretrained`` and ``mhmoe.load``).

Nothing read runs code: weights are safetensors, the config is YAML read into validated dataclasses,
``trainer_state.pt`` is read with ``torch.load(weights_only=True)`` and DCP checkpoints through the
restricted reader (:mod:`mhmoe.checkpoint.dcp_reader`).
"""

from __future__ import annotations

import contextlib
import functools
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mhmoe.checkpoint.format import verify_checkpoint
from mhmoe.checkpoint.layout import (
    CONFIG_FILE,
    DCP,
    DCP_DIR,
    SAFETENSORS,
    SAVED_CONFIG_FILE,
    TOKENIZER_DIR,
    TRAINER_STATE_FILE,
    WEIGHTS_FILE,
    CheckpointFormat,
    is_saved_dir,
)
from mhmoe.config.run import RunConfig
from mhmoe.errors import CheckpointError, ConfigError, one_line
from mhmoe.runtime.reading import open_checked_torch_archive

#: torch.load(weights_only=True) had code-execution bugs before this version (CVE-2025-32434 before 2.6,
#: CVE-2026-24747 before 2.10); trainer_state.pt and DCP items are read with it
SAFE_TORCH = (2, 10)


def torch_version(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of ``version`` (default: the installed torch)."""
    major, minor = (int(x) for x in re.findall(r"\d+", str(version or torch.__version__))[:2])
    return major, minor


@functools.cache
def warn_if_unsafe_torch(version: str) -> bool:
    """Once per process and version: a one-line warning when this torch's ``weights_only`` unpickler has
    known code-execution bugs (see :data:`SAFE_TORCH`). Returns whether the version is unsafe."""
    if torch_version(version) >= SAFE_TORCH:
        return False
    print(f"mhmoe: warning: torch {version} has known code-execution bugs in torch.load(weights_only=True) "
          "(CVE-2025-32434, CVE-2026-24747): load checkpoints you did not write only with torch >= "
          f"{SAFE_TORCH[0]}.{SAFE_TORCH[1]}", file=sys.stderr)
    return True


@dataclass(frozen=True)
class CheckpointFiles:
    """A verified checkpoint directory: its step, run config and format (``"safetensors"``: one weights
    file, the optimizer in the trainer state; ``"dcp"``: sharded ``torch.distributed.checkpoint``
    files holding model and optimizer) and where its pieces are."""

    path: Path
    step: int
    run: RunConfig
    format: CheckpointFormat
    meta: dict[str, Any]

    @property
    def weights(self) -> Path:
        return self.path / WEIGHTS_FILE

    @property
    def tokenizer_dir(self) -> Path:
        return self.path / TOKENIZER_DIR


def open_checkpoint(path: str | Path) -> CheckpointFiles:
    """Verify checkpoint directory ``path`` (meta.json: names, sizes, sha256) and read its config;
    CheckpointError (one line) otherwise."""
    path = Path(path)
    if is_saved_dir(path):
        raise CheckpointError(f"{path}: a saved model directory ({SAVED_CONFIG_FILE} + {WEIGHTS_FILE}) holds no run "
                              "config or training state; give a run or checkpoint directory")
    meta = verify_checkpoint(path)
    try:
        run = RunConfig.load(path / CONFIG_FILE)
    except (OSError, ConfigError) as exc:
        raise CheckpointError(f"{path}: {CONFIG_FILE} cannot be loaded ({one_line(exc)})") from None
    fmt = DCP if meta.get("format") == DCP else SAFETENSORS
    return CheckpointFiles(path, int(meta["step"]), run, fmt, meta)


@contextlib.contextmanager
def unloadable(path: Path) -> Iterator[None]:
    """Context of loading the content of checkpoint ``path``: any error but a CheckpointError (corrupted
    content that passed the hash check, e.g. a foreign file) becomes a one-line CheckpointError, so the
    loaders fall back to an older checkpoint (:func:`mhmoe.checkpoint.format.newest_valid`)."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 -- reported in one line
        raise CheckpointError(f"{path}: cannot be loaded ({exc.__class__.__name__}: {one_line(exc)})") from None


def read_weights(files: CheckpointFiles) -> dict[str, torch.Tensor]:
    """The model's state dict (CPU tensors): the safetensors file, or the model's full tensors gathered
    from a DCP checkpoint's shards in this process (its optimizer items are not read)."""
    if files.format == DCP:
        return read_dcp_part(files.path, "model")
    return read_safetensors(files.weights, files.path)


def read_dcp_part(path: Path, part: str) -> dict[str, Any]:
    """One top-level entry of the state of DCP checkpoint ``path`` (``"model"``: FQN -> tensor,
    ``"optim"``: the FQN-keyed optimizer state) as full tensors in this process; CheckpointError when it
    holds none."""
    from mhmoe.checkpoint.dcp_reader import read_dcp_full  # torch.distributed.checkpoint: only when needed

    value = read_dcp_full(path / DCP_DIR, part).get(part)
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: the DCP checkpoint holds no {part!r} state")
    return value


def read_safetensors(file: Path, where: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors on the CPU; CheckpointError naming ``where`` for a damaged file."""
    from safetensors.torch import load_file

    try:
        return load_file(str(file), device="cpu")
    except Exception as exc:  # noqa: BLE001 -- SafetensorError, OSError: a damaged file
        raise CheckpointError(f"{where}: {file.name} cannot be loaded ({one_line(exc)})") from None


def _bad(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"{path}: {TRAINER_STATE_FILE} {what}")


def read_trainer_state(path: Path, step: int | None = None, for_resume: bool = False,
                       with_optimizer: bool = False) -> dict[str, Any]:
    """``trainer_state.pt`` with ``weights_only=True`` (tensors and plain values; nothing else is
    unpickled); ``for_resume``: checked for what a resume of step ``step`` needs
    (:func:`check_trainer_state`; default step: the one the file records)."""
    warn_if_unsafe_torch(torch.__version__)
    try:  # nesting checked first: torch's unpickler would build a key whose hashing crashes the process
        with open_checked_torch_archive(path / TRAINER_STATE_FILE) as f:
            state = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 -- UnpicklingError for a crafted file, OSError, ...
        raise _bad(path, f"cannot be loaded ({exc.__class__.__name__}: {one_line(exc)})") from None
    if not isinstance(state, dict):
        raise _bad(path, f"is a {type(state).__name__}, not a dict")
    if not for_resume:
        return state
    return check_trainer_state(path, state, state.get("step") if step is None else step, with_optimizer)


def check_trainer_state(path: Path, state: Any, step: int | None, with_optimizer: bool) -> dict[str, Any]:
    """The trainer state of checkpoint ``step`` has what a resume needs, with the right types: counters (``step``
    equal to the checkpoint's), the LR scheduler at that step, the CPU RNG state, (single-file checkpoints) the
    optimizer state dict and (float16 runs) a well-formed loss scale. CheckpointError otherwise, so a resume falls
    back to an older checkpoint instead of failing half-way."""
    if not isinstance(state, dict):
        raise _bad(path, f"is a {type(state).__name__}, not a dict")
    need: dict[str, type | tuple[type, ...]] = {
        "step": int, "nan_total": int, "tokens_seen": int, "train_s": (int, float), "scheduler": dict,
        "rng_cpu": torch.Tensor, **({"optimizer": dict} if with_optimizer else {})}
    for key, kind in need.items():
        if not isinstance(state.get(key), kind) or isinstance(state.get(key), bool):
            raise _bad(path, f"lacks {key!r} (or it is not a {getattr(kind, '__name__', 'number')})")
    if state["step"] != step or min(state["nan_total"], state["tokens_seen"], state["train_s"]) < 0:
        raise _bad(path, f"holds step {state['step']} and counters that do not match checkpoint step {step}")
    sched = state["scheduler"]
    if sched.get("last_epoch") != step or any(not isinstance(k, str) or k.startswith("__") or k == "optimizer"
                                              for k in sched):
        raise _bad(path, f"holds a scheduler state that is not at step {step}")
    rng = state["rng_cpu"]
    if rng.dtype != torch.uint8 or rng.shape != torch.get_rng_state().shape:
        raise _bad(path, "holds a malformed CPU RNG state")
    if with_optimizer:
        opt = state["optimizer"]
        if not isinstance(opt.get("state"), dict) or not isinstance(opt.get("param_groups"), list):
            raise _bad(path, "holds no optimizer state ('state' and 'param_groups')")
    skips = state.get("scale_skips", 0)
    if not isinstance(skips, int) or isinstance(skips, bool) or skips < 0:
        raise _bad(path, "holds a malformed count of float16 overflow steps ('scale_skips')")
    if "loss_scale" in state and not _loss_scale_ok(state["loss_scale"]):
        raise _bad(path, "holds a malformed loss scale (float16 training)")
    return state


def _loss_scale_ok(ls: Any) -> bool:
    """A float16 run's loss scale (:meth:`mhmoe.train.loss_scale.LossScale.state_dict`): a positive finite fp32
    scale and a non-negative int64 count, both 0-dim tensors."""
    if not isinstance(ls, dict) or set(ls) != {"scale", "finite_run"}:
        return False
    scale, run = ls["scale"], ls["finite_run"]
    return (isinstance(scale, torch.Tensor) and isinstance(run, torch.Tensor) and scale.shape == run.shape == ()
            and scale.dtype == torch.float32 and run.dtype == torch.int64 and bool(torch.isfinite(scale))
            and float(scale) > 0 and int(run) >= 0)
