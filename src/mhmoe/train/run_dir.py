"""What a run directory may hold where a training writes, checked before the first step: a run
directory prepared by someone else (downloaded, shared, or left by a careless script) must not make a
training fail hours later at its first checkpoint, nor make it block on a FIFO or write into a device.

Files mhmoe replaces by rename (``config.yaml``, ``results.json``, ``curves.png``; the logs are
rewritten by rename before lines are appended) may be missing, regular files (a hard link to a file
elsewhere is replaced, never written through) or symlinks (replaced, never followed); the directories
it writes into (``checkpoints/``, ``tb/``) may be missing or directories. Anything else (a FIFO, a
device, a socket, a directory where a file goes, a file where a directory goes, a symlinked
directory) is refused in one line naming it (:class:`~mhmoe.errors.UnsafePathError`, exit status 2).
The run directory's lock (``.lock``) is checked by :mod:`mhmoe.train.lock`.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from mhmoe.checkpoint.layout import CKPT_DIR, CONFIG_FILE, CURVES_FILE, EVAL_FILE, METRICS_FILE, RESULTS_FILE, TB_DIR
from mhmoe.errors import UnsafePathError
from mhmoe.runtime.files import what_it_is

#: files a training replaces by rename, and directories it writes into
RUN_FILES = (CONFIG_FILE, METRICS_FILE, EVAL_FILE, RESULTS_FILE, CURVES_FILE)
RUN_DIRS = (CKPT_DIR, TB_DIR)


def _refuse(path: Path, mode: int, want: str) -> UnsafePathError:
    return UnsafePathError(f"{path}: is {what_it_is(mode)}, where mhmoe writes {want} (remove it, or choose another "
                           "--out)")


def check_run_paths(run_dir: str | os.PathLike[str]) -> None:
    """Refuse, in one line naming it, a path of ``run_dir`` a training writes that is not what it must be
    (see the module docstring). Missing paths are fine: the training creates them."""
    run_dir = Path(run_dir)
    for name in RUN_FILES + RUN_DIRS:
        path = run_dir / name
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            continue
        if name in RUN_DIRS:
            if stat.S_ISLNK(mode):
                raise UnsafePathError(f"{path}: is a symlink; mhmoe does not write through symlinks inside run, "
                                      "export and cache directories (remove it, or choose another directory)")
            if not stat.S_ISDIR(mode):
                raise _refuse(path, mode, "a directory")
        elif not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
            raise _refuse(path, mode, "a regular file")
