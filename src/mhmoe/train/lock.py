"""An exclusive lock on a run directory, so two trainings never write into the same ``--out``.

The lock is :class:`filelock.FileLock` (``fcntl.flock`` on ``RUN/.lock``, opened with ``O_NOFOLLOW``
and never truncated by a contender), held for the whole run without waiting: a second writer gets
:class:`~mhmoe.errors.ConfigError` naming ``--out`` and the holder, at once. The kernel releases the
lock when the holding process ends, however it ends (``kill -9`` included), so a lock is never stale
in the sense of blocking forever. What filelock does not keep is who holds it: the holder writes a
record (pid, host, start time) into the locked file, which a refused writer reports and which a
later run, finding the record of a process that died without releasing, reports once as taken over.
A clean release removes the file while still holding the lock (filelock then sees the unlinked
inode and retries, so no two holders ever share the path).

A ``.lock`` that is a symlink (a run directory prepared by someone else) is refused in one line,
never followed or truncated. Where the file system refuses locks the run goes on unlocked, with a
warning. Under torchrun only rank 0 takes the lock (see :func:`mhmoe.train.loop.train`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import sys
import time
from pathlib import Path
from types import TracebackType

from filelock import FileLock, Timeout

from mhmoe.errors import ConfigError, UnsafePathError

LOCK_FILE = ".lock"
RECORD_BYTES = 4096  # a holder record is ~80 bytes; more is not a record
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def _parse(data: bytes) -> dict:
    try:
        rec = json.loads(data.decode("utf-8") or "{}")
    except (ValueError, RecursionError):
        return {}
    return rec if isinstance(rec, dict) else {}


def _read_record(path: Path) -> tuple[int | None, dict]:
    """(inode, holder record) of the lock file, read without following a symlink ((None, {}) if none)."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None, {}
    try:
        return os.fstat(fd).st_ino, _parse(os.pread(fd, RECORD_BYTES, 0))
    except OSError:
        return None, {}
    finally:
        os.close(fd)


def _describe(rec: dict) -> str:
    if not rec:
        return "another process"
    return f"process {str(rec.get('pid', '?'))[:20]} on {str(rec.get('host', '?'))[:100]}"


class RunDirLock:
    """``with RunDirLock(run_dir): ...`` holds the exclusive lock of ``run_dir`` (created if missing, with
    its missing parents; the directories this lock created that are still empty are removed again on
    release, so a run that fails during start-up leaves nothing behind, not even an empty ``runs/``).
    ``enabled=False`` (torchrun ranks > 0) does nothing."""

    def __init__(self, run_dir: str | Path, enabled: bool = True, warn: bool = True) -> None:
        self.run_dir, self.enabled, self.warn = Path(run_dir), enabled, warn
        self.path = self.run_dir / LOCK_FILE
        self.lock: FileLock | None = None
        self.fd: int | None = None
        self.created: list[Path] = []  # directories this lock created, deepest first
        self.taken_over: dict = {}  # the record of a holder that died without releasing (if any)
        self._before: tuple[int | None, dict] = (None, {})

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
        if self.path.is_symlink():
            raise UnsafePathError(f"{self.path}: is a symlink; mhmoe does not write through symlinks inside run "
                                  "directories (remove it)")
        self._before = _read_record(self.path)  # filelock may empty the file before on_acquired sees it
        lock = FileLock(self.path, timeout=0, fallback_to_soft=False, on_acquired=self._write_record)
        try:
            lock.acquire()
        except Timeout:
            raise ConfigError("--out", str(self.run_dir), f"a run directory no other training is writing (locked by "
                              f"{_describe(_read_record(self.path)[1])}; wait for it or choose another --out)"
                              ) from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # planted between the check and the open
                raise UnsafePathError(f"{self.path}: is a symlink; mhmoe does not write through symlinks inside "
                                      "run directories (remove it)") from None
            if self.warn:  # e.g. ENOLCK/EOPNOTSUPP/ENOSYS: a file system without locks
                print(f"mhmoe: warning: cannot lock {self.path} ({exc.strerror or exc}); two trainings into "
                      f"{self.run_dir} at once would not be detected", file=sys.stderr)
            return
        self.lock = lock
        if self.taken_over and self.warn:
            print(f"mhmoe: note: {self.run_dir} was locked by {_describe(self.taken_over)}, which ended without "
                  "releasing it (killed?); taking the lock over", file=sys.stderr)

    def _write_record(self, fd: int) -> None:
        """filelock's ``on_acquired`` hook (the flock is held): keep the previous holder's record, if this
        is the file it was written into, then write ours."""
        ino, before = self._before
        found = _parse(os.pread(fd, RECORD_BYTES, 0))
        self.taken_over = found or (before if ino == os.fstat(fd).st_ino else {})
        record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        self.fd = fd

    def release(self) -> None:
        """Remove the lock file and release the lock (idempotent)."""
        if self.lock is not None:
            lock, fd, self.lock, self.fd = self.lock, self.fd, None, None
            try:
                if fd is not None:
                    with contextlib.suppress(OSError):
                        os.ftruncate(fd, 0)
                        if os.path.samestat(os.lstat(self.path), os.fstat(fd)):
                            self.path.unlink()  # while still holding it: a waiter sees the unlinked inode
            finally:
                lock.release()
        self._remove_created_dir()

    def _remove_created_dir(self) -> None:
        created, self.created = self.created, []
        for d in created:  # deepest first; rmdir removes only an empty directory
            try:
                d.rmdir()  # nothing but the (removed) lock file was written into it
            except OSError:
                break
