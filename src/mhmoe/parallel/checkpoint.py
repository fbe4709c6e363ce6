"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): save from any world size, load at
any other (DCP reshards by global tensor offsets), convert to / from the single-file safetensors format.

Layout of a DCP checkpoint (same directory scheme as :mod:`mhmoe.train.checkpoint`)::

    RUN/checkpoints/step_00000600/
        dcp/               DCP files (.metadata + one __<rank>_0.distcp per writing rank) holding
                           {"model": FQN -> tensor, "optim": FQN-keyed AdamW state}
        config.yaml  tokenizer/  trainer_state.pt (step, scheduler, RNG, counters; no optimizer)
        meta.json          {"format": "dcp", "world_size", "ep", "files": sha256 of every file}, last

Expert parameters under expert parallelism are saved as DTensors on the ``("dp", "ep")`` mesh with
placements ``[Replicate(), Shard(0)]`` (DDP) or on the ``("ep", "dp")`` mesh with ``[Shard(0), Shard(0)]``
(FSDP2 shards each rank's experts over dp), global shape [E, ...]; other FSDP2 parameters are DTensors
already; DDP parameters are plain replicated tensors (DCP writes one copy). All ranks write into a
hidden temporary directory that rank 0 renames into place after the metadata is complete, so a
crash never leaves a half-written checkpoint under a real name (a shared filesystem is assumed
across nodes). :func:`mhmoe.train.checkpoint.load_checkpoint` reads DCP checkpoints in one process
(:mod:`mhmoe.train.dcp_reader`), so ``eval``, ``generate`` and a single-process ``train --resume`` accept them.

Checkpoints are read only through :mod:`mhmoe.train.dcp_safe` (a restricted unpickler for ``.metadata``,
``weights_only=True`` for every item): loading a checkpoint never executes code from it.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, Replicate, Shard

from mhmoe.config.run import RunConfig
from mhmoe.data.tokenizer import load_tokenizer
from mhmoe.errors import CheckpointError
from mhmoe.train.checkpoint import load_checkpoint, save_checkpoint
from mhmoe.train.checkpoint_format import (
    CKPT_DIR,
    FORMAT_VERSION,
    PREFIX,
    Checkpoint,
    first_line,
    list_checkpoints,
    model_is_finite,
    publish_checkpoint,
    verify_checkpoint,
    warn_if_unsafe_torch,
)
from mhmoe.train.dcp_reader import DCP_DIR, load_trainer_state
from mhmoe.train.dcp_safe import SafeFileSystemReader
from mhmoe.train.optim import build_optimizer

CONVERT_DIR = ".dcp-resume"  # RUN/.dcp-resume/: a single-file checkpoint converted for a torchrun resume


def _state(model: nn.Module, optimizer: torch.optim.Optimizer, par: Any | None) -> dict[str, Any]:
    """{"model", "optim"} FQN-keyed state dicts; EP-local expert tensors wrapped as [Replicate, Shard(0)]
    DTensors on the mesh (shared storage: loading into them writes the live tensors)."""
    msd, osd = get_state_dict(model, optimizer)
    names = set(par.expert_names) if par is not None else set()
    if names:
        mesh = par.env.mesh

        def wrap(t: Tensor) -> Tensor:
            if isinstance(t, DTensor):  # FSDP2 + EP: a dp shard of this rank's experts -> ep outer, dp inner
                return DTensor.from_local(t.to_local(), par.ep_dp_mesh, [Shard(0), Shard(0)], run_check=False)
            return DTensor.from_local(t, mesh, [Replicate(), Shard(0)], run_check=False)

        for n in names:  # new dicts: the per-parameter ones may be the optimizer's own state
            msd[n] = wrap(msd[n])
            if n in osd["state"]:
                osd["state"][n] = {k: wrap(v) if isinstance(v, Tensor) and v.dim() > 0 else v
                                   for k, v in osd["state"][n].items()}
    return {"model": msd, "optim": osd}


def _unwrap(sd: dict[str, Any], par: Any | None) -> None:
    """Undo the expert wrapping of :func:`_state`: local tensors (DDP), dp-mesh DTensors (FSDP2)."""
    if par is None or not par.expert_names:
        return

    def unwrap(t: Tensor) -> Tensor:
        if par.ep_dp_mesh is None:
            return t.to_local()
        return DTensor.from_local(t.to_local(), par.env.mesh["dp"], [Shard(0)], run_check=False)

    for n in par.expert_names:
        sd["model"][n] = unwrap(sd["model"][n])
        if n in sd["optim"]["state"]:
            sd["optim"]["state"][n] = {k: unwrap(v) if isinstance(v, DTensor) else v
                                       for k, v in sd["optim"]["state"][n].items()}


def _agree(ok: bool, distributed: bool) -> bool:
    """True on every rank iff ``ok`` on every rank."""
    if not distributed:
        return ok
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([1 if ok else 0], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def save_dcp_checkpoint(run_dir: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                        run: RunConfig, tokenizer: Any, trainer_state: dict[str, Any], keep_last: int = 2,
                        par: Any | None = None, no_dist: bool = False) -> Path:
    """Write DCP checkpoint ``step`` (a collective: every rank calls it) and prune to ``keep_last``.

    ``model``: the LM (FSDP2-sharded or with EP layers); ``par``: its ParallelModel (None in a single
    process). ``trainer_state``: step, scheduler, RNG and counters (rank 0's is written).
    ``no_dist``: this process alone writes a full (unsharded) model, even inside a process group.
    """
    distributed = not no_dist and dist.is_available() and dist.is_initialized()
    rank0 = not distributed or dist.get_rank() == 0
    if not _agree(model_is_finite(model), distributed):
        raise CheckpointError(f"refusing to save step {step}: the model has non-finite parameters")
    root = Path(run_dir) / CKPT_DIR
    final = root / f"{PREFIX}{step:08d}"
    tmp = root / f".tmp-{final.name}-dcp"
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    if distributed:
        dist.barrier()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")  # single process: intended
        dcp.save(_state(model, optimizer, par), checkpoint_id=str(tmp / DCP_DIR), no_dist=not distributed)
    if distributed:
        dist.barrier()
    error = None
    if rank0:
        try:
            (tmp / "config.yaml").write_text(run.to_yaml(), encoding="utf-8")
            torch.save({k: v for k, v in trainer_state.items() if k != "optimizer"}, tmp / "trainer_state.pt")
            tokenizer.save(tmp / "tokenizer")
            publish_checkpoint(tmp, final, run_dir, {
                "format_version": FORMAT_VERSION, "format": "dcp", "step": step,
                "world_size": dist.get_world_size() if distributed else 1,
                "ep": par.env.ep if par is not None else 1}, keep_last)
        except BaseException as exc:  # noqa: BLE001 -- reported on every rank below
            shutil.rmtree(tmp, ignore_errors=True)
            error = exc
    if not _agree(error is None, distributed):
        if error is not None:
            raise error
        raise CheckpointError(f"saving step {step} failed on rank 0")
    return final


def load_dcp_into(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                  par: Any | None = None) -> dict[str, Any]:
    """Load the model and optimizer state of DCP checkpoint ``path`` into the (parallelised) model
    and optimizer, resharding as needed (a collective). Returns the trainer state (no optimizer)."""
    path = Path(path)
    distributed = dist.is_available() and dist.is_initialized()
    warn_if_unsafe_torch(torch.__version__)
    reader = SafeFileSystemReader(path / DCP_DIR)
    reader.read_metadata()  # refuse a crafted .metadata up front, with a one-line error (every rank reads it)
    sd = _state(model, optimizer, par)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to")  # single process: intended
            dcp.load(sd, storage_reader=reader, no_dist=not distributed)
    except CheckpointException as exc:  # a BaseException listing every rank's failure: report one, in one line
        raise _one_error(path, exc) from None
    _unwrap(sd, par)
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    state = load_trainer_state(path)
    if path.parent.parent.name == CONVERT_DIR:  # a converted single-file checkpoint: done with it
        if distributed:
            dist.barrier()
        if not distributed or dist.get_rank() == 0:
            shutil.rmtree(path.parent.parent, ignore_errors=True)
    return state


def _one_error(path: Path, exc: CheckpointException) -> CheckpointError:
    errors = [e for e, _ in exc.failures.values()]
    for e in errors:
        if isinstance(e, CheckpointError):
            return e
    first = errors[0] if errors else exc
    return CheckpointError(f"{path}: cannot be loaded ({first.__class__.__name__}: {first_line(first)})")


def open_latest_dcp(run_dir: str | Path) -> Checkpoint:
    """The newest valid checkpoint of ``run_dir`` for a multi-process resume, without loading tensors:
    a Checkpoint with ``model=None`` and ``trainer_state=None`` (load them with :func:`load_dcp_into`).
    A corrupted checkpoint falls back to the previous one, as :func:`mhmoe.train.checkpoint.load_latest` does."""
    errors = []
    for path in reversed(list_checkpoints(run_dir)):
        try:
            meta = verify_checkpoint(path)
            if meta.get("format") == "dcp":  # a refused .metadata or trainer state falls back like a corrupted one
                SafeFileSystemReader(path / DCP_DIR).read_metadata()
                load_trainer_state(path, int(meta["step"]))
        except CheckpointError as exc:
            errors.append(str(exc))
            continue
        if meta.get("format") != "dcp":  # a single-process checkpoint: rank 0 converts it to DCP first
            conv = Path(run_dir) / CONVERT_DIR
            error = None
            if dist.get_rank() == 0:
                try:
                    shutil.rmtree(conv, ignore_errors=True)
                    path = _to_dcp(path, conv, no_dist=True)
                except Exception as exc:  # noqa: BLE001 -- reported on every rank below
                    error = exc
            if not _agree(error is None, True):
                raise error if error is not None else CheckpointError(f"{path}: conversion to DCP failed on rank 0")
            path = list_checkpoints(conv)[-1]
        return Checkpoint(path, int(meta["step"]), RunConfig.load(path / "config.yaml"), None,
                          load_tokenizer(path / "tokenizer"), None)
    raise CheckpointError(f"{run_dir}: no valid checkpoint ({errors[0] if errors else 'none found'})")


def dcp_to_safetensors(src: str | Path, out_run_dir: str | Path) -> Path:
    """Convert DCP checkpoint ``src`` into a single-file checkpoint ``OUT/checkpoints/step_N``."""
    ck = load_checkpoint(src)
    return save_checkpoint(out_run_dir, ck.step, ck.model, ck.run, ck.tokenizer, ck.trainer_state)


def safetensors_to_dcp(src: str | Path, out_run_dir: str | Path) -> Path:
    """Convert a checkpoint (single-file or DCP) into a DCP checkpoint ``OUT/checkpoints/step_N``,
    in this process (``train --resume`` under torchrun does this by itself for a single-file one)."""
    if dist.is_available() and dist.is_initialized():
        raise CheckpointError("safetensors_to_dcp runs in a single process (no process group)")
    return _to_dcp(src, out_run_dir)


def _to_dcp(src: str | Path, out_run_dir: str | Path, no_dist: bool = False) -> Path:
    ck = load_checkpoint(src)
    optimizer = build_optimizer(ck.model, ck.run.train)
    if "optimizer" in ck.trainer_state:
        optimizer.load_state_dict(ck.trainer_state["optimizer"])
    return save_dcp_checkpoint(out_run_dir, ck.step, ck.model, optimizer, ck.run, ck.tokenizer, ck.trainer_state,
                               no_dist=no_dist)
