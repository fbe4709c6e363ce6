"""An exclusive lock on a run directory, so two trainings never write into the same ``--out``.

The lock is an ``fcntl.flock`` on ``RUN/.lock``, held for the whole run. The kernel releases it when
the holding process ends, however it ends (``kill -9`` included), so a lock is never stale in the
sense of blocking forever; a lock file left by a process that died without releasing it still holds
that process's record (pid, host, start time), which the next run reports once as taken over. A
clean release truncates and removes the file.

Race-free acquisition (the file may be removed by the holder between our ``open`` and ``flock``):
after ``flock`` succeeds, the path must still name the inode we locked; otherwise retry. A second
writer gets :class:`~mhmoe.errors.ConfigError` naming ``--out`` and the holder, at once (no waiting).

``flock`` works on local file systems and on NFS (Linux emulates it with POSIX locks there); where
the file system refuses locks the run goes on unlocked, with a warning. Under torchrun only rank 0
takes the lock (see :func:`mhmoe.train.loop.train`).
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import time
from pathlib import Path
from types import TracebackType

from mhmoe.errors import ConfigError

try:
    import fcntl
except ImportError:  # pragma: no cover -- Windows: no flock
    fcntl = None  # type: ignore[assignment]

LOCK_FILE = ".lock"


def _holder(path: Path) -> dict:
    """The record a holder wrote into the lock file ({} if none or unreadable)."""
    try:
        rec = json.loads(path.read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError):
        return {}
    return rec if isinstance(rec, dict) else {}


def _describe(rec: dict) -> str:
    if not rec:
        return "another process"
    return f"process {rec.get('pid', '?')} on {rec.get('host', '?')}"


class RunDirLock:
    """``with RunDirLock(run_dir): ...`` holds the exclusive lock of ``run_dir`` (created if missing, with
    its missing parents; the directories this lock created that are still empty are removed again on
    release, so a run that fails during start-up leaves nothing behind, not even an empty ``runs/``).
    ``enabled=False`` (torchrun ranks > 0) does nothing."""

    def __init__(self, run_dir: str | Path, enabled: bool = True, warn: bool = True) -> None:
        self.run_dir, self.enabled, self.warn = Path(run_dir), enabled, warn
        self.path = self.run_dir / LOCK_FILE
        self.fd: int | None = None
        self.created: list[Path] = []  # directories this lock created, deepest first
        self.taken_over: dict = {}  # the record of a holder that died without releasing (if any)

    def __enter__(self) -> RunDirLock:
        if not self.enabled:
            return self
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise ConfigError("--out", str(self.run_dir), "a directory (this path is a file)")
        missing, p = [], self.run_dir
        while not os.path.lexists(p) and p != p.parent:
            missing.append(p)
            p = p.parent
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError("--out", str(self.run_dir), f"a directory that can be created ({exc.strerror})") from None
        self.created = missing
        try:
            self._acquire()
        except BaseException:
            self._remove_created_dir()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()

    # ------------------------------------------------------------------------------------------------
    def _acquire(self) -> None:
        if fcntl is None:  # pragma: no cover
            return
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise ConfigError("--out", str(self.run_dir),
                                      f"a run directory no other training is writing (locked by "
                                      f"{_describe(_holder(self.path))}; wait for it or choose another --out)"
                                      ) from None
                self.path.unlink(missing_ok=True)
                if self.warn:  # e.g. ENOLCK/EOPNOTSUPP: a file system without locks
                    print(f"mhmoe: warning: cannot lock {self.path} ({exc.strerror}); two trainings into "
                          f"{self.run_dir} at once would not be detected", file=sys.stderr)
                return
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the holder removed the file between our open and flock: try again
        self.fd = fd
        self.taken_over = _holder(self.path)
        if self.taken_over and self.warn:
            print(f"mhmoe: note: {self.run_dir} was locked by {_describe(self.taken_over)}, which ended without "
                  "releasing it (killed?); taking the lock over", file=sys.stderr)
        record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)

    def release(self) -> None:
        """Remove the lock file and release the lock (idempotent)."""
        if self.fd is not None:
            fd, self.fd = self.fd, None
            try:
                os.ftruncate(fd, 0)
                self.path.unlink(missing_ok=True)  # while still holding it: waiters re-check the inode
            finally:
                os.close(fd)  # releases the flock
        self._remove_created_dir()

    def _remove_created_dir(self) -> None:
        created, self.created = self.created, []
        for d in created:  # deepest first; rmdir removes only an empty directory
            try:
                d.rmdir()  # nothing but the (removed) lock file was written into it
            except OSError:
                break
