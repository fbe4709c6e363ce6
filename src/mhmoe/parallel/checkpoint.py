"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP) in a torchrun job: the collective
save from any world size and the resharded load at any other (DCP reshards by global tensor offsets).
Only what needs a process group is here; the format, the restricted reader and single-process reading
are :mod:`mhmoe.checkpoint` and :mod:`mhmoe.loading`, the conversions :mod:`mhmoe.train.convert`.

Layout of a DCP checkpoint (same directory scheme as single-file checkpoints)::

    RUN/checkpoints/step_00000600/
        dcp/               DCP files (.metadata + one __<rank>_0.distcp per writing rank) holding
                           {"model": FQN -> tensor, "optim": FQN-keyed AdamW state}
        config.yaml  tokenizer/  trainer_state.pt (step, scheduler, RNG, counters; no optimizer)
        meta.json          {"format": "dcp", "world_size", "ep", "files": sha256 of every file}, last

Expert parameters under expert parallelism are saved as DTensors on the ``("dp", "ep")`` mesh with
placements ``[Replicate(), Shard(0)]`` (DDP) or on the ``("ep", "dp")`` mesh with ``[Shard(0), Shard(0)]``
(FSDP2 shards each rank's experts over dp), global shape [E, ...]; other FSDP2 parameters are DTensors
already; DDP parameters are plain replicated tensors (DCP writes one copy). All ranks write into a
hidden temporary directory that rank 0 publishes (fsync'd, renamed into place) after the metadata is
complete, so a crash never leaves a half-written checkpoint under a real name (a shared filesystem is
assumed across nodes). :func:`mhmoe.loading.checkpoint.load_checkpoint` reads DCP checkpoints in one
process, so ``eval``, ``generate`` and a single-process ``train --resume`` accept them.

Checkpoints are read only through :mod:`mhmoe.checkpoint.dcp_reader` (a restricted unpickler for
``.metadata``, ``weights_only=True`` for every item): loading a checkpoint never executes code from it.
"""

from __future__ import annotations

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

from mhmoe.checkpoint.dcp_reader import SafeFileSystemReader
from mhmoe.checkpoint.format import newest_valid, publish_checkpoint, verify_checkpoint
from mhmoe.checkpoint.layout import (
    CONFIG_FILE,
    CONVERT_DIR,
    DCP,
    DCP_DIR,
    FORMAT_VERSION,
    TOKENIZER_DIR,
    checkpoint_path,
)
from mhmoe.checkpoint.read import read_trainer_state, warn_if_unsafe_torch
from mhmoe.checkpoint.write import model_is_finite, saving, stage_checkpoint, write_common_files
from mhmoe.config.run import RunConfig
from mhmoe.data.tokenizer import load_tokenizer
from mhmoe.errors import CheckpointError, one_line
from mhmoe.loading.checkpoint import Checkpoint
from mhmoe.runtime.files import remove_tree, staging_path
from mhmoe.train.convert import to_dcp

__all__ = ["load_dcp_into", "open_latest_dcp", "save_dcp_checkpoint"]


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
    Running out of space raises NoSpaceError on the rank that hit it (CheckpointError on the others).
    """
    distributed = not no_dist and dist.is_available() and dist.is_initialized()
    rank0 = not distributed or dist.get_rank() == 0
    if not _agree(model_is_finite(model), distributed):
        raise CheckpointError(f"refusing to save step {step}: the model has non-finite parameters")
    final = checkpoint_path(run_dir, step)
    tmp = staging_path(final, DCP)

    def on_rank0(write: Any) -> None:  # rank 0 alone writes; every rank learns whether it worked
        error = None
        if rank0:
            try:
                with saving(run_dir, step):
                    write()
            except BaseException as exc:  # noqa: BLE001 -- reported on every rank below
                remove_tree(tmp)
                error = exc
        if not _agree(error is None, distributed):
            raise error if error is not None else CheckpointError(f"saving step {step} failed on rank 0")

    on_rank0(lambda: stage_checkpoint(run_dir, step, DCP))
    try:
        with warnings.catch_warnings(), saving(run_dir, step):
            warnings.filterwarnings("ignore", message=".*assuming the intent is to")  # single process: intended
            dcp.save(_state(model, optimizer, par), checkpoint_id=str(tmp / DCP_DIR), no_dist=not distributed)
    except BaseException:
        if rank0:
            remove_tree(tmp)
        raise
    if distributed:
        dist.barrier()

    def finish() -> None:
        write_common_files(tmp, run, tokenizer, {k: v for k, v in trainer_state.items() if k != "optimizer"})
        publish_checkpoint(tmp, final, run_dir, {
            "format_version": FORMAT_VERSION, "format": DCP, "step": step,
            "world_size": dist.get_world_size() if distributed else 1,
            "ep": par.env.ep if par is not None else 1}, keep_last)

    on_rank0(finish)
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
    state = read_trainer_state(path, for_resume=True)
    if path.parent.parent.name == CONVERT_DIR:  # a converted single-file checkpoint: done with it
        if distributed:
            dist.barrier()
        if not distributed or dist.get_rank() == 0:
            remove_tree(path.parent.parent)
    return state


def _one_error(path: Path, exc: CheckpointException) -> CheckpointError:
    errors = [e for e, _ in exc.failures.values()]
    for e in errors:
        if isinstance(e, CheckpointError):
            return e
    first = errors[0] if errors else exc
    return CheckpointError(f"{path}: cannot be loaded ({first.__class__.__name__}: {one_line(first)})")


def _probe(path: Path) -> tuple[Path, dict[str, Any]]:
    """(path, meta.json) of a checkpoint a torchrun resume can start from: verified, and a DCP one's
    ``.metadata`` and trainer state readable (refused ones fall back like corrupted ones)."""
    meta = verify_checkpoint(path)
    if meta.get("format") == DCP:
        SafeFileSystemReader(path / DCP_DIR).read_metadata()
        read_trainer_state(path, int(meta["step"]), for_resume=True)
    return path, meta


def open_latest_dcp(run_dir: str | Path) -> Checkpoint:
    """The newest valid checkpoint of ``run_dir`` for a multi-process resume, without loading tensors:
    a Checkpoint with ``model=None`` and ``trainer_state=None`` (load them with :func:`load_dcp_into`).
    A corrupted checkpoint falls back to the previous one (:func:`mhmoe.checkpoint.format.newest_valid`,
    reported on rank 0); a single-file one is converted to DCP by rank 0 first."""
    path, meta = newest_valid(run_dir, _probe, warn=not dist.is_initialized() or dist.get_rank() == 0)
    if meta.get("format") != DCP:  # a single-process checkpoint: rank 0 converts it to DCP first
        conv = Path(run_dir) / CONVERT_DIR
        error = None
        if dist.get_rank() == 0:
            try:
                remove_tree(conv)
                path = to_dcp(path, conv)
            except Exception as exc:  # noqa: BLE001 -- reported on every rank below
                error = exc
        if not _agree(error is None, True):
            raise error if error is not None else CheckpointError(f"{path}: conversion to DCP failed on rank 0")
        path = checkpoint_path(conv, int(meta["step"]))
    return Checkpoint(path, int(meta["step"]), RunConfig.load(path / CONFIG_FILE), None,
                      load_tokenizer(path / TOKENIZER_DIR), None, DCP)
