"""Where a training run starts: from step 0 (a new run directory), from the newest checkpoint of its own run
directory (``--resume``) or from another run's checkpoint into a new directory (``--branch-from``).

:func:`start_point` refuses, in one line naming ``--out``, a new run into a directory that holds another run's
checkpoints or logs, and a branch into anything but a new directory; a resume takes the checkpoint's run config
with this command's launch properties (:func:`mhmoe.train.resume.resumed_run`), and a resume of a run killed before
its first checkpoint starts that run's own ``config.yaml``, never the command's config.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from mhmoe.checkpoint.format import list_checkpoints
from mhmoe.checkpoint.layout import CONFIG_FILE, RUN_LOGS
from mhmoe.config.run import RunConfig
from mhmoe.errors import ConfigError
from mhmoe.loading.checkpoint import Checkpoint
from mhmoe.runtime.reading import regular_or_missing
from mhmoe.train.parallelism import SingleProcess
from mhmoe.train.resume import resumed_run


@dataclass
class StartPoint:
    """ckpt: the checkpoint the run continues from (None: step 0); run: the config it trains;
    from_config_file: a resume without checkpoint that starts the run's own ``config.yaml``."""

    ckpt: Checkpoint | None
    run: RunConfig
    from_config_file: bool = False


def start_point(run_dir: Path, run: RunConfig, resume: bool, branch: str | Path | None, par: SingleProcess,
                launch_fields: tuple[str, ...]) -> StartPoint:
    """The checkpoint and config that ``run_dir``'s training starts from (the module docstring)."""
    has_ckpt = bool(list_checkpoints(run_dir))
    if branch is not None:
        ckpt = _branch_checkpoint(run_dir, has_ckpt, branch, par, launch_fields)
    elif has_ckpt and not resume:
        raise ConfigError("--out", str(run_dir), "a new directory (it holds checkpoints: pass --resume to continue)")
    elif has_ckpt:
        ckpt = _resume_checkpoint(run_dir, run, par, launch_fields)
    else:
        logs = [n for n in RUN_LOGS if os.path.lexists(run_dir / n)]
        if logs and not resume:
            raise ConfigError("--out", str(run_dir), f"a new directory (it holds {logs[0]} of an earlier run and no "
                                                     "checkpoint: pass --resume to train that run again from step 0, "
                                                     "or choose another --out)")
        return _start_config(run_dir, run, resume, par, launch_fields)
    return StartPoint(ckpt, resumed_run(ckpt, run, launch_fields))


def _resume_checkpoint(run_dir: Path, run: RunConfig, par: SingleProcess,
                       launch_fields: tuple[str, ...]) -> Checkpoint:
    ckpt = par.load_checkpoint(run_dir)
    if par.is_rank0:
        taken = [f"train.{k}={getattr(run.train, k)}" if k == "max_steps" else k for k in launch_fields]
        taken.append("data.cache_dir")
        print(f"mhmoe: resuming from step {ckpt.step}, checkpoint {ckpt.path}, with the run's own config "
              f"(only {', '.join(taken)} are taken from this command)", file=sys.stderr)
    return ckpt


def _branch_checkpoint(run_dir: Path, has_ckpt: bool, branch: str | Path, par: SingleProcess,
                       launch_fields: tuple[str, ...]) -> Checkpoint:
    """The checkpoint a branch continues from, into a run directory that holds no run yet."""
    held = "checkpoints" if has_ckpt else next((n for n in RUN_LOGS if os.path.lexists(run_dir / n)), None)
    if held:
        raise ConfigError("--out", str(run_dir), f"a new directory for --branch-from (it holds {held} of another "
                                                 "run)")
    ckpt = par.load_checkpoint(Path(branch))
    if par.is_rank0:
        print(f"mhmoe: branching from step {ckpt.step}, checkpoint {ckpt.path}, with its run's config (only "
              f"{', '.join(launch_fields)} and data.cache_dir are taken from this command)", file=sys.stderr)
    return ckpt


def _start_config(run_dir: Path, run: RunConfig, resume: bool, par: SingleProcess,
                  launch_fields: tuple[str, ...]) -> StartPoint:
    """A run without checkpoint starts ``run`` from step 0, except on a resume of a run that wrote its
    ``config.yaml`` (killed before its first checkpoint, or during its first save): then the run's own config, with
    this command's launch properties, as a checkpoint's would be. An unreadable ``config.yaml`` (a symlink, a FIFO,
    damaged) is refused in one line; the run's configuration is never replaced by another."""
    saved_file = run_dir / CONFIG_FILE
    if not resume or not regular_or_missing(saved_file):
        if resume and par.is_rank0:
            print(f"mhmoe: note: {run_dir} holds no checkpoint and no {CONFIG_FILE} yet: starting the given config "
                  "from step 0", file=sys.stderr)
        return StartPoint(None, run)
    saved = RunConfig.load(saved_file)
    if par.is_rank0:
        print(f"mhmoe: note: {run_dir} holds no checkpoint yet: starting its own {saved_file} from step 0",
              file=sys.stderr)
    return StartPoint(None, resumed_run(SimpleNamespace(run=saved), run, launch_fields),  # type: ignore[arg-type]
                      from_config_file=True)
